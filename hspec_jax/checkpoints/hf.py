"""Hugging Face checkpoints: read and write `config.json` + safetensors (or `pytorch_model.bin`) directories.

The name table `target_key_table` is the one place that maps HF tensor names to our parameter paths.
Loading is strict: every tensor in the file must be consumed and every shape must match, otherwise a
`CheckpointError` names the offending key.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import socket
import tempfile
from collections.abc import Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import safetensors
import safetensors.numpy

from hspec_jax.errors import InputError, is_no_space
from hspec_jax.models.config import TargetConfig
from hspec_jax.models.decoder import param_shapes

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_BIN = "pytorch_model.bin"
TORCH_BIN_INDEX = "pytorch_model.bin.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
# Derived buffers some older checkpoints saved; they carry no learned state and are recomputed.
_DERIVED_BUFFERS = ("rotary_emb.inv_freq",)


class CheckpointError(InputError):
    """A checkpoint does not match what the model expects (missing/unknown key, wrong shape, bad path, a
    truncated or corrupted file, non-finite weights, no room to write)."""


def read_json(path: str) -> dict:
    """The JSON object in `path`; a truncated or malformed file is an error that names it."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e}); the file may be truncated") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def target_config_from_hf(hf: dict, source: str, **overrides) -> TargetConfig:
    """`TargetConfig.from_hf`, with a bad or missing value reported against the file it came from."""
    try:
        return TargetConfig.from_hf(hf, **overrides)
    except (ValueError, TypeError, KeyError) as e:
        raise CheckpointError(f"{source}: {e}") from None


def check_finite(params: dict, source: str) -> None:
    """Refuse weights holding NaN or Inf (a corrupted file would otherwise decode blank text). Arrays on the
    CPU are checked in place with numpy; elsewhere one jitted reduction per array runs on the device."""
    leaves = jax.tree_util.tree_leaves_with_path(params)
    if all(d.platform == "cpu" for _, x in leaves for d in x.devices()):
        finite = [bool(np.isfinite(np.asarray(x)).all()) for _, x in leaves]
    else:
        finite = jax.device_get(jax.jit(lambda xs: [jnp.isfinite(x).all() for x in xs])([x for _, x in leaves]))
    bad = [jax.tree_util.keystr(path) for (path, _), ok in zip(leaves, finite, strict=True) if not ok]
    if bad:
        raise CheckpointError(f"{source}: parameter {bad[0]} holds NaN or Inf values ({len(bad)} such array(s))")


def target_key_table(config: TargetConfig) -> dict[str, tuple[tuple, bool]]:
    """HF tensor name -> (parameter path, transpose?) for every parameter of the target. A decoder layer's
    path holds its index, `("layers", i, "self_attn", ...)`: row i of the stacked array at the path without it
    (the layers are stacked in memory, one tensor per layer in HF files)."""
    table = {
        "model.embed_tokens.weight": (("embed_tokens", "embedding"), False),
        "model.norm.weight": (("norm", "scale"), False),
    }
    if not config.tie_word_embeddings:
        table["lm_head.weight"] = (("lm_head",), False)
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}.", ("layers", i)
        table[hf + "input_layernorm.weight"] = ((*ours, "input_layernorm", "scale"), False)
        table[hf + "post_attention_layernorm.weight"] = ((*ours, "post_attention_layernorm", "scale"), False)
        for proj, has_bias in (
            ("q", config.qkv_bias),
            ("k", config.qkv_bias),
            ("v", config.qkv_bias),
            ("o", config.o_bias),
        ):
            table[hf + f"self_attn.{proj}_proj.weight"] = (
                (*ours, "self_attn", f"{proj}_proj", "kernel"),
                True,
            )
            if has_bias:
                table[hf + f"self_attn.{proj}_proj.bias"] = (
                    (*ours, "self_attn", f"{proj}_proj", "bias"),
                    False,
                )
        if config.qk_norm:
            for norm in ("q_norm", "k_norm"):
                table[hf + f"self_attn.{norm}.weight"] = ((*ours, "self_attn", norm, "scale"), False)
        for proj in ("gate", "up", "down"):
            table[hf + f"mlp.{proj}_proj.weight"] = ((*ours, "mlp", f"{proj}_proj", "kernel"), True)
            if config.mlp_bias:
                table[hf + f"mlp.{proj}_proj.bias"] = ((*ours, "mlp", f"{proj}_proj", "bias"), False)
    return table


def params_from_state_dict(
    state: Mapping[str, np.ndarray],
    config: TargetConfig,
    key_table: Mapping | None = None,
    expected: dict | None = None,
) -> dict:
    """Strictly convert an HF-named state dict to our nested param dict of device arrays (`param_dtype`)."""
    table = key_table if key_table is not None else target_key_table(config)
    if expected is None:
        expected = param_shapes(config)
    params: dict = {}
    missing = [name for name in table if name not in state]
    if missing:
        raise CheckpointError(f"checkpoint is missing {len(missing)} tensor(s), first: {missing[0]!r}")
    for name, value in state.items():
        if name in table:
            continue
        if name.endswith(_DERIVED_BUFFERS):
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings:
            if not np.array_equal(np.asarray(value), np.asarray(state["model.embed_tokens.weight"])):
                raise CheckpointError("config ties the embeddings but 'lm_head.weight' differs from the embedding")
            continue
        raise CheckpointError(f"unknown tensor {name!r} in checkpoint (not part of a {config.model_type} model)")
    for name, (path, transpose) in table.items():
        value = np.asarray(state[name])
        if transpose:
            value = value.T
        want = _get(expected, path)
        if tuple(value.shape) != tuple(want.shape):
            raise CheckpointError(
                f"tensor {name!r} has shape {tuple(np.shape(state[name]))}, expected "
                f"{tuple(want.shape[::-1]) if transpose else tuple(want.shape)}"
            )
        _set(params, path, value.astype(want.dtype))
    return jax.device_put(_stack(params))


def state_dict_from_params(
    params: dict, config: TargetConfig, key_table: Mapping | None = None, dtype=None
) -> dict[str, np.ndarray]:
    """Our param dict -> HF-named numpy arrays (`[out, in]` linears), optionally cast to `dtype`."""
    table = key_table if key_table is not None else target_key_table(config)
    out = {}
    for name, (path, transpose) in table.items():
        value = np.asarray(_get(params, path))
        if transpose:
            value = value.T
        out[name] = np.ascontiguousarray(value.astype(dtype) if dtype is not None else value)
    return out


def _get(tree: Mapping, path: tuple):
    """The value at `path`; an int in the path picks that row of the leaf's leading (layer) axis."""
    rows = [part for part in path if isinstance(part, int)]
    for part in path:
        if not isinstance(part, int):
            tree = tree[part]
    for row in rows:
        tree = jax.ShapeDtypeStruct(tree.shape[1:], tree.dtype) if isinstance(tree, jax.ShapeDtypeStruct) else tree[row]
    return tree


def _set(tree: dict, path: tuple, value) -> None:
    """Set the value at `path`; with an int in the path, row `i` of a list that `_stack` turns into the leaf."""
    names = [part for part in path if not isinstance(part, int)]
    rows = [part for part in path if isinstance(part, int)]
    for part in names[:-1]:
        tree = tree.setdefault(part, {})
    if not rows:
        tree[names[-1]] = value
        return
    (row,) = rows
    layers = tree.setdefault(names[-1], [])
    layers.extend([None] * (row + 1 - len(layers)))
    layers[row] = value


def _stack(tree):
    """`tree` with every list of per-layer rows (from `_set`) stacked into one array on a leading axis."""
    if isinstance(tree, dict):
        return {key: _stack(value) for key, value in tree.items()}
    return np.stack(tree) if isinstance(tree, list) else tree


def read_config(directory: str) -> dict:
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"no config.json in {directory!r}")
    return read_json(path)


def hf_target_config(directory: str, **config_overrides) -> TargetConfig:
    """The target config of an HF checkpoint directory (its `config.json`)."""
    return target_config_from_hf(read_config(directory), os.path.join(directory, "config.json"), **config_overrides)


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """All tensors of one safetensors file; a truncated or corrupted file is an error that names it."""
    try:
        return safetensors.numpy.load_file(path)
    except safetensors.SafetensorError as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None


def read_state_dict(directory: str) -> dict[str, np.ndarray]:
    """All tensors of an HF directory: single or sharded safetensors, or (needs torch) pytorch_model.bin."""
    files = list(_weight_files(directory))
    state: dict[str, np.ndarray] = {}
    for path in files:
        part = _read_torch(path) if path.endswith(".bin") else read_safetensors(path)
        overlap = state.keys() & part.keys()
        if overlap:
            raise CheckpointError(f"tensor {sorted(overlap)[0]!r} appears in more than one shard")
        state.update(part)
    return state


def _weight_files(directory: str) -> Iterator[str]:
    if not os.path.isdir(directory):
        raise CheckpointError(f"checkpoint directory {directory!r} does not exist")
    for single, index in ((SAFETENSORS, SAFETENSORS_INDEX), (TORCH_BIN, TORCH_BIN_INDEX)):
        if os.path.isfile(os.path.join(directory, single)):
            yield os.path.join(directory, single)
            return
        if os.path.isfile(os.path.join(directory, index)):
            weight_map = read_json(os.path.join(directory, index)).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{os.path.join(directory, index)}: no weight_map")
            shards = sorted(set(weight_map.values()))
            for shard in shards:
                path = os.path.join(directory, shard)
                if not os.path.isfile(path):
                    raise CheckpointError(f"shard {shard!r} listed in {index} is missing")
                yield path
            return
    raise CheckpointError(
        f"no weights in {directory!r}: expected {SAFETENSORS}, {SAFETENSORS_INDEX}, {TORCH_BIN} or {TORCH_BIN_INDEX}"
    )


def _read_torch(path: str) -> dict[str, np.ndarray]:
    try:
        import torch
    except ImportError as e:  # torch is an optional (test/conversion) dependency
        raise CheckpointError(f"reading {path!r} needs PyTorch: pip install 'torch==2.13.0'") from e
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError) as e:
        raise CheckpointError(f"{path}: not a readable PyTorch checkpoint ({e})") from None
    return {k: v.float().numpy() if v.dtype == torch.bfloat16 else v.numpy() for k, v in state.items()}


def load_hf_target(directory: str, **config_overrides) -> tuple[TargetConfig, dict]:
    """(config, params) from an HF checkpoint directory."""
    config = hf_target_config(directory, **config_overrides)
    params = params_from_state_dict(read_state_dict(directory), config)
    check_finite(params, directory)
    return config, params


def write_state_dict(
    state: Mapping[str, np.ndarray], directory: str, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
) -> list[str]:
    """Write safetensors, one file or `model-0000i-of-0000n.safetensors` shards plus an index above the limit."""
    os.makedirs(directory, exist_ok=True)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in state:
        nbytes = state[name].nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = state[name]
        size += nbytes
    metadata = {"format": "pt"}
    if len(shards) == 1:
        safetensors.numpy.save_file(shards[0], os.path.join(directory, SAFETENSORS), metadata=metadata)
        return [SAFETENSORS]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards, strict=True):
        safetensors.numpy.save_file(shard, os.path.join(directory, name), metadata=metadata)
        weight_map.update(dict.fromkeys(shard, name))
    index = {"metadata": {"total_size": sum(v.nbytes for v in state.values())}, "weight_map": weight_map}
    with open(os.path.join(directory, SAFETENSORS_INDEX), "w") as f:
        json.dump(index, f, indent=2)
    return names


def export_hf_target(
    params: dict,
    config: TargetConfig,
    directory: str,
    *,
    dtype=None,
    tokenizer=None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> None:
    """Write an HF directory (`config.json` + safetensors [+ tokenizer]) that `AutoModelForCausalLM` loads."""
    state = state_dict_from_params(params, config, dtype=dtype)
    hf_config = config.to_hf()
    if dtype is not None:
        hf_config["torch_dtype"] = str(np.dtype(dtype))
    with staged_directory(directory) as staging:
        write_state_dict(state, staging, max_shard_bytes)
        with open(os.path.join(staging, "config.json"), "w") as f:
            json.dump(hf_config, f, indent=2)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)


def _existing_parent(directory: str) -> str:
    parent = os.path.dirname(os.path.abspath(directory))
    while not os.path.isdir(parent):
        parent = os.path.dirname(parent)
    return parent


def check_output_directory(directory: str, needed_bytes: int = 0) -> None:
    """Refuse, before any work, to write into an existing non-empty directory, where nothing can be written,
    or where fewer than `needed_bytes` are free."""
    directory = os.path.abspath(directory)
    if os.path.exists(directory) and (not os.path.isdir(directory) or os.listdir(directory)):
        raise CheckpointError(f"output directory {directory!r} exists and is not empty")
    parent = _existing_parent(directory)
    free = shutil.disk_usage(parent).free
    if needed_bytes > free:
        raise CheckpointError(
            f"no space left on {parent}: the checkpoint needs about {needed_bytes / 2**20:.1f} MiB, "
            f"{free / 2**20:.1f} MiB are free"
        )
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write-test-", dir=parent))
    except OSError as e:
        raise CheckpointError(f"cannot write to {parent!r}: {e.strerror}") from None


def _default_permissions(root: str) -> None:
    """mkdtemp (and safetensors) create owner-only entries; give the output the usual umask-based modes."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(root, 0o777 & ~umask)
    for parent, dirs, files in os.walk(root):
        for name in dirs:
            os.chmod(os.path.join(parent, name), 0o777 & ~umask)
        for name in files:
            os.chmod(os.path.join(parent, name), 0o666 & ~umask)


_STAGING = ".staging-"


def _staging_prefix() -> str:
    """Staging directories are named after the process writing them, so a later run can tell a stale one."""
    return f"{_STAGING}{os.getpid()}@{socket.gethostname()}-"


def remove_stale_staging(parent: str) -> list[str]:
    """Delete the staging directories in `parent` left by killed runs on this host; returns their paths."""
    removed = []
    host = socket.gethostname()
    for name in os.listdir(parent):
        owner, at, rest = name.removeprefix(_STAGING).partition("@")
        if not name.startswith(_STAGING) or not at or not owner.isdigit() or rest.rpartition("-")[0] != host:
            continue
        try:
            os.kill(int(owner), 0)
            continue  # still running
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # alive, another user's
        shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
        removed.append(os.path.join(parent, name))
    return removed


@contextlib.contextmanager
def staged_directory(directory: str) -> Iterator[str]:
    """Yield a staging directory that becomes `directory` only if the block succeeds (nothing half-written).
    Staging directories of killed runs beside it are removed first; a full disk is reported in one line."""
    directory = os.path.abspath(directory)
    check_output_directory(directory)
    parent = os.path.dirname(directory)
    os.makedirs(parent, exist_ok=True)
    remove_stale_staging(parent)
    staging = tempfile.mkdtemp(prefix=_staging_prefix(), dir=parent)
    try:
        yield staging
        _default_permissions(staging)
        if os.path.exists(directory):
            os.rmdir(directory)
        os.replace(staging, directory)
    except Exception as e:
        if is_no_space(e):
            raise CheckpointError(f"no space left on {parent}") from e
        raise
    finally:
        if os.path.exists(staging):
            shutil.rmtree(staging)
