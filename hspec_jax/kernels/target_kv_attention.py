"""Block attention over a context KV cache read in place: the drafters' attention, as tiled Pallas kernels
(a GPU and a TPU variant) beside a readable `jnp` reference, behind one entry point.

A drafter block of T tokens (anchor + masks) sits at positions a .. a+T-1, where a (the "anchor" position)
is also the number of context rows before it. Its queries attend to

  (a) context keys/values `[B, S, K, H]` (the target's own post-RoPE KV cache for H-Spec, read in place;
      the drafter's injected cache for DFlash): row j is visible iff doc_start <= j < a and, with a sliding
      window W, j >= a - W (the window is anchored at the block, so every slot sees the same context rows);
      with `per_query_window` the window is each query's own, as vLLM serves it: slot t sees j >= a + t - W + 1.
      `doc_starts [B, A]` is the first row of the anchor's document: 0 at inference; in training, where
      documents are packed into one row, it keeps a block from seeing an earlier document; and
  (b) the block's own keys/values `[.., T, K, H]`: causal (slot u visible to slot t iff u <= t) or, for
      DFlash, bidirectional.

Axis letters: B batch, A blocks per sequence, T block length, S context rows, N query heads, K KV heads,
G = N / K, H head dim, R query rows of one KV head (the T*G queries, padded), C context rows per chunk,
P context splits. Query head n reads KV head n // G. Softmax statistics are fp32.

How the kernels work (flash-decoding): the T*G queries that share a KV head are one `[R, H]` tile (row
r = slot r // G, padded with zero rows to a legal size). The context is cut into P splits of whole chunks
of C rows; one program per (sequence, block, KV head(s), split) folds its split's visible chunks into an
online softmax and writes a partial result (normalised output and log-sum-exp). Chunks outside the
visible range [lo, hi) (from anchors, doc_starts and the window: `visible_range`) are neither read nor
computed. A small `jnp` combine step merges the P partials with the block's own T keys (`_block_part`);
with P = 1 it only adds the block. Both kernel bodies use plain ref loads and dots, shared helpers for the
softmax (`_online_update`, `_finish`); each variant's wrapper holds its backend's block shapes and compiler
parameters (see `gpu_context_attention`, `tpu_context_attention`). Backward: `custom_vjp` whose backward is
the reference's (`jax.vjp` of `reference`), so `jax.grad` works through the kernel path.

Not handled here: the kernel is not wrapped in `shard_map`, so under a multi-device mesh XLA has no rule to
partition it (untested: expect gathered inputs or an error); sharded runs should use the reference.

Which path runs where (`impl`):
* `"reference"`: masked dense `jnp` attention; the training path and the CPU path.
* `"pallas"`: the kernel variant of the current platform (TPU -> TPU variant, GPU -> GPU variant; on CPU
  the GPU variant in interpret mode). `"pallas_gpu"` / `"pallas_tpu"` name a variant; on CPU each runs in
  its interpret mode (the TPU one through `pltpu.InterpretParams`), which is how the tests check both.
* `"auto"`: the kernel only on a platform in `VERIFIED_PLATFORMS` (where `benchmarks/device_check.py`
  has compiled it and matched the reference), else the reference; the choice is logged once.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from hspec_jax.models.layers import MASK_VALUE

IMPLS = ("auto", "reference", "pallas", "pallas_gpu", "pallas_tpu")
# Platforms (`jax.default_backend()`) on which the kernel has compiled and matched the reference in
# `benchmarks/device_check.py`. None yet: no GPU/TPU run has been made (README, Status).
VERIFIED_PLATFORMS: set[str] = set()
GPU_PROGRAMS = 256  # splits are added until a GPU launch has about this many programs (2 per H100/H200 SM)
TPU_PROGRAMS = 2  # a TPU runs the grid in order; 2 parallel programs keep both megacore TensorCores busy
TPU_CHUNK = 512  # context rows per TPU grid step (one K and one V tile of [C, heads * H] in VMEM)
LANES = 128  # TPU lane width: per-row softmax statistics are stored lane-replicated, [R, 128]

logger = logging.getLogger(__name__)
_logged_choices: set[tuple[str, str]] = set()


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


# ---------------------------------------------------------------- shared by both kernel variants


def _precision(dtype):
    """fp32 inputs get full-precision dots (no TF32 on GPU, multi-pass on TPU); bf16 the native ones."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def _scores(q, k, scale):
    """q `[R, H]`, k `[C, H]` -> `[R, C]` fp32 scaled scores (q k^T, no transpose materialised)."""
    dims = (((1,), (1,)), ((), ()))
    s = jax.lax.dot_general(q, k, dims, precision=_precision(q.dtype), preferred_element_type=jnp.float32)
    return s * scale


def _online_update(m, denom, acc, scores, visible, values):
    """Fold one chunk into the running softmax: m, denom `[R, 1]`, acc `[R, H]` (fp32); scores `[R, C]` fp32;
    visible `[1, C]` bool; values `[C, H]` (zero on invisible rows). Invisible scores never count."""
    m_new = jnp.maximum(m, jnp.where(visible, scores, MASK_VALUE).max(axis=-1, keepdims=True))
    p = jnp.where(visible, jnp.exp(scores - m_new), 0.0)
    alpha = jnp.exp(m - m_new)
    pv = jax.lax.dot_general(
        p.astype(values.dtype),
        values,
        (((1,), (0,)), ((), ())),
        precision=_precision(values.dtype),
        preferred_element_type=jnp.float32,
    )
    return m_new, alpha * denom + p.sum(axis=-1, keepdims=True), alpha * acc + pv


def _finish(m, denom, acc):
    """Running statistics -> (normalised output `[R, H]`, log-sum-exp `[R, 1]`); an empty split (no visible
    row, denom 0) gives output 0 and log-sum-exp MASK_VALUE, so it weighs nothing in the combine step."""
    empty = denom == 0.0
    safe = jnp.where(empty, 1.0, denom)
    return jnp.where(empty, 0.0, acc / safe), jnp.where(empty, MASK_VALUE, m + jnp.log(safe))


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


def _num_splits(num_chunks: int, programs: int, target: int) -> int:
    """Splits of the context so that `programs * splits` reaches `target` (at most one per chunk)."""
    return max(1, min(num_chunks, -(-target // programs)))


# ---------------------------------------------------------------- GPU variant (Pallas Triton)


def gpu_rows(t: int, group: int) -> int:
    """Query rows of the GPU tile: T*G rounded up to a power of two, at least 16 (Triton dots need >= 16)."""
    return max(16, 1 << (t * group - 1).bit_length())


def gpu_chunk(rows: int) -> int:
    """Context rows per GPU loop step: a power of two in [16, 128], smaller for tall query tiles so the
    `[R, C]` fp32 score tile stays at most 4096 elements (registers)."""
    return max(16, min(128, 4096 // rows))


def _gpu_kernel(lo_ref, hi_ref, q_ref, kc_ref, vc_ref, o_ref, lse_ref, *, chunk: int, split_rows: int, scale: float):
    """One (sequence, block, KV head, split): q `[R, H]`, the head's whole context K/V `[S, H]` (read chunk by
    chunk, only this split's visible rows) -> o `[R, H]` fp32, lse `[R, 1]`."""
    num_rows = kc_ref.shape[0]
    split_start = pl.program_id(3) * split_rows
    lo = lo_ref[...]
    hi = jnp.minimum(hi_ref[...], split_start + split_rows)  # a chunk's own first row bounds it below (`low`)
    q = q_ref[...]
    r, h = q.shape

    def step(c, carry):
        # Chunk c covers rows [first, first + C); a chunk past S - C is read from S - C instead (every load stays
        # inside the cache) and its rows before `first`, already folded in, are masked.
        first = split_start + c * chunk
        start = jnp.minimum(first, num_rows - chunk)
        rows = start + jax.lax.broadcasted_iota(jnp.int32, (chunk, 1), 0)
        cols = start + jax.lax.broadcasted_iota(jnp.int32, (1, chunk), 1)
        low = jnp.maximum(lo, first)
        v = jnp.where((rows >= low) & (rows < hi), vc_ref[pl.ds(start, chunk), :], 0)
        visible = (cols >= low) & (cols < hi)
        return _online_update(*carry, _scores(q, kc_ref[pl.ds(start, chunk), :], scale), visible, v)

    begin = jnp.maximum(lo - split_start, 0) // chunk
    end = jnp.where(hi > lo, (hi - split_start + chunk - 1) // chunk, begin)
    init = (
        jnp.full((r, 1), MASK_VALUE, jnp.float32),
        jnp.zeros((r, 1), jnp.float32),
        jnp.zeros((r, h), jnp.float32),
    )
    o, lse = _finish(*jax.lax.fori_loop(begin, end, step, init))
    o_ref[...] = o
    lse_ref[...] = lse


def gpu_context_attention(q_rows, k_ctx, v_ctx, lo, hi, *, chunk: int | None = None, splits=None, interpret=False):
    """GPU variant of the context part. q_rows `[B, A, K, R, H]`; k_ctx, v_ctx `[B, S, K, H]` (read in place, no
    copy or transpose); lo, hi `[B, A]` -> partials (o `[B, A, P, K, R, H]` fp32, lse `[B, A, P, K, R, 1]`).

    Block-shape rules (Triton): every tile a kernel touches has power-of-two dims and every dot is at least
    16 x 16 x 16, so R = `gpu_rows` (T*G padded, >= 16), C = `gpu_chunk(R)` (power of two, 16..128, at most S)
    and H must be a power of two >= 16 (64 and 128 for every target here). Each program gets its KV head's
    `[S, H]` context as a block (a strided view: Triton loads only the `[C, H]` tiles it indexes); S needs no
    rounding (a chunk past S - C is read overlapping its predecessor and masked), only a cache shorter than 16
    rows is zero-padded (a copy of at most 15 rows). The body uses plain ref loads, no Triton-only primitive;
    the backend is chosen by `compiler_params` alone. Grid (B, A, K, P): split p covers rows
    [p * split_rows, (p + 1) * split_rows), P from `_num_splits` so a launch has about `GPU_PROGRAMS` programs.
    """
    b, a, kv_heads, r, h = q_rows.shape
    if h < 16 or h & (h - 1) or r < 16 or r & (r - 1):
        raise ValueError(f"GPU attention kernel needs power-of-two head dim and query rows >= 16, got H={h}, R={r}")
    if k_ctx.shape[1] < 16:
        pad = ((0, 0), (0, 16 - k_ctx.shape[1]), (0, 0), (0, 0))
        k_ctx, v_ctx = jnp.pad(k_ctx, pad), jnp.pad(v_ctx, pad)
    s = k_ctx.shape[1]
    chunk = min(chunk or gpu_chunk(r), 1 << (s.bit_length() - 1))
    num_chunks = -(-s // chunk)
    splits = splits or _num_splits(num_chunks, b * a * kv_heads, GPU_PROGRAMS)
    per_split = -(-num_chunks // splits)
    splits = -(-num_chunks // per_split)
    kernel = functools.partial(_gpu_kernel, chunk=chunk, split_rows=per_split * chunk, scale=h**-0.5)
    scalar = pl.BlockSpec((None, None), lambda i, j, k, p: (i, j))
    ctx = pl.BlockSpec((None, s, None, h), lambda i, j, k, p: (i, 0, k, 0))
    return pl.pallas_call(
        kernel,
        grid=(b, a, kv_heads, splits),
        in_specs=[scalar, scalar, pl.BlockSpec((None, None, None, r, h), lambda i, j, k, p: (i, j, k, 0, 0)), ctx, ctx],
        out_specs=[
            pl.BlockSpec((None, None, None, None, r, h), lambda i, j, k, p: (i, j, p, k, 0, 0)),
            pl.BlockSpec((None, None, None, None, r, 1), lambda i, j, k, p: (i, j, p, k, 0, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, a, splits, kv_heads, r, h), jnp.float32),
            jax.ShapeDtypeStruct((b, a, splits, kv_heads, r, 1), jnp.float32),
        ],
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="target_kv_attention_gpu",
    )(lo, hi, q_rows, k_ctx, v_ctx)


# ---------------------------------------------------------------- TPU variant (Pallas Mosaic TPU)


def tpu_rows(t: int, group: int, dtype) -> int:
    """Query rows per KV head of the TPU tile: T*G rounded up to whole sublane tiles (8 rows fp32, 16 bf16)."""
    sublanes = 8 * max(1, 4 // jnp.dtype(dtype).itemsize)
    return -(-t * group // sublanes) * sublanes


def tpu_heads_per_block(kv_heads: int, head_dim: int) -> int:
    """KV heads per context tile: the fewest whose lanes (heads * H) are a multiple of 128, else all K."""
    return next((d for d in range(1, kv_heads + 1) if kv_heads % d == 0 and d * head_dim % LANES == 0), kv_heads)


def _block_diagonal(q_rows, heads: int):
    """`[B, A, K, R, H]` -> `[B, A, K/hb, hb*R, hb*H]`: head j's rows carry its queries in lanes j*H.. and zeros
    elsewhere, so one dot with a context tile `[C, hb*H]` gives every head's scores against its own keys."""
    b, a, kv_heads, r, h = q_rows.shape
    x = q_rows.reshape(b, a, kv_heads // heads, heads, r, 1, h) * jnp.eye(heads, dtype=q_rows.dtype)[:, None, :, None]
    return x.reshape(b, a, kv_heads // heads, heads * r, heads * h)


def _diagonal_blocks(x, heads: int):
    """`[B, A, P, K/hb, hb*R, hb*H]` -> `[B, A, P, K, R, H]`: each head's rows against its own lanes."""
    b, a, p, groups, rows, lanes = x.shape
    x = x.reshape(b, a, p, groups, heads, rows // heads, heads, lanes // heads)
    return jnp.einsum("bapgjrjh->bapgjrh", x).reshape(b, a, p, groups * heads, rows // heads, lanes // heads)


def _tpu_kernel(
    lo_ref,
    hi_ref,
    q_ref,
    kc_ref,
    vc_ref,
    o_ref,
    lse_ref,
    m_ref,
    denom_ref,
    acc_ref,
    *,
    chunk: int,
    per_split: int,
    num_blocks: int,
    scale: float,
):
    """One grid step (sequence, block, head group, split, chunk): block-diagonal q `[hb*R, hb*H]`, context K/V
    tiles `[C, hb*H]`; the running statistics live in VMEM scratch across the split's chunks (last grid axis)."""
    i = pl.program_id(0) * num_blocks + pl.program_id(1)
    lo, hi = lo_ref[i], hi_ref[i]
    c = pl.program_id(4)
    start = (pl.program_id(3) * per_split + c) * chunk

    @pl.when(c == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
        denom_ref[...] = jnp.zeros(denom_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when((start < hi) & (start + chunk > lo))
    def _step():
        rows = start + jax.lax.broadcasted_iota(jnp.int32, (chunk, 1), 0)
        cols = start + jax.lax.broadcasted_iota(jnp.int32, (1, chunk), 1)
        v = jnp.where((rows >= lo) & (rows < hi), vc_ref[...], 0)  # a last partial tile holds garbage past S
        scores = _scores(q_ref[...], kc_ref[...], scale)
        m, denom, acc = _online_update(
            m_ref[:, :1], denom_ref[:, :1], acc_ref[...], scores, (cols >= lo) & (cols < hi), v
        )
        m_ref[...] = jnp.broadcast_to(m, m_ref.shape)
        denom_ref[...] = jnp.broadcast_to(denom, denom_ref.shape)
        acc_ref[...] = acc

    @pl.when(c == per_split - 1)
    def _write():
        o, lse = _finish(m_ref[:, :1], denom_ref[:, :1], acc_ref[...])
        o_ref[...] = o
        lse_ref[...] = jnp.broadcast_to(lse, lse_ref.shape)


def tpu_context_attention(q_rows, k_ctx, v_ctx, lo, hi, *, chunk: int | None = None, splits=None, interpret=False):
    """TPU variant of the context part, same contract as `gpu_context_attention`.

    Block-shape rules (Mosaic: the last two dims of every block divisible by (8, 128) or equal to the array's):
    the cache is viewed as `[B, S, K*H]` (a free reshape, no copy) and tiled `[C, hb*H]`, with hb =
    `tpu_heads_per_block` (hb*H a multiple of 128, else all K heads: 1 for H = 128, 3 for SmolLM2's 3 x 64);
    C = `TPU_CHUNK` (a multiple of 16) or S when S is smaller; a last partial tile is masked. The hb heads'
    queries form one block-diagonal tile `[hb*R, hb*H]` (R = `tpu_rows`, whole sublane tiles), so the kernel
    does two plain 2-D dots per step and never slices lanes; its output's diagonal blocks are the result.
    Softmax statistics are lane-replicated `[hb*R, 128]`. The visible ranges (lo, hi) are scalar-prefetched
    into SMEM; the context tiles' index map clamps to the visible chunks, so chunks outside [lo, hi) are never
    copied from HBM (the pipeline skips a copy whose block index repeats). Grid (B, A, K/hb, P, chunks per
    split), the last axis sequential ("arbitrary"), the others parallel.
    """
    b, a, kv_heads, r, h = q_rows.shape
    s = k_ctx.shape[1]
    heads = tpu_heads_per_block(kv_heads, h)
    chunk = chunk or min(TPU_CHUNK, s)
    num_chunks = -(-s // chunk)
    splits = splits or _num_splits(num_chunks, b * a * (kv_heads // heads), TPU_PROGRAMS)
    per_split = -(-num_chunks // splits)
    splits = -(-num_chunks // per_split)

    def ctx_index(i, j, k, p, c, lo_ref, hi_ref):
        n = i * a + j
        first = jnp.minimum(lo_ref[n] // chunk, num_chunks - 1)
        last = jnp.clip((hi_ref[n] + chunk - 1) // chunk - 1, first, num_chunks - 1)
        return i, jnp.clip(p * per_split + c, first, last), k

    tile = (heads * r, heads * h)
    ctx = pl.BlockSpec((None, chunk, heads * h), ctx_index)
    out_index = lambda i, j, k, p, c, *_: (i, j, p, k, 0, 0)
    kernel = functools.partial(_tpu_kernel, chunk=chunk, per_split=per_split, num_blocks=a, scale=h**-0.5)
    outs, lses = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b, a, kv_heads // heads, splits, per_split),
            in_specs=[pl.BlockSpec((None, None, None, *tile), lambda i, j, k, *_: (i, j, k, 0, 0)), ctx, ctx],
            out_specs=[
                pl.BlockSpec((None, None, None, None, *tile), out_index),
                pl.BlockSpec((None, None, None, None, heads * r, LANES), out_index),
            ],
            scratch_shapes=[
                pltpu.VMEM((heads * r, LANES), jnp.float32),
                pltpu.VMEM((heads * r, LANES), jnp.float32),
                pltpu.VMEM(tile, jnp.float32),
            ],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((b, a, splits, kv_heads // heads, *tile), jnp.float32),
            jax.ShapeDtypeStruct((b, a, splits, kv_heads // heads, heads * r, LANES), jnp.float32),
        ],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "parallel", "arbitrary")
        ),
        interpret=interpret,
        name="target_kv_attention_tpu",
    )(lo.reshape(-1), hi.reshape(-1), _block_diagonal(q_rows, heads), k_ctx.reshape(b, s, -1), v_ctx.reshape(b, s, -1))
    lses = lses[..., :1].reshape(b, a, splits, kv_heads, r, 1)
    return _diagonal_blocks(outs, heads), lses


# ---------------------------------------------------------------- the kernel path, with the reference backward


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
        if settings.variant == "gpu":
            attend, interpret = gpu_context_attention, settings.interpret
        else:
            attend, interpret = tpu_context_attention, pltpu.InterpretParams() if settings.interpret else False
        outs, lses = attend(
            q_rows, k_ctx, v_ctx, lo, hi, chunk=settings.chunk, splits=settings.splits, interpret=interpret
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


def auto_impl(platform: str) -> str:
    """What `impl="auto"` runs on `platform`: the kernel only where it has been verified. Logged once per
    process for each (platform, choice)."""
    choice = "pallas" if platform in VERIFIED_PLATFORMS else "reference"
    if (platform, choice) not in _logged_choices:
        _logged_choices.add((platform, choice))
        why = "verified there" if choice == "pallas" else f"kernel verified only on {sorted(VERIFIED_PLATFORMS)}"
        logger.info("target_kv_attention impl=auto on %s: %s (%s)", platform, choice, why)
    return choice


def target_kv_attention(
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
    impl: str = "auto",
):
    """Entry point: see the module docstring for the contract and which `impl` runs where."""
    if impl not in IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; choose one of {IMPLS}")
    platform = jax.default_backend()
    if impl == "auto":
        impl = auto_impl(platform)
    if impl == "reference":
        return reference(
            q,
            k_blk,
            v_blk,
            k_ctx,
            v_ctx,
            anchors,
            doc_starts,
            window=window,
            causal=causal,
            per_query_window=per_query_window,
        )
    native = "tpu" if platform == "tpu" else "gpu"
    variant = native if impl == "pallas" else impl.removeprefix("pallas_")
    if platform != "cpu" and variant != native:
        raise ValueError(f"attention impl {impl!r} cannot run on {platform}: use 'pallas' or 'reference'")
    settings = KernelSettings(variant=variant, interpret=platform == "cpu")
    return pallas_attention(
        q,
        k_blk,
        v_blk,
        k_ctx,
        v_ctx,
        anchors,
        doc_starts,
        window=window,
        causal=causal,
        per_query_window=per_query_window,
        settings=settings,
    )
