"""GPU variant of the context part (Pallas Triton): one program per (sequence, block, KV head, split)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from hspec_jax.kernels.target_kv_attention.common import chunk_scores, finish, num_splits, online_update
from hspec_jax.models.layers import MASK_VALUE

GPU_PROGRAMS = 256  # splits are added until a GPU launch has about this many programs (2 per H100/H200 SM)


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
        return online_update(*carry, chunk_scores(q, kc_ref[pl.ds(start, chunk), :], scale), visible, v)

    begin = jnp.maximum(lo - split_start, 0) // chunk
    end = jnp.where(hi > lo, (hi - split_start + chunk - 1) // chunk, begin)
    init = (
        jnp.full((r, 1), MASK_VALUE, jnp.float32),
        jnp.zeros((r, 1), jnp.float32),
        jnp.zeros((r, h), jnp.float32),
    )
    o, lse = finish(*jax.lax.fori_loop(begin, end, step, init))
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
    [p * split_rows, (p + 1) * split_rows), P from `num_splits` so a launch has about `GPU_PROGRAMS` programs.
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
    splits = splits or num_splits(num_chunks, b * a * kv_heads, GPU_PROGRAMS)
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
