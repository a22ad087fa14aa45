"""The definition of target-KV block attention (contract in the package docstring): the visibility masks and a
masked dense `jnp` attention. The training path and the CPU path; the kernels are tested against it."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hspec_jax.models.layers import MASK_VALUE


def visible_range(anchors: jax.Array, num_rows: int, window: int | None, doc_starts: jax.Array | None = None):
    """anchors, doc_starts (None = 0) `[B, A]` -> (lo, hi) `[B, A]` int32: context rows lo <= j < hi are visible."""
    anchors = anchors.astype(jnp.int32)
    lo = jnp.zeros_like(anchors) if doc_starts is None else doc_starts.astype(jnp.int32)
    if window is not None:
        lo = jnp.maximum(lo, anchors - window)
    return jnp.clip(lo, 0, num_rows), jnp.clip(anchors, 0, num_rows)


def context_mask(anchors: jax.Array, num_rows: int, window: int | None, doc_starts: jax.Array | None = None):
    """`[B, A, S]`: context row j is visible to the block anchored at a iff doc_start <= j < a (and j >= a - window)."""
    lo, hi = visible_range(anchors, num_rows, window, doc_starts)
    rows = jnp.arange(num_rows)
    return (rows >= lo[..., None]) & (rows < hi[..., None])


def query_context_mask(anchors, num_rows: int, window: int, block_size: int, doc_starts=None):
    """`[B, A, T, S]`, the per-query window: row j is visible to slot t iff doc_start <= j < a and
    j >= a + t - window + 1 (the query at position a + t sees the `window` positions ending at itself)."""
    base = context_mask(anchors, num_rows, None, doc_starts)[:, :, None, :]
    first = anchors[..., None] + jnp.arange(block_size) - window + 1  # [B, A, T]
    return base & (jnp.arange(num_rows) >= first[..., None])


def reference(
    q,
    k_blk,
    v_blk,
    k_ctx,
    v_ctx,
    anchors,
    doc_starts=None,
    *,
    window: int | None = None,
    causal: bool = True,
    per_query_window: bool = False,
):
    """Masked dense attention. q `[B, A, T, N, H]`; k_blk, v_blk `[B, A, T, K, H]`; k_ctx, v_ctx `[B, S, K, H]`
    or None (no context); anchors, doc_starts (None = 0) `[B, A]` int -> `[B, A, T, N, H]` in q.dtype."""
    b, a, t, n, h = q.shape
    kv_heads = k_blk.shape[3]
    qg = q.reshape(b, a, t, kv_heads, n // kv_heads, h)
    scale = h**-0.5
    blk = jnp.einsum("batkgh,baukh->bakgtu", qg, k_blk, preferred_element_type=jnp.float32) * scale
    if causal:
        blk = jnp.where(jnp.tril(jnp.ones((t, t), bool)), blk, MASK_VALUE)
    if k_ctx is None:
        probs = jax.nn.softmax(blk, axis=-1)
        out = jnp.einsum("bakgtu,baukh->batkgh", probs.astype(v_blk.dtype), v_blk, preferred_element_type=jnp.float32)
        return out.reshape(b, a, t, n, h).astype(q.dtype)
    ctx = jnp.einsum("batkgh,bskh->bakgts", qg, k_ctx, preferred_element_type=jnp.float32) * scale
    if per_query_window and window is not None:
        visible = query_context_mask(anchors, k_ctx.shape[1], window, t, doc_starts)[:, :, None, None]
    else:
        visible = context_mask(anchors, k_ctx.shape[1], window, doc_starts)[:, :, None, None, None, :]
    ctx = jnp.where(visible, ctx, MASK_VALUE)
    probs = jax.nn.softmax(jnp.concatenate([ctx, blk], axis=-1), axis=-1)
    p_ctx, p_blk = probs[..., : k_ctx.shape[1]], probs[..., k_ctx.shape[1] :]
    out = jnp.einsum("bakgts,bskh->batkgh", p_ctx.astype(v_ctx.dtype), v_ctx, preferred_element_type=jnp.float32)
    out += jnp.einsum("bakgtu,baukh->batkgh", p_blk.astype(v_blk.dtype), v_blk, preferred_element_type=jnp.float32)
    return out.reshape(b, a, t, n, h).astype(q.dtype)
