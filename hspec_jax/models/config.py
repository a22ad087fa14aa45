"""Target-model configuration: one frozen dataclass for the Llama and Qwen2/Qwen3 decoder families.

`TargetConfig` is hashable, so it can be a static argument of `jax.jit`. It is built from a Hugging Face
`config.json` dict with `TargetConfig.from_hf` and written back with `to_hf`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

# Hugging Face `model_type` -> (architecture class name, per-head q/k norm, q/k/v bias, o_proj bias).
# `None` for a bias means "read `attention_bias` from the config".
_FAMILIES = {
    "llama": ("LlamaForCausalLM", False, None, None),
    "qwen3": ("Qwen3ForCausalLM", True, None, None),
    "qwen2": ("Qwen2ForCausalLM", False, True, False),
}
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
# config.json sizes that must be positive integers (the optional ones may be absent or null).
_OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "max_position_embeddings")
_REQUIRED_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def hf_size(hf: dict, key: str, required: bool = True) -> int | None:
    """A size from a `config.json` dict, checked to be a positive integer (None if optional and absent)."""
    value = hf.get(key)
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"config value {key!r} must be a positive integer, got {value!r}")
    return value


def scan_layers_default() -> bool:
    """Scan the decoder layers on TPU, and on CPU where the packed matmul kernel runs; call them one by one
    elsewhere. Measured:
    * CPU with the packed kernel (`hspec_jax.kernels.cpu_matmul`): a scan step hands each linear layer the whole
      stacked kernel and its layer index, and attention reads the stacked cache at the layer index block by block,
      so nothing is copied out of the stacks; a SmolLM2 forward then costs 0.92x (1 token) and 0.98x (8 tokens) the
      per-layer one at 1024 rows of cache and compiles in 0.5-0.7 s instead of 2.7-2.9 s, and whole engines decode
      at 0.99-1.06x (plain) and 1.01-1.03x (k = 7) the per-layer speed (benchmarks/results/scan_layers.md).
    * CPU with XLA's dots (no packed kernel): XLA copies each layer's weights out of the stacked arrays inside the
      scan, a decoding step 1.26-1.31x slower at 128-512 rows of cache (benchmarks/results/scan_layers_by_capacity.md).
    * GPU: a Llama-3.1-8B step 1.61x slower on one H200 (benchmarks/results/scan_layers_h200_llama8b.md), where the
      per-layer program compiles in 3-4 s against 2 s.
    TPU is not measured here: it scans, as MaxText and Levanter do there, compiling one layer instead of L."""
    backend = jax.default_backend()
    if backend == "cpu":
        from hspec_jax.kernels import cpu_matmul

        return cpu_matmul.available()
    return backend == "tpu"


def default_dtype() -> jnp.dtype:
    """fp32 on CPU (XLA's CPU bf16 matmuls are several times slower), bf16 on accelerators."""
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 (`rope_type: llama3`) frequency scaling. Other scaled types are rejected on import."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """Architecture of a decoder-only target LM (Llama-3.x, SmolLM2, Qwen2, Qwen3).

    `dtype` is the compute dtype, `param_dtype` the storage dtype of the weights; both default to
    `default_dtype()` (fp32 on CPU, bf16 on accelerators). Norms, softmax and RoPE run in fp32.

    `scan_layers` chooses how the decoder runs its layers, never what it computes: True runs one traced and
    compiled layer under `jax.lax.scan` over the stacked layer parameters (compile time independent of depth),
    False calls the same layer function once per layer (traced once, compiled inlined), None takes the
    measured default of the backend (`scan_layers_default`).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    layer_types: tuple[str, ...] = ()  # empty: every layer is full attention
    sliding_window: int | None = None
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    dtype: Any = None
    param_dtype: Any = None
    scan_layers: bool | None = None

    def __post_init__(self):
        if self.model_type not in _FAMILIES:
            raise ValueError(f"unknown architecture model_type={self.model_type!r}; supported: {sorted(_FAMILIES)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        for t in self.layer_types:
            if t not in ATTENTION_LAYER_TYPES:
                raise ValueError(f"layer type {t!r} is not supported by the JAX decoder ({ATTENTION_LAYER_TYPES})")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_attention layers need a sliding_window")
        for name in ("dtype", "param_dtype"):
            value = getattr(self, name)
            object.__setattr__(self, name, jnp.dtype(value if value is not None else default_dtype()))

    @property
    def scans_layers(self) -> bool:
        """Whether the decoder runs its layers under `jax.lax.scan` (`scan_layers`, or the backend's default)."""
        return scan_layers_default() if self.scan_layers is None else self.scan_layers

    def layer_window(self, layer: int) -> int | None:
        """Sliding-window length of decoder layer `layer`, or None for full attention."""
        if self.layer_types and self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    def replace(self, **changes) -> TargetConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, hf: dict, **overrides) -> TargetConfig:
        """Build from a Hugging Face `config.json` dict (transformers 4.x or 5.x layout)."""
        model_type = hf.get("model_type")
        if model_type not in _FAMILIES:
            raise ValueError(
                f"unknown architecture model_type={model_type!r} (architectures={hf.get('architectures')}); "
                f"supported: {sorted(_FAMILIES)}"
            )
        for key in _REQUIRED_SIZES + _OPTIONAL_SIZES:
            hf_size(hf, key, required=key in _REQUIRED_SIZES)
        hidden_act = hf.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"hidden_act={hidden_act!r} is not supported (only silu)")
        _, qk_norm, qkv_bias, o_bias = _FAMILIES[model_type]
        attention_bias = bool(hf.get("attention_bias", False))
        num_heads = hf["num_attention_heads"]
        theta, scaling = _rope_from_hf(hf)
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
        layer_types = tuple(hf.get("layer_types") or ())
        if not layer_types and window:
            first = hf.get("max_window_layers", 0)
            layer_types = tuple(
                "sliding_attention" if i >= first else "full_attention" for i in range(hf["num_hidden_layers"])
            )
        if "sliding_attention" in layer_types:
            window = hf.get("sliding_window")
        fields = dict(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qk_norm=qk_norm,
            qkv_bias=attention_bias if qkv_bias is None else qkv_bias,
            o_bias=attention_bias if o_bias is None else o_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            layer_types=layer_types,
            sliding_window=window if "sliding_attention" in layer_types else None,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=hf.get("pad_token_id"),
        )
        fields.update(overrides)
        return cls(**fields)

    def to_hf(self) -> dict:
        """A `config.json` dict that transformers' `AutoConfig` reads back into the same architecture."""
        arch, _, _, _ = _FAMILIES[self.model_type]
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope = {
                "rope_type": "llama3",
                "rope_theta": self.rope_theta,
                **dataclasses.asdict(self.rope_scaling),
            }
        out = {
            "architectures": [arch],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
            "pad_token_id": self.pad_token_id,
            "torch_dtype": str(self.param_dtype),
        }
        if self.model_type != "qwen2":
            out["attention_bias"] = self.qkv_bias
        if self.model_type == "llama":
            out["mlp_bias"] = self.mlp_bias
        if self.layer_types:
            out["layer_types"] = list(self.layer_types)
        if self.sliding_window:
            out.update(sliding_window=self.sliding_window, use_sliding_window=True)
        return out


def _rope_from_hf(hf: dict) -> tuple[float, RopeScaling | None]:
    """(theta, llama3 scaling or None) from `rope_parameters` (transformers 5) or `rope_theta`+`rope_scaling`."""
    params = dict(hf.get("rope_parameters") or {})
    legacy = hf.get("rope_scaling") or {}
    params = {**legacy, **params}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial rotary embeddings are not supported")
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3":
        return theta, RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    raise ValueError(f"rope_type={rope_type!r} is not supported (default, llama3)")
