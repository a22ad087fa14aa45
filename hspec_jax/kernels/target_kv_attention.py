"""Block attention over a context KV cache read in place: the drafters' attention, as a Pallas kernel
beside its readable `jnp` reference, behind one entry point.

A drafter block of T tokens (anchor + masks) sits at positions a .. a+T-1, where a (the "anchor" position)
is also the number of context rows before it. Its queries attend to

  (a) context keys/values `[B, S, K, H]` (the target's own post-RoPE KV cache for H-Spec, read in place;
      the drafter's injected cache for DFlash): row j is visible iff doc_start <= j < a and, with a sliding
      window W, j >= a - W (the window is anchored at the block, so every slot sees the same context rows).
      `doc_starts [B, A]` is the first row of the anchor's document: 0 at inference; in training, where
      documents are packed into one row, it keeps a block from seeing an earlier document; and
  (b) the block's own keys/values `[.., T, K, H]`: causal (slot u visible to slot t iff u <= t) or, for
      DFlash, bidirectional.

Axis letters: B batch, A blocks per sequence, T block length, S context rows, N query heads, K KV heads,
G = N / K, H head dim. Query head n reads KV head n // G. Softmax statistics are fp32 (online softmax).

Which path runs where:
* `impl="pallas"`: the kernel (forward only). On CPU it runs in interpret mode (tests check it against
  the reference over ragged lengths, windows, T 1..16 and K < N). Used for inference on accelerators.
* `impl="reference"`: masked dense `jnp` attention; differentiable, handles many blocks per sequence.
  Training always uses it (`hspec_jax/drafters` call it with A = number of anchors), and it is the CPU
  default, where XLA runs it faster than the interpreted kernel.
* `impl="auto"`: pallas on GPU/TPU, reference on CPU.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from hspec_jax.models.layers import MASK_VALUE

IMPLS = ("auto", "pallas", "reference")
MAX_CONTEXT_CHUNK = 128  # context rows per inner-loop step of the kernel


def context_mask(anchors: jax.Array, num_rows: int, window: int | None, doc_starts: jax.Array | None = None):
    """`[B, A, S]`: context row j is visible to the block anchored at a iff doc_start <= j < a (and j >= a - window)."""
    rows = jnp.arange(num_rows)
    visible = rows < anchors[..., None]
    if window is not None:
        visible &= rows >= anchors[..., None] - window
    if doc_starts is not None:
        visible &= rows >= doc_starts[..., None]
    return visible


def reference(
    q, k_blk, v_blk, k_ctx, v_ctx, anchors, doc_starts=None, *, window: int | None = None, causal: bool = True
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
    visible = context_mask(anchors, k_ctx.shape[1], window, doc_starts)  # [B, A, S]
    ctx = jnp.where(visible[:, :, None, None, None, :], ctx, MASK_VALUE)
    probs = jax.nn.softmax(jnp.concatenate([ctx, blk], axis=-1), axis=-1)
    p_ctx, p_blk = probs[..., : k_ctx.shape[1]], probs[..., k_ctx.shape[1] :]
    out = jnp.einsum("bakgts,bskh->batkgh", p_ctx.astype(v_ctx.dtype), v_ctx, preferred_element_type=jnp.float32)
    out += jnp.einsum("bakgtu,baukh->batkgh", p_blk.astype(v_blk.dtype), v_blk, preferred_element_type=jnp.float32)
    return out.reshape(b, a, t, n, h).astype(q.dtype)


def _online_update(carry, scores, values):
    """One online-softmax step: fold `scores [R, C]` (fp32, masked = MASK_VALUE) and `values [C, H]` in."""
    m, denom, acc = carry
    m_new = jnp.maximum(m, scores.max(axis=-1))
    p = jnp.exp(scores - m_new[:, None])
    alpha = jnp.exp(m - m_new)
    acc = alpha[:, None] * acc + jnp.dot(p, values.astype(jnp.float32), preferred_element_type=jnp.float32)
    return m_new, alpha * denom + p.sum(axis=-1), acc


def _kernel(anchor_ref, start_ref, q_ref, kb_ref, vb_ref, kc_ref, vc_ref, o_ref, *, chunk, window, causal, has_ctx):
    """One (sequence, block, KV head): q `[T, G, H]`, block K/V `[T, H]`, context K/V `[S, H]` -> o `[T, G, H]`."""
    t, g, h = q_ref.shape
    q = q_ref[...].astype(jnp.float32).reshape(t * g, h) * (h**-0.5)  # row r = slot r // G
    carry = (
        jnp.full((t * g,), MASK_VALUE, jnp.float32),
        jnp.zeros((t * g,), jnp.float32),
        jnp.zeros((t * g, h), jnp.float32),
    )
    if has_ctx:
        anchor = anchor_ref[0, 0]
        low = jnp.maximum(anchor - window, start_ref[0, 0]) if window is not None else start_ref[0, 0]

        def context_step(i, carry):
            start = pl.multiple_of(i * chunk, chunk)
            k = kc_ref[pl.ds(start, chunk), :].astype(jnp.float32)
            scores = jnp.dot(q, k.T, preferred_element_type=jnp.float32)
            rows = start + jax.lax.broadcasted_iota(jnp.int32, (1, chunk), 1)
            scores = jnp.where((rows < anchor) & (rows >= low), scores, MASK_VALUE)
            return _online_update(carry, scores, vc_ref[pl.ds(start, chunk), :])

        carry = jax.lax.fori_loop(low // chunk, (anchor + chunk - 1) // chunk, context_step, carry)
    scores = jnp.dot(q, kb_ref[...].astype(jnp.float32).T, preferred_element_type=jnp.float32)
    if causal:
        slot = jax.lax.broadcasted_iota(jnp.int32, (t * g, t), 0) // g
        key = jax.lax.broadcasted_iota(jnp.int32, (t * g, t), 1)
        scores = jnp.where(key <= slot, scores, MASK_VALUE)
    _, denom, acc = _online_update(carry, scores, vb_ref[...])
    o_ref[...] = (acc / denom[:, None]).reshape(t, g, h).astype(o_ref.dtype)


def pallas_attention(
    q, k_blk, v_blk, k_ctx, v_ctx, anchors, doc_starts=None, *, window=None, causal=True, interpret=False
):
    """The kernel, same contract as `reference`. Grid: (sequence, block, KV head)."""
    if doc_starts is None:
        doc_starts = jnp.zeros_like(anchors)
    b, a, t, n, h = q.shape
    kv_heads = k_blk.shape[3]
    g = n // kv_heads
    has_ctx = k_ctx is not None
    if not has_ctx:  # a one-row dummy context, never read (has_ctx=False)
        k_ctx = v_ctx = jnp.zeros((b, 1, kv_heads, h), q.dtype)
    s = k_ctx.shape[1]
    chunk = math.gcd(s, MAX_CONTEXT_CHUNK)
    kernel = functools.partial(_kernel, chunk=chunk, window=window, causal=causal, has_ctx=has_ctx)
    block_spec = pl.BlockSpec((None, None, t, None, h), lambda i, j, k: (i, j, 0, k, 0))
    ctx_spec = pl.BlockSpec((None, s, None, h), lambda i, j, k: (i, 0, k, 0))
    return pl.pallas_call(
        kernel,
        grid=(b, a, kv_heads),
        in_specs=[
            pl.BlockSpec((1, 1), lambda i, j, k: (i, j)),
            pl.BlockSpec((1, 1), lambda i, j, k: (i, j)),
            pl.BlockSpec((None, None, t, g, h), lambda i, j, k: (i, j, 0, k, 0)),
            block_spec,
            block_spec,
            ctx_spec,
            ctx_spec,
        ],
        out_specs=pl.BlockSpec((None, None, t, g, h), lambda i, j, k: (i, j, 0, k, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        interpret=interpret,
        name="target_kv_attention",
    )(anchors.astype(jnp.int32), doc_starts.astype(jnp.int32), q, k_blk, v_blk, k_ctx, v_ctx)


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
    impl: str = "auto",
):
    """Entry point: see the module docstring for the contract and which `impl` runs where."""
    if impl not in IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; choose one of {IMPLS}")
    on_cpu = jax.default_backend() == "cpu"
    if impl == "reference" or (impl == "auto" and on_cpu):
        return reference(q, k_blk, v_blk, k_ctx, v_ctx, anchors, doc_starts, window=window, causal=causal)
    return pallas_attention(
        q, k_blk, v_blk, k_ctx, v_ctx, anchors, doc_starts, window=window, causal=causal, interpret=on_cpu
    )
