"""The kernel path (flash-decoding), same contract as `reference`.

The T*G queries that share a KV head are one `[R, H]` tile (row r = slot r // G, padded with zero rows to a
legal size). The context is cut into P splits of whole chunks of C rows; one program per (sequence, block,
KV head(s), split) folds its split's visible chunks into an online softmax and writes a partial result
(normalised output and log-sum-exp). Chunks outside the visible range [lo, hi) (from anchors, doc_starts and
the window: `visible_range`) are neither read nor computed. A small `jnp` combine step merges the P partials
with the block's own T keys (`_block_part`); with P = 1 it only adds the block. Both kernel bodies use plain
ref loads and dots and the shared softmax helpers of `common`; each variant's wrapper holds its backend's
block shapes and compiler parameters (`gpu.gpu_context_attention`, `tpu.tpu_context_attention`). Backward:
`custom_vjp` whose backward is the reference's (`jax.vjp` of `reference`), so `jax.grad` works through it.

Not handled here: the kernel is not wrapped in `shard_map`, so under a multi-device mesh XLA has no rule to
partition it (untested: expect gathered inputs or an error); sharded runs should use the reference.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from hspec_jax.kernels.target_kv_attention.gpu import gpu_context_attention, gpu_rows
from hspec_jax.kernels.target_kv_attention.reference import reference, visible_range
from hspec_jax.kernels.target_kv_attention.tpu import tpu_context_attention, tpu_rows
from hspec_jax.models.layers import MASK_VALUE


def _to_query_rows(q, kv_heads: int, rows: int):
    """q `[B, A, T, N, H]` -> `[B, A, K, R, H]`: KV head k's T*G queries, row t*G + g, zero rows up to R."""
    b, a, t, n, h = q.shape
    g = n // kv_heads
    x = q.reshape(b, a, t, kv_heads, g, h).transpose(0, 1, 3, 2, 4, 5).reshape(b, a, kv_heads, t * g, h)
    return jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, rows - t * g), (0, 0)))


def _from_query_rows(x, t: int, n: int):
    """`[B, A, K, R, H]` -> `[B, A, T, N, H]` (drops the padding rows)."""
    b, a, kv_heads, _, h = x.shape
    g = n // kv_heads
    return x[:, :, :, : t * g].reshape(b, a, kv_heads, t, g, h).transpose(0, 1, 3, 2, 4, 5).reshape(b, a, t, n, h)


def _block_part(q_rows, k_blk, v_blk, group: int, causal: bool):
    """The block's own keys: q_rows `[B, A, K, R, H]`, k_blk, v_blk `[B, A, T, K, H]` -> (output `[B, A, K, R, H]`
    fp32 normalised, log-sum-exp `[B, A, K, R]`). Every row sees at least its own slot, so both are finite."""
    r, h = q_rows.shape[-2:]
    t = k_blk.shape[2]
    s = jnp.einsum("bakrh,batkh->bakrt", q_rows, k_blk, preferred_element_type=jnp.float32) * h**-0.5
    if causal:
        s = jnp.where(jnp.arange(t)[None, :] <= jnp.arange(r)[:, None] // group, s, MASK_VALUE)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.exp(s - lse[..., None]).astype(v_blk.dtype)
    return jnp.einsum("bakrt,batkh->bakrh", p, v_blk, preferred_element_type=jnp.float32), lse


def _window_edge_part(q_rows, k_ctx, v_ctx, anchors, doc_starts, window: int, t: int, group: int):
    """The per-query window's edge: the T-1 context rows a - W + 1 + u (u < T - 1) that only slots t <= u see.
    q_rows `[B, A, K, R, H]`; k_ctx, v_ctx `[B, S, K, H]`; anchors, doc_starts `[B, A]` -> (output `[B, A, K, R, H]`
    fp32, log-sum-exp `[B, A, K, R]`); a query row seeing none of them gets a log-sum-exp near MASK_VALUE."""
    r, h = q_rows.shape[-2:]
    u = jnp.arange(t - 1)
    rows = anchors[..., None] - window + 1 + u  # [B, A, T-1]
    valid = (rows >= jnp.maximum(doc_starts, 0)[..., None]) & (rows < anchors[..., None])
    batch = jnp.arange(k_ctx.shape[0])[:, None, None]
    safe = jnp.clip(rows, 0, k_ctx.shape[1] - 1)
    k_edge, v_edge = k_ctx[batch, safe], v_ctx[batch, safe]  # [B, A, T-1, K, H]
    s = jnp.einsum("bakrh,baukh->bakru", q_rows, k_edge, preferred_element_type=jnp.float32) * h**-0.5
    seen = valid[:, :, None, None, :] & (u[None, :] >= jnp.arange(r)[:, None] // group)
    s = jnp.where(seen, s, MASK_VALUE)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.exp(s - lse[..., None]).astype(v_edge.dtype)
    return jnp.einsum("bakru,baukh->bakrh", p, v_edge, preferred_element_type=jnp.float32), lse


def _combine(outs, lses):
    """Merge normalised partial results: outs `[B, A, P, K, R, H]`, lses `[B, A, P, K, R]` -> `[B, A, K, R, H]`."""
    w = jnp.exp(lses - lses.max(axis=2, keepdims=True))
    return (w[..., None] * outs).sum(axis=2) / w.sum(axis=2)[..., None]


@dataclasses.dataclass(frozen=True)
class KernelSettings:
    """Static settings of the kernel path. variant: "gpu" | "tpu"; interpret: run on CPU (the variant's
    interpret mode); chunk, splits: None = the variant's defaults (tests set them small)."""

    variant: str = "gpu"
    interpret: bool = False
    chunk: int | None = None
    splits: int | None = None


def _kernel_forward(
    q, k_blk, v_blk, k_ctx, v_ctx, anchors, doc_starts, *, window, causal, per_query_window, settings: KernelSettings
):
    """The kernel path's forward (shapes as `reference`): block part in jnp, context partials from the kernel
    variant, merged by `_combine`. A per-query window W is the kernel over the rows every slot sees (rows
    >= a - (W - T), a block-anchored window of W - T) plus `_window_edge_part` for the T - 1 rows below them."""
    t, n = q.shape[2:4]
    kv_heads = k_blk.shape[3]
    g = n // kv_heads
    rows = gpu_rows(t, g) if settings.variant == "gpu" else tpu_rows(t, g, q.dtype)
    q_rows = _to_query_rows(q, kv_heads, rows)
    out, lse = _block_part(q_rows, k_blk, v_blk, g, causal)
    if k_ctx is not None:
        per_query = per_query_window and window is not None
        lo, hi = visible_range(anchors, k_ctx.shape[1], window - t if per_query else window, doc_starts)
        if per_query and t > 1:
            edge_out, edge_lse = _window_edge_part(q_rows, k_ctx, v_ctx, anchors, doc_starts, window, t, g)
            parts = (jnp.stack([out, edge_out], axis=2), jnp.stack([lse, edge_lse], axis=2))
            out, lse = _combine(*parts), jnp.logaddexp(lse, edge_lse)
        attend = gpu_context_attention if settings.variant == "gpu" else tpu_context_attention
        outs, lses = attend(
            q_rows, k_ctx, v_ctx, lo, hi, chunk=settings.chunk, splits=settings.splits, interpret=settings.interpret
        )
        out = _combine(
            jnp.concatenate([outs, out[:, :, None]], axis=2), jnp.concatenate([lses[..., 0], lse[:, :, None]], axis=2)
        )
    return _from_query_rows(out, t, n).astype(q.dtype)


def pallas_attention(
    q,
    k_blk,
    v_blk,
    k_ctx,
    v_ctx,
    anchors,
    doc_starts=None,
    *,
    window=None,
    causal=True,
    per_query_window=False,
    settings=KernelSettings(),
):
    """The kernel path, same contract as `reference`; differentiable (the backward is the reference's)."""
    if doc_starts is None:
        doc_starts = jnp.zeros_like(anchors)
    static = dict(window=window, causal=causal, per_query_window=per_query_window)

    @jax.custom_vjp
    def attend(q, k_blk, v_blk, k_ctx, v_ctx, anchors, doc_starts):
        return _kernel_forward(q, k_blk, v_blk, k_ctx, v_ctx, anchors, doc_starts, settings=settings, **static)

    def forward(*args):
        return attend(*args), args

    def backward(args, grad):
        *inputs, anchors, doc_starts = args
        _, vjp = jax.vjp(lambda *x: reference(*x, anchors, doc_starts, **static), *inputs)
        return (*vjp(grad), None, None)

    attend.defvjp(forward, backward)
    return attend(q, k_blk, v_blk, k_ctx, v_ctx, anchors, doc_starts)
