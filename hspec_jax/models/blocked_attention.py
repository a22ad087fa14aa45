"""Attention for long inputs without a `[T, S]` score matrix: query blocks x key blocks, online softmax.

`dot_product_attention` (layers.py) materialises scores for every query against every cache row, which for a
prompt of T tokens is `[B, N, T, S]` fp32 (9 heads x 5k x 5k x 4 bytes = 0.9 GB per layer for SmolLM2) plus
the mask and the probabilities. `blocked_attention` computes the same result the way a flash kernel does:
queries in blocks of `block_q`; for each, a loop over only the key blocks it can see (the causal limit and
the first visible row bound the loop, so a prefill visits about half the blocks), keeping a running max,
normaliser and weighted sum (online softmax) in fp32. Peak scores memory is one `[B, N, block_q, block_k]`
tile. Pure `jnp` + `lax` loops: it runs on every backend and needs no kernel.

Visibility is an interval of cache rows per query: key row j is visible to query t of sequence b iff
`first_row[b, t] <= j <= last_row[b, t]` (causal: last_row = the query's own row; a sliding window or a
document boundary sets first_row).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hspec_jax.models.layers import MASK_VALUE

BLOCK_Q = 256
BLOCK_K = 512


def blocked_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    last_row: jax.Array,
    first_row: jax.Array | None = None,
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
    layer: jax.Array | None = None,
) -> jax.Array:
    """Grouped-query attention over an interval of cache rows per query, block by block.

    q `[B, T, N, H]`; k, v `[B, S, K, H]` (N a multiple of K), or with `layer` (an int32 scalar, traced or not)
    every layer's stacked `[L, B, S, K, H]`, of which layer `layer` is read block by block where it lies (a scanned
    decoder's cache: no copy of the layer first); last_row, first_row `[B, T]` int (first_row None = 0). Every
    query must see at least one row. Returns `[B, T, N, H]` in q.dtype, equal (up to float rounding) to
    `dot_product_attention` with the mask `first_row <= j <= last_row`.
    """
    whole = layer is None  # k and v are the layer's own arrays: a block may span every row
    if whole:
        k, v, layer = k[None], v[None], 0
    b, t, n, h = q.shape
    s, kv_heads = k.shape[2], k.shape[3]
    g = n // kv_heads
    if first_row is None:
        first_row = jnp.zeros_like(last_row)
    # Read in place from a stack, a key block spans at most half the rows: a block of every row lets XLA fuse the
    # cache row this step wrote into the read and copy the whole stack to keep the old rows, every layer (a SmolLM2
    # decoding step at 128 rows of cache: 24.9-28.1 ms against 19.7 ms with half-size blocks).
    bq, bk = min(block_q, t), min(block_k, s if whole else max(s // 2, 1))
    num_q = -(-t // bq)
    pad = num_q * bq - t
    # Padded queries repeat the last real one (a valid, discarded computation).
    qp = jnp.pad(q.reshape(b, t, kv_heads, g, h), ((0, 0), (0, pad), (0, 0), (0, 0), (0, 0)), mode="edge")
    rows = jnp.pad(jnp.stack([first_row, last_row]), ((0, 0), (0, 0), (0, pad)), mode="edge")
    q_blocks = qp.reshape(b, num_q, bq, kv_heads, g, h).swapaxes(0, 1)  # [Q, B, bq, K, G, H]
    row_blocks = rows.reshape(2, b, num_q, bq).transpose(2, 0, 1, 3)  # [Q, 2, B, bq]
    scale = h**-0.5

    def query_block(args):
        qb, (first, last) = args  # [B, bq, K, G, H], [B, bq] each

        def key_block(j, carry):
            m, norm, acc = carry  # [B, K, G, bq], [B, K, G, bq], [B, K, G, bq, H]
            start = jnp.minimum(j * bk, s - bk)  # the last block is shifted back to fit; its overlap is masked
            kb, vb = (jax.lax.dynamic_slice(x, (layer, 0, start, 0, 0), (1, b, bk, kv_heads, h))[0] for x in (k, v))
            keys = start + jnp.arange(bk)
            visible = (keys >= j * bk) & (keys >= first[:, :, None]) & (keys <= last[:, :, None])  # [B, bq, bk]
            visible = visible[:, None, None]  # [B, 1, 1, bq, bk]
            scores = jnp.einsum("bqkgh,bskh->bkgqs", qb, kb, preferred_element_type=jnp.float32) * scale
            scores = jnp.where(visible, scores, MASK_VALUE)
            m_new = jnp.maximum(m, scores.max(-1))
            p = jnp.where(visible, jnp.exp(scores - m_new[..., None]), 0.0)
            alpha = jnp.exp(m - m_new)
            pv = jnp.einsum("bkgqs,bskh->bkgqh", p.astype(v.dtype), vb, preferred_element_type=jnp.float32)
            return m_new, alpha * norm + p.sum(-1), alpha[..., None] * acc + pv

        init = (
            jnp.full((b, kv_heads, g, bq), MASK_VALUE, jnp.float32),
            jnp.zeros((b, kv_heads, g, bq), jnp.float32),
            jnp.zeros((b, kv_heads, g, bq, h), jnp.float32),
        )
        lo = jnp.maximum(jnp.min(first), 0) // bk
        hi = jnp.minimum(jnp.max(last) // bk + 1, -(-s // bk))
        _, norm, acc = jax.lax.fori_loop(lo, hi, key_block, init)
        return acc / norm[..., None]  # [B, K, G, bq, H]

    out = jax.lax.map(query_block, (q_blocks, row_blocks))  # [Q, B, K, G, bq, H]
    out = out.transpose(1, 0, 4, 2, 3, 5).reshape(b, num_q * bq, n, h)
    return out[:, :t].astype(q.dtype)
