"""GGUF import: read a llama.cpp GGUF file, dequantize every tensor, and map it onto HF names.

llama.cpp's converter permutes the rows of Llama q/k projections for its interleaved RoPE; we use
HF's rotate-half RoPE, so those rows are permuted back here (Qwen GGUFs are stored unpermuted).
Every tensor in the file must be consumed; anything unknown is an error naming the tensor.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import struct
from pathlib import Path
from typing import NamedTuple

import gguf
import jax
import numpy as np
import safetensors
import safetensors.numpy
from flax import traverse_util

from hspec_jax.checkpoints.hf import CheckpointError, check_finite, params_from_state_dict, target_config_from_hf
from hspec_jax.models.config import TargetConfig
from hspec_jax.models.decoder import param_shapes
from hspec_jax.user_cache import user_cache_dir

# GGUF architecture -> HF model_type, and whether llama.cpp permuted q/k rows on conversion.
_ARCHITECTURES = {"llama": ("llama", True), "qwen3": ("qwen3", False), "qwen2": ("qwen2", False)}
_TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_PER_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


class GGUFTensor(NamedTuple):
    name: str
    shape: tuple[int, ...]  # GGUF order: the contiguous (row) dimension first
    tensor_type: gguf.GGMLQuantizationType
    data: np.ndarray  # memory-mapped: float32/float16 elements, or uint8 `[rows, bytes per row]` when quantized


class GGUFFile(NamedTuple):
    metadata: dict  # key -> int, float, bool, str, or a list of them (arrays)
    tensors: list[GGUFTensor]


_SCALARS = {
    gguf.GGUFValueType.UINT8: "B",
    gguf.GGUFValueType.INT8: "b",
    gguf.GGUFValueType.UINT16: "H",
    gguf.GGUFValueType.INT16: "h",
    gguf.GGUFValueType.UINT32: "I",
    gguf.GGUFValueType.INT32: "i",
    gguf.GGUFValueType.FLOAT32: "f",
    gguf.GGUFValueType.BOOL: "?",
    gguf.GGUFValueType.UINT64: "Q",
    gguf.GGUFValueType.INT64: "q",
    gguf.GGUFValueType.FLOAT64: "d",
}
_ELEMENT_DTYPES = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16}


class _Cursor:
    """Little-endian reads from a byte buffer, advancing an offset."""

    def __init__(self, buffer):
        self.buffer, self.offset = buffer, 0

    def read(self, fmt: str):
        (value,) = struct.unpack_from("<" + fmt, self.buffer, self.offset)
        self.offset += struct.calcsize("<" + fmt)
        return value

    def string(self) -> str:
        n = self.read("Q")
        if self.offset + n > len(self.buffer):
            raise ValueError("a string runs past the end of the file")
        self.offset += n
        return bytes(self.buffer[self.offset - n : self.offset]).decode("utf-8", errors="replace")

    def value(self, kind: int):
        if kind == gguf.GGUFValueType.STRING:
            return self.string()
        if kind == gguf.GGUFValueType.ARRAY:
            element, n = self.read("I"), self.read("Q")
            if element in _SCALARS:  # numbers in one read
                fmt = f"<{n}{_SCALARS[element]}"
                values = struct.unpack_from(fmt, self.buffer, self.offset)
                self.offset += struct.calcsize(fmt)
                return list(values)
            return [self.value(element) for _ in range(n)]
        if kind not in _SCALARS:
            raise ValueError(f"unknown metadata value type {kind}")
        return self.read(_SCALARS[kind])


def parse_gguf(path: str) -> GGUFFile:
    """The metadata and memory-mapped tensors of a little-endian GGUF file (version 2 or 3). Reads the header with
    `struct` (SmolLM2's 49k-token vocabulary in ~0.12 s; `gguf.GGUFReader` takes ~3.5 s); raises ValueError,
    struct.error or KeyError on a malformed or truncated file."""
    buffer = np.memmap(path, dtype=np.uint8, mode="r")
    cursor = _Cursor(memoryview(buffer))  # slices of a memoryview are cheap, a memmap's are new memmap objects
    if bytes(buffer[:4]) != b"GGUF":
        raise ValueError("no GGUF magic number")
    version = cursor.read("4x I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (a big-endian file, or not version 2 or 3)")
    num_tensors, num_fields = cursor.read("Q"), cursor.read("Q")
    metadata = {}
    for _ in range(num_fields):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.read("I"))
    infos = []
    for _ in range(num_tensors):
        name = cursor.string()
        shape = tuple(cursor.read("Q") for _ in range(cursor.read("I")))
        infos.append((name, shape, gguf.GGMLQuantizationType(cursor.read("I")), cursor.read("Q")))
    alignment = int(metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT))
    start = -(-cursor.offset // alignment) * alignment
    tensors = []
    for name, shape, kind, offset in infos:
        block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
        count = int(np.prod(shape))
        size = count // block * block_bytes
        if start + offset + size > len(buffer):
            raise ValueError(f"tensor {name!r} runs past the end of the file")
        data = buffer[start + offset : start + offset + size]
        if kind in _ELEMENT_DTYPES:
            data = data.view(_ELEMENT_DTYPES[kind])
        else:
            data = data.reshape(count // shape[0], shape[0] // block * block_bytes)
        tensors.append(GGUFTensor(name, shape, kind, data))
    return GGUFFile(metadata, tensors)


def _field(reader: GGUFFile, key: str, default=None):
    value = reader.metadata.get(key)
    if value is None:
        if default is None:
            raise CheckpointError(f"GGUF metadata key {key!r} is missing")
        return default
    return value


def hf_config_from_gguf(reader: GGUFFile) -> dict:
    """An HF-style `config.json` dict from GGUF metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise CheckpointError(f"unknown GGUF architecture {arch!r}; supported: {sorted(_ARCHITECTURES)}")
    if f"{arch}.rope.scaling.type" in reader.metadata or "rope_freqs.weight" in {t.name for t in reader.tensors}:
        raise CheckpointError(
            "GGUF files with RoPE scaling (rope_freqs / rope.scaling.*) are not supported; "
            "import the HF safetensors checkpoint instead"
        )
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    tokens = reader.metadata.get("tokenizer.ggml.tokens")
    vocab = int(_field(reader, f"{arch}.vocab_size", len(tokens) if tokens is not None else -1))
    tensor_names = {t.name for t in reader.tensors}
    cfg = {
        "model_type": _ARCHITECTURES[arch][0],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names and arch != "qwen2",
    }
    for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
        if f"tokenizer.ggml.{name}_token_id" in reader.metadata:
            cfg[key] = int(_field(reader, f"tokenizer.ggml.{name}_token_id"))
    return cfg


def tokenizer_from_gguf(reader: GGUFFile, path: str):
    """The fast tokenizer (vocabulary, merges, special tokens, chat template) that a GGUF file's metadata describes,
    built by transformers' GGUF converter from the metadata this module parsed: the same tokenizer as
    `AutoTokenizer.from_pretrained(..., gguf_file=...)` (tests/test_smollm2.py compares them) without reading the
    config and the file again through the `gguf` package or importing torch: SmolLM2's, from an empty user cache,
    in a 3.8 s process instead of 11.0 s (3.0 s with the tokenizer cached)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    meta = reader.metadata
    parts = {
        group: {name: meta[f"tokenizer.{key}"] for key, name in names.items() if f"tokenizer.{key}" in meta}
        for group, names in GGUF_TOKENIZER_MAPPING.items()
    }
    described, settings = parts["tokenizer"], parts["tokenizer_config"]
    if described.get("tokenizer_type") == "llama":  # llama.cpp adds BOS to a sentencepiece vocabulary by default
        settings.setdefault("add_bos_token", True)
    tokens = described.get("tokens") or []
    for role, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        index = meta.get(f"tokenizer.ggml.{key}_token_id")
        settings[f"{role}_token"] = tokens[index] if index is not None and index < len(tokens) else None
    try:
        backend, extra = convert_gguf_tokenizer(_field(reader, "general.architecture"), described)
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"{path}: no usable tokenizer ({e})") from None
    return PreTrainedTokenizerFast(tokenizer_object=backend, **settings, **extra)


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved pairs -> rotate-half halves), per head."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def state_dict_from_gguf(reader: GGUFFile, config: TargetConfig) -> dict[str, np.ndarray]:
    """Dequantized tensors (float32) under HF names, with Llama q/k rows un-permuted."""
    permuted = _ARCHITECTURES[_field(reader, "general.architecture")][1]
    state = {}
    for tensor in reader.tensors:
        name = tensor.name
        if name in _TOP_LEVEL:
            hf_name = _TOP_LEVEL[name]
        else:
            parts = name.split(".", 2)
            if len(parts) != 3 or parts[0] != "blk" or parts[2] not in _PER_LAYER:
                raise CheckpointError(f"unknown tensor {name!r} in GGUF file")
            hf_name = f"model.layers.{int(parts[1])}.{_PER_LAYER[parts[2]]}"
        value = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        value = value.reshape([int(d) for d in reversed(tensor.shape)])
        if permuted and name.endswith(("attn_q.weight", "attn_q.bias")):
            value = _unpermute(value, config.num_heads)
        elif permuted and name.endswith(("attn_k.weight", "attn_k.bias")):
            value = _unpermute(value, config.num_kv_heads)
        state[hf_name] = value
    return state


def load_gguf_target(path: str, **config_overrides) -> tuple[TargetConfig, dict]:
    """(config, params) from a GGUF file; weights are dequantized to `config.param_dtype`.

    Dequantizing takes seconds (SmolLM2's Q4_1 file: ~7 s on 2 cores), so the result is kept in the user cache
    (`$XDG_CACHE_HOME/hspec_jax/targets/`, one safetensors file of the stacked tree per GGUF file and config) and
    read back by later processes; the entry is keyed by the file's `file_stamp` (path, inode, size, modification
    time), the config and the format version, so a rewritten file or another dtype is dequantized again, and an
    entry that does not load or does not match the config's shapes is replaced."""
    reader = read_gguf(path)
    config = gguf_target_config(reader, path, **config_overrides)
    cached = dequantized_cache_path(path, config)
    params = _read_dequantized(cached, config)
    if params is None:
        params = params_from_state_dict(state_dict_from_gguf(reader, config), config)
        check_finite(params, path)
        _write_dequantized(cached, params)
    return config, params


DEQUANTIZED_FORMAT = 1  # bump when the stored layout changes


def dequantized_cache_path(path: str, config: TargetConfig) -> Path:
    """The user-cache file holding `path`'s weights dequantized for `config`."""
    key = json.dumps([*file_stamp(path), repr(config), DEQUANTIZED_FORMAT])
    return user_cache_dir("targets") / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.safetensors"


def _read_dequantized(cached: Path, config: TargetConfig) -> dict | None:
    """The params stored at `cached`, checked against the config's shapes and dtypes; None if absent or unusable."""
    if not cached.is_file():
        return None
    try:
        flat = safetensors.numpy.load_file(str(cached))
    except (safetensors.SafetensorError, OSError):
        return None
    expected = traverse_util.flatten_dict(param_shapes(config), sep="/")
    if set(flat) != set(expected) or any(
        flat[k].shape != v.shape or flat[k].dtype != v.dtype for k, v in expected.items()
    ):
        return None
    return jax.device_put(traverse_util.unflatten_dict(flat, sep="/"))


def _write_dequantized(cached: Path, params: dict) -> None:
    """Store `params` at `cached` (whole or not at all); an unwritable cache is skipped."""
    flat = {k: np.asarray(v) for k, v in traverse_util.flatten_dict(jax.device_get(params), sep="/").items()}
    tmp = cached.with_suffix(f".{os.getpid()}.tmp")
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        safetensors.numpy.save_file(flat, str(tmp))
        tmp.replace(cached)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()


def gguf_target_config(reader: GGUFFile, path: str, **config_overrides) -> TargetConfig:
    """The target config described by a GGUF file's metadata."""
    return target_config_from_hf(hf_config_from_gguf(reader), path, **config_overrides)


def file_stamp(path: str) -> tuple[str, int, int, int]:
    """(real path, inode, size, modification time in ns): what a per-process cache of a file's contents is keyed
    by, so that a file replaced or rewritten in place is read again."""
    stat = os.stat(path)
    return os.path.realpath(path), stat.st_ino, stat.st_size, stat.st_mtime_ns


def read_gguf(path: str) -> GGUFFile:
    """Open a GGUF file (memory-mapped); a truncated or corrupted file is an error that names it. One process
    parses each file once: reading the config and then the weights, or converting after generating, reuse it."""
    if not os.path.isfile(path):
        raise CheckpointError(f"GGUF file {path!r} does not exist")
    return _parsed_gguf(*file_stamp(path))


@functools.lru_cache(maxsize=2)
def _parsed_gguf(path: str, *stamp: int) -> GGUFFile:
    del stamp  # cache key only
    try:
        return parse_gguf(path)
    except (ValueError, IndexError, KeyError, struct.error) as e:
        raise CheckpointError(f"{path}: not a readable GGUF file ({e})") from None
