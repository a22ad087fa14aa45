"""TPU variant of the context part (Pallas Mosaic TPU): scalar-prefetched visible ranges, head groups as
block-diagonal query tiles, the running softmax in VMEM scratch across a split's chunks."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from hspec_jax.kernels.target_kv_attention.common import chunk_scores, finish, num_splits, online_update
from hspec_jax.models.layers import MASK_VALUE

TPU_PROGRAMS = 2  # a TPU runs the grid in order; 2 parallel programs keep both megacore TensorCores busy
TPU_CHUNK = 512  # context rows per TPU grid step (one K and one V tile of [C, heads * H] in VMEM)
LANES = 128  # TPU lane width: per-row softmax statistics are stored lane-replicated, [R, 128]


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
        scores = chunk_scores(q_ref[...], kc_ref[...], scale)
        m, denom, acc = online_update(
            m_ref[:, :1], denom_ref[:, :1], acc_ref[...], scores, (cols >= lo) & (cols < hi), v
        )
        m_ref[...] = jnp.broadcast_to(m, m_ref.shape)
        denom_ref[...] = jnp.broadcast_to(denom, denom_ref.shape)
        acc_ref[...] = acc

    @pl.when(c == per_split - 1)
    def _write():
        o, lse = finish(m_ref[:, :1], denom_ref[:, :1], acc_ref[...])
        o_ref[...] = o
        lse_ref[...] = jnp.broadcast_to(lse, lse_ref.shape)


def tpu_context_attention(q_rows, k_ctx, v_ctx, lo, hi, *, chunk: int | None = None, splits=None, interpret=False):
    """TPU variant of the context part, same contract as `gpu.gpu_context_attention` (`interpret`: on CPU,
    through the TPU interpret mode, `pltpu.InterpretParams`).

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
    splits = splits or num_splits(num_chunks, b * a * (kv_heads // heads), TPU_PROGRAMS)
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
        interpret=pltpu.InterpretParams() if interpret else False,
        name="target_kv_attention_tpu",
    )(lo.reshape(-1), hi.reshape(-1), _block_diagonal(q_rows, heads), k_ctx.reshape(b, s, -1), v_ctx.reshape(b, s, -1))
    lses = lses[..., :1].reshape(b, a, splits, kv_heads, r, 1)
    return _diagonal_blocks(outs, heads), lses
