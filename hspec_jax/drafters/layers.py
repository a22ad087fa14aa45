"""Drafter sub-layers: pre-norm + residual wrappers around attention, Mamba-2 and MLP.

Blocks are laid out `[B, A, T, D]`: B sequences, A blocks per sequence (1 at inference, the sampled
anchors in training), T = block size. Each block is an independent sequence for Mamba; its attention
reads a context KV cache `[B, S, K, H]` shared by the sequence's blocks, masked per block by its anchor.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from hspec_jax.drafters.mamba2 import Mamba2Mixer, MambaConfig
from hspec_jax.kernels.target_kv_attention import target_kv_attention
from hspec_jax.models.config import TargetConfig
from hspec_jax.models.decoder import AttentionProjections
from hspec_jax.models.layers import MLP, RMSNorm


def block_positions(anchors: jax.Array, doc_starts: jax.Array | None, block_size: int) -> jax.Array:
    """anchors, doc_starts (None = 0) `[B, A]` -> RoPE positions `[B, A, T]` of the block slots: slot t sits at
    position anchor - doc_start + t of its document (at inference doc_start = 0 and position = row)."""
    start = anchors if doc_starts is None else anchors - doc_starts
    return start[..., None] + jnp.arange(block_size)


class DraftAttention(AttentionProjections):
    """Target-style attention whose queries are a block and whose context K/V are read, not computed.

    `config` describes the attention geometry (heads, head dim, q/k norms, RoPE): the target's own when
    reading the target's KV cache, so block keys are made exactly like the cached ones.
    """

    window: int | None = None
    causal: bool = True
    window_mode: str = "block"
    impl: str = "auto"

    def __call__(self, x, anchors, doc_starts, context):
        """x `[B, A, T, D]`, anchors and doc_starts (or None) `[B, A]`, context (k, v) each `[B, S, K, H]` or
        None -> `[B, A, T, D]`."""
        b, a, t, d = x.shape
        positions = block_positions(anchors, doc_starts, t).reshape(b * a, t)
        flat = x.reshape(b * a, t, d)
        q, k, v = self.query_key_value(flat, positions)
        unflat = lambda y: y.reshape(b, a, *y.shape[1:])
        k_ctx, v_ctx = context if context is not None else (None, None)
        out = target_kv_attention(
            unflat(q),
            unflat(k),
            unflat(v),
            k_ctx,
            v_ctx,
            anchors,
            doc_starts,
            window=self.window,
            causal=self.causal,
            per_query_window=self.window_mode == "query",
            impl=self.impl,
        )
        return self.output(out.reshape(b * a, t, *out.shape[3:])).reshape(b, a, t, d)


class AttentionSubLayer(nn.Module):
    """h + attn(input_layernorm(h)). No post-attention norm: the MLP is its own sub-layer."""

    attention: TargetConfig
    eps: float
    window: int | None = None
    causal: bool = True
    window_mode: str = "block"
    impl: str = "auto"

    @nn.compact
    def __call__(self, h, anchors, doc_starts, context):
        normed = RMSNorm(self.eps, self.attention.param_dtype, name="input_layernorm")(h)
        attn = DraftAttention(self.attention, self.window, self.causal, self.window_mode, self.impl, name="self_attn")
        return h + attn(normed, anchors, doc_starts, context)


class MambaSubLayer(nn.Module):
    """h + mamba(ssm_norm(h), state0); every block is its own sequence (zero conv history)."""

    hidden_size: int
    config: MambaConfig
    eps: float
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, h, state0):
        """h `[B, A, T, D]`, state0 `[B, A, H, P, N]` or None -> `[B, A, T, D]`."""
        b, a, t, d = h.shape
        normed = RMSNorm(self.eps, self.param_dtype, name="ssm_norm")(h).reshape(b * a, t, d)
        flat_state = None if state0 is None else state0.reshape(b * a, *state0.shape[2:])
        mixer = Mamba2Mixer(d, self.config, self.dtype, self.param_dtype, name="ssm")
        y, _ = mixer(normed, flat_state)
        return h + y.reshape(b, a, t, d)


class MLPSubLayer(nn.Module):
    """h + mlp(mlp_norm(h))."""

    hidden_size: int
    intermediate_size: int
    eps: float
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, h):
        normed = RMSNorm(self.eps, self.param_dtype, name="mlp_norm")(h)
        return h + MLP(self.hidden_size, self.intermediate_size, False, self.dtype, self.param_dtype, name="mlp")(
            normed
        )
