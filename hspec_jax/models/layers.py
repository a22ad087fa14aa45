"""Building blocks shared by the target decoder and the drafters: RMSNorm, SwiGLU MLP, masked GQA attention.

Axis letters: B batch, T query tokens, S key positions, N query heads, K KV heads, G = N/K heads per
group, H head dim, D model dim, F MLP width.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from hspec_jax.kernels import cpu_matmul

# Large finite negative number for masked scores: a fully masked row gives a uniform (finite) softmax
# instead of NaN, and its output is never used.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
INIT_STD = 0.02


def dense(features: int, name: str | None = None, *, bias: bool = False, dtype: Any, param_dtype: Any) -> Linear:
    """A linear layer with kernel `[in, out]`, HF-style N(0, 0.02) init and zero bias (name: None in setup)."""
    return Linear(features, bias, dtype, param_dtype, name=name)


class Linear(nn.Module):
    """`x @ kernel + bias`, kernel `[in, out]` (flax's `nn.Dense` layout and numbers). Where `for_backend` packed
    the kernel (`packed_kernel [out / 16, in, 16]`, or a scanned decoder step's `cpu_matmul.StackedLayer` of the
    stacked kernels, see `hspec_jax.kernels.cpu_matmul`), the product runs on the packed CPU kernel instead."""

    features: int
    use_bias: bool = False
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.columns(x, 0)

    @nn.compact
    def columns(self, x: jax.Array, start: int) -> jax.Array:
        """Output columns `start ..` only: `[..., in] -> [..., out - start]` (the k/v part of a fused q/k/v)."""
        if self.has_variable("params", "packed_kernel"):
            packed = self.get_variable("params", "packed_kernel")
            if start % cpu_matmul.COLUMNS == 0:
                y = cpu_matmul.packed_matmul(x, packed, first_block=start // cpu_matmul.COLUMNS)
            else:
                y = cpu_matmul.packed_matmul(x, packed)[..., start:]
            y = y.astype(self.dtype)
        else:
            kernel = self.param(
                "kernel", nn.initializers.normal(INIT_STD), (x.shape[-1], self.features), self.param_dtype
            )
            x, kernel = x.astype(self.dtype), kernel[:, start:].astype(self.dtype)
            y = jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))
        if self.use_bias:
            bias = self.param("bias", nn.initializers.zeros, (self.features,), self.param_dtype)
            y = y + bias[start:].astype(self.dtype)
        return y


class RMSNorm(nn.Module):
    """`x / rms(x) * scale`, statistics in fp32, result cast back to x.dtype (as HF Llama/Qwen3)."""

    eps: float = 1e-6
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        return rms_norm(x, scale, self.eps)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMS-normalise the last axis of `x [..., D]` in fp32 and multiply by `scale [D]`."""
    xf = x.astype(jnp.float32)
    normed = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    return scale.astype(x.dtype) * normed


class MLP(nn.Module):
    """SwiGLU: `down(silu(gate(x)) * up(x))`, `[..., D] -> [..., D]` through width F."""

    hidden_size: int
    intermediate_size: int
    bias: bool = False
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = dict(bias=self.bias, dtype=self.dtype, param_dtype=self.param_dtype)
        if self.has_variable("params", "gate_up_proj"):  # params from `fuse_projections`: one matmul
            gate, up = jnp.split(dense(2 * self.intermediate_size, "gate_up_proj", **kw)(x), 2, axis=-1)
        else:
            gate = dense(self.intermediate_size, "gate_proj", **kw)(x)
            up = dense(self.intermediate_size, "up_proj", **kw)(x)
        return dense(self.hidden_size, "down_proj", **kw)(nn.silu(gate) * up)


# Projections that read the same input, and the one projection `fuse_projections` makes of each group.
FUSED_PROJECTIONS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def fuse_projections(params: dict) -> dict:
    """The same model with fewer, wider matmuls: in every module of a params tree (target or drafter), q/k/v
    become one `qkv_proj` and an MLP's gate/up one `gate_up_proj`, kernels `[D, F_i]` (and biases) concatenated
    on the output axis. Attention and MLP modules detect the fused names and split the output, so the result is
    the unfused one (same products, one dot). On CPU, one dot over the concatenated weights is cheaper than
    several (benchmarks/results/spec_overhead_cpu.md); the engines fuse single-device CPU and GPU params
    (`for_backend`).
    New arrays: the input tree is left as it is; a tree fused already comes back with the same arrays (callers
    that compile many programs fuse once and share one copy of the weights)."""
    out = {}
    for name, value in params.items():
        out[name] = fuse_projections(value) if isinstance(value, dict) else value
    for fused, parts in FUSED_PROJECTIONS.items():
        if all(part in out for part in parts):
            out[fused] = {key: jnp.concatenate([out[part][key] for part in parts], axis=-1) for key in out[parts[0]]}
            for part in parts:
                del out[part]
    return out


# Modules whose params hold a 2-D "kernel" that is not a linear layer's (`DepthwiseConv`: a `[width, C]` filter).
NOT_LINEAR = frozenset({"conv1d"})


def pack_linear_layers(params: dict) -> dict:
    """The same model with every fp32 linear layer's kernel packed for the CPU kernel (`hspec_jax.kernels.cpu_matmul`):
    `{"kernel" [K, N]}` becomes `{"packed_kernel" [N / 16, K, 16]}` where N is a multiple of 16 (stacked layers'
    `[L, K, N]`: `[L, N / 16, K, 16]`), and the output
    projection gets a packed copy, `packed_lm_head` (a top-level `lm_head [V, D]` is replaced by it; a tied
    embedding stays for the token lookup, so a tied model holds its table twice). New arrays; the input tree is
    left as it is."""
    return _pack(params, top=True)


def _pack(tree, top: bool = False):
    if isinstance(tree, tuple):
        return tuple(_pack(value) for value in tree)
    if not isinstance(tree, dict):
        return tree
    out = {name: value if name in NOT_LINEAR else _pack(value) for name, value in tree.items()}
    kernel = out.get("kernel")
    if kernel is not None and set(out) <= {"kernel", "bias"} and cpu_matmul.packable(kernel):
        out["packed_kernel"] = cpu_matmul.pack(out.pop("kernel"))
    if top and "packed_lm_head" not in out:
        head = out["lm_head"] if "lm_head" in out else out.get("embed_tokens", {}).get("embedding")
        if head is not None and cpu_matmul.packable(head.T):
            out.pop("lm_head", None)
            out["packed_lm_head"] = cpu_matmul.pack_rows(head)
    return out


def for_backend(params: dict, pack: bool | None = None, scan: bool | None = None) -> dict:
    """Params as the engines run them on a single device of the current backend: on CPU and GPU fused projections
    (`fuse_projections`) and, where the decoder does not scan (`scan`, None = `scan_layers_default`: GPU, or a CPU
    without the packed kernel), the stacked layers split into one tree per layer (`unstack_layers`: a per-layer
    program on slices of the stack compiles 9x longer on GPU, 33 s for Llama-3.1-8B on an H200, and reads copies of
    the packed weights on CPU, 3-5x slower: benchmarks/results/scan_layers*.md); unchanged on TPU (and sharded runs
    keep the checkpoint's layout). On CPU, where the packed matmul kernel runs (`pack`: None =
    `cpu_matmul.available()`), the linear layers packed for it (`pack_linear_layers`, stacked layers per layer): a
    forward over 8 tokens then costs about 1.3-1.6x one over a single token, not 1.7-2.4x
    (benchmarks/results/packed_matmul.md).
    Idempotent: a placed tree comes back with the same arrays."""
    if jax.default_backend() not in ("cpu", "gpu"):
        return params
    from hspec_jax.models.config import scan_layers_default
    from hspec_jax.models.decoder import stacked_layers, unstack_layers

    params = fuse_projections(params)
    layers = params.get("layers")
    if scan is None:
        scan = scan_layers_default()
    if layers is not None and stacked_layers(layers) and not scan:
        params = {**params, "layers": unstack_layers(layers, len(jax.tree.leaves(layers)[0]))}
    if pack is None:
        pack = jax.default_backend() == "cpu" and cpu_matmul.available()
    return pack_linear_layers(params) if pack else params


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Masked grouped-query attention, softmax in fp32: the readable reference that `blocked_attention` (what the
    decoder runs) is tested against.

    q `[B, T, N, H]`; k, v `[B, S, K, H]` with N a multiple of K (query head n uses KV head n // G);
    mask `[B, T, S]` bool (True = may attend). Returns `[B, T, N, H]` in q.dtype.
    """
    b, t, n, h = q.shape
    kv_heads = k.shape[2]
    qg = q.reshape(b, t, kv_heads, n // kv_heads, h)
    scores = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32) * (h**-0.5)
    scores = jnp.where(mask[:, None, None], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bskh->btkgh", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, n, h).astype(q.dtype)


def causal_mask(
    rows: jax.Array, num_keys: int, window: int | None = None, doc_starts: jax.Array | None = None
) -> jax.Array:
    """The mask of `dot_product_attention` for a causal layer, `[B, T, S]`: key row j is visible to the query in
    cache row `rows[b, t]` iff j <= row (and row - j < window, and j >= `doc_starts[b, t]`, the first row of the
    query's document when documents are packed in a row)."""
    keys = jnp.arange(num_keys)[None, None, :]
    row = rows[:, :, None]
    mask = keys <= row
    if window is not None:
        mask &= keys > row - window
    if doc_starts is not None:
        mask &= keys >= doc_starts[:, :, None]
    return mask
