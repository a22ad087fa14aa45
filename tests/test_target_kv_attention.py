"""Target-KV block attention: the jnp reference against a brute-force definition, and the Pallas kernel
(interpret mode on CPU) against the reference over ragged lengths, windows, block sizes and GQA."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hspec_jax.kernels.target_kv_attention import pallas_attention, reference, target_kv_attention


def random_inputs(seed, batch=3, blocks=1, t=8, heads=6, kv_heads=2, head_dim=16, rows=40):
    ks = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(ks[0], (batch, blocks, t, heads, head_dim))
    k_blk = jax.random.normal(ks[1], (batch, blocks, t, kv_heads, head_dim))
    v_blk = jax.random.normal(ks[2], (batch, blocks, t, kv_heads, head_dim))
    k_ctx = jax.random.normal(ks[3], (batch, rows, kv_heads, head_dim))
    v_ctx = jax.random.normal(ks[4], (batch, rows, kv_heads, head_dim))
    return q, k_blk, v_blk, k_ctx, v_ctx


def brute_force(q, k_blk, v_blk, k_ctx, v_ctx, anchors, window, causal, doc_starts=None):
    """One query at a time, straight from the definition, in fp64."""
    doc_starts = np.zeros(anchors.shape, int) if doc_starts is None else np.asarray(doc_starts)
    q, k_blk, v_blk, k_ctx, v_ctx, anchors = (
        np.asarray(x, np.float64) for x in (q, k_blk, v_blk, k_ctx, v_ctx, anchors)
    )
    batch, blocks, t, heads, head_dim = q.shape
    group = heads // k_blk.shape[3]
    out = np.zeros_like(q)
    for b, a, s, n in itertools.product(range(batch), range(blocks), range(t), range(heads)):
        kv = n // group
        anchor = int(anchors[b, a])
        start = int(doc_starts[b, a])
        rows = [j for j in range(k_ctx.shape[1]) if start <= j < anchor and (window is None or j >= anchor - window)]
        slots = [u for u in range(t) if not causal or u <= s]
        keys = np.concatenate([k_ctx[b, rows, kv], k_blk[b, a, slots, kv]])
        values = np.concatenate([v_ctx[b, rows, kv], v_blk[b, a, slots, kv]])
        scores = keys @ q[b, a, s, n] / np.sqrt(head_dim)
        p = np.exp(scores - scores.max())
        out[b, a, s, n] = (p / p.sum()) @ values
    return out


@pytest.mark.parametrize("window,causal", [(None, True), (None, False), (6, True), (64, False)])
def test_reference_matches_definition(window, causal):
    inputs = random_inputs(0, blocks=2, t=4, rows=12)
    anchors = jnp.array([[0, 5], [12, 9], [3, 1]])
    got = reference(*inputs, anchors, window=window, causal=causal)
    np.testing.assert_allclose(np.asarray(got), brute_force(*inputs, anchors, window, causal), atol=1e-5)


@pytest.mark.parametrize("window", [None, 4])
def test_document_starts_hide_earlier_documents(window):
    """Packed training rows: a block sees only its own document's rows before the anchor (and the window)."""
    inputs = random_inputs(1, blocks=3, t=4, rows=16)
    anchors = jnp.array([[3, 9, 15], [12, 6, 2], [16, 16, 8]])
    starts = jnp.array([[0, 5, 9], [10, 0, 2], [0, 11, 8]])
    want = brute_force(*inputs, anchors, window, True, starts)
    got = reference(*inputs, anchors, starts, window=window)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)
    kernel = pallas_attention(*inputs, anchors, starts, window=window, interpret=True)
    np.testing.assert_allclose(np.asarray(kernel), want, atol=2e-5)


CASES = [
    # (block length T, KV heads, query heads, context rows, window)
    (1, 2, 6, 40, None),
    (3, 1, 4, 40, 7),
    (8, 2, 6, 40, 100),  # window longer than any context
    (8, 3, 9, 64, 16),
    (16, 2, 8, 37, 5),  # rows not a multiple of the kernel's chunk
    (16, 4, 4, 128, None),  # K == N (no grouping)
]


@pytest.mark.parametrize("t,kv_heads,heads,rows,window", CASES)
@pytest.mark.parametrize("causal", [True, False])
def test_pallas_kernel_matches_reference(t, kv_heads, heads, rows, window, causal):
    inputs = random_inputs(t * 7 + rows, batch=4, blocks=2, t=t, heads=heads, kv_heads=kv_heads, rows=rows)
    anchors = jnp.array([[0, rows], [1, rows // 2], [rows - 1, 3], [rows // 3, 0]])  # ragged, 0 and full
    want = reference(*inputs, anchors, window=window, causal=causal)
    got = pallas_attention(*inputs, anchors, window=window, causal=causal, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)


def test_pallas_kernel_without_context():
    q, k_blk, v_blk, _, _ = random_inputs(3)
    anchors = jnp.array([[4], [0], [9]])
    want = reference(q, k_blk, v_blk, None, None, anchors)
    got = pallas_attention(q, k_blk, v_blk, None, None, anchors, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)


def test_dispatcher_and_rows_past_the_anchor():
    q, k_blk, v_blk, k_ctx, v_ctx = random_inputs(5)
    anchors = jnp.array([[10], [25], [3]])
    auto = target_kv_attention(q, k_blk, v_blk, k_ctx, v_ctx, anchors, window=8)
    explicit = target_kv_attention(q, k_blk, v_blk, k_ctx, v_ctx, anchors, window=8, impl="pallas")
    np.testing.assert_allclose(np.asarray(auto), np.asarray(explicit), atol=2e-5)
    # Rows at/after the anchor (uncommitted) and before the window are never read.
    noise = jax.random.normal(jax.random.key(9), k_ctx.shape)
    rows = jnp.arange(k_ctx.shape[1])[None, :, None, None]
    outside = (rows >= anchors[:, :1, None, None]) | (rows < anchors[:, :1, None, None] - 8)
    changed = target_kv_attention(
        q, k_blk, v_blk, jnp.where(outside, noise, k_ctx), jnp.where(outside, noise, v_ctx), anchors, window=8
    )
    np.testing.assert_allclose(np.asarray(changed), np.asarray(auto), atol=1e-6)
    with pytest.raises(ValueError, match="unknown attention impl"):
        target_kv_attention(q, k_blk, v_blk, k_ctx, v_ctx, anchors, impl="cuda")


def test_reference_gradients_are_finite():
    q, k_blk, v_blk, k_ctx, v_ctx = random_inputs(6, blocks=3)
    anchors = jnp.array([[0, 7, 20], [40, 2, 1], [5, 5, 5]])
    grads = jax.grad(lambda *a: reference(*a, anchors, window=16).sum(), argnums=(0, 1, 2, 3, 4))(
        q, k_blk, v_blk, k_ctx, v_ctx
    )
    assert all(bool(jnp.isfinite(g).all()) for g in grads)
    assert float(jnp.abs(grads[3]).sum()) > 0
