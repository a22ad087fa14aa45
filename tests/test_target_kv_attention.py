"""Target-KV block attention: the jnp reference against a brute-force definition; both Pallas kernel variants
(GPU and TPU, in their interpret modes on CPU) against the reference over ragged anchors, documents, windows,
block sizes, GQA groups and context splits; gradients through the kernel path; `impl="auto"`; and both
variants' lowering for their real backend."""

import functools
import itertools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hspec_jax.kernels.target_kv_attention import (
    KernelSettings,
    dispatch,
    pallas_attention,
    reference,
    target_kv_attention,
)


def random_inputs(seed, batch=3, blocks=1, t=8, heads=6, kv_heads=2, head_dim=16, rows=40):
    """q, k_blk, v_blk, k_ctx, v_ctx ~ N(0, 1) (numpy's generator: no per-shape compile of jax.random)."""
    rng = np.random.default_rng(seed)
    shapes = [(batch, blocks, t, heads, head_dim)] + [(batch, blocks, t, kv_heads, head_dim)] * 2
    shapes += [(batch, rows, kv_heads, head_dim)] * 2
    return tuple(jnp.asarray(rng.standard_normal(shape, np.float32)) for shape in shapes)


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


# (block length T, KV heads, query heads, context rows, window, causal, doc_starts, dtype, GPU/TPU chunk, splits)
# Together: GQA groups 1/3/4/8, T 1..16, rows not a multiple of the chunk (and fewer than one), windows shorter
# and longer than the context, one and several context splits, documents starting mid-row and at the anchor, bf16.
CASES = [
    (1, 4, 4, 64, None, True, True, jnp.float32, (None, None), None),  # the variants' default chunk and splits
    (3, 1, 4, 12, 7, False, True, jnp.float32, (16, 8), 3),  # fewer rows than a GPU chunk: padded to 16
    (8, 3, 9, 37, 100, True, True, jnp.float32, (16, 16), 1),  # one split: its last chunk overlaps (GPU)
    (16, 2, 16, 37, 5, False, False, jnp.float32, (32, 8), None),
    (5, 1, 8, 48, 20, True, True, jnp.bfloat16, (16, 16), 2),
]


def ragged_blocks(rows, with_starts):
    """Anchors [4, 2]: 0, full (rows), ragged; doc_starts 0 or mid-row, incl. one equal to its anchor."""
    anchors = jnp.array([[0, rows], [1, rows // 2], [rows - 1, 3], [rows // 3, rows]])
    starts = jnp.array([[0, rows // 4], [1, 2], [rows // 2, 0], [0, rows]]) if with_starts else None
    return anchors, starts


@pytest.mark.parametrize("variant", ["gpu", "tpu"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_kernel_matches_reference(variant, case):
    t, kv_heads, heads, rows, window, causal, with_starts, dtype, chunks, splits = CASES[case]
    inputs = random_inputs(case, batch=4, blocks=2, t=t, heads=heads, kv_heads=kv_heads, rows=rows)
    inputs = tuple(x.astype(dtype) for x in inputs)
    anchors, starts = ragged_blocks(rows, with_starts)
    settings = KernelSettings(variant, interpret=True, chunk=chunks[variant == "tpu"], splits=splits)
    kernel = jax.jit(functools.partial(pallas_attention, window=window, causal=causal, settings=settings))
    got = kernel(*inputs, anchors, starts)
    want = jax.jit(functools.partial(reference, window=window, causal=causal))(*inputs, anchors, starts)
    assert got.dtype == dtype
    atol = 2e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=atol)


@pytest.mark.parametrize("variant", ["gpu", "tpu"])
def test_kernel_without_context(variant):
    q, k_blk, v_blk, _, _ = random_inputs(3)
    anchors = jnp.array([[4], [0], [9]])
    want = reference(q, k_blk, v_blk, None, None, anchors)
    got = pallas_attention(q, k_blk, v_blk, None, None, anchors, settings=KernelSettings(variant, interpret=True))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)


def test_kernel_gradients_equal_the_reference():
    """jax.grad through impl="pallas" (custom_vjp, the reference's backward) for every float input."""
    inputs = random_inputs(4, blocks=2, t=4, rows=24)
    anchors = jnp.array([[0, 24], [7, 3], [20, 11]])
    starts = jnp.array([[0, 2], [5, 0], [0, 11]])
    weights = random_inputs(8, blocks=2, t=4, rows=24)[0]

    def loss(impl, *x):
        return (weights * target_kv_attention(*x, anchors, starts, window=9, impl=impl)).sum()

    argnums = (0, 1, 2, 3, 4)
    got = jax.jit(jax.grad(functools.partial(loss, "pallas"), argnums))(*inputs)
    want = jax.jit(jax.grad(functools.partial(loss, "reference"), argnums))(*inputs)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5)
    assert float(jnp.abs(got[3]).sum()) > 0  # the context keys get a gradient


def test_auto_runs_the_kernel_only_where_verified(monkeypatch, caplog):
    q, k_blk, v_blk, k_ctx, v_ctx = random_inputs(5)
    anchors = jnp.array([[10], [25], [3]])
    monkeypatch.setattr(dispatch, "_logged_choices", set())
    with caplog.at_level(logging.INFO, logger=dispatch.__name__):
        assert dispatch.auto_impl("cpu") == "reference"  # nothing verified yet
        auto = target_kv_attention(q, k_blk, v_blk, k_ctx, v_ctx, anchors, window=8)
        monkeypatch.setattr(dispatch, "VERIFIED_PLATFORMS", {"cpu"})
        assert dispatch.auto_impl("cpu") == "pallas"
        assert dispatch.auto_impl("cpu") == "pallas"
    assert [r.getMessage().split(": ")[1].split(" ")[0] for r in caplog.records] == ["reference", "pallas"]
    np.testing.assert_array_equal(
        np.asarray(auto), np.asarray(reference(q, k_blk, v_blk, k_ctx, v_ctx, anchors, window=8))
    )


def test_dispatcher_and_rows_past_the_anchor():
    q, k_blk, v_blk, k_ctx, v_ctx = random_inputs(5)
    anchors = jnp.array([[10], [25], [3]])
    auto = target_kv_attention(q, k_blk, v_blk, k_ctx, v_ctx, anchors, window=8)
    for impl in ("pallas", "pallas_tpu"):
        explicit = target_kv_attention(q, k_blk, v_blk, k_ctx, v_ctx, anchors, window=8, impl=impl)
        np.testing.assert_allclose(np.asarray(auto), np.asarray(explicit), atol=2e-5)
    # Rows at/after the anchor (uncommitted) and before the window are never read.
    noise = random_inputs(9)[3]
    rows = jnp.arange(k_ctx.shape[1])[None, :, None, None]
    outside = (rows >= anchors[:, :1, None, None]) | (rows < anchors[:, :1, None, None] - 8)
    changed = target_kv_attention(
        q, k_blk, v_blk, jnp.where(outside, noise, k_ctx), jnp.where(outside, noise, v_ctx), anchors, window=8
    )
    np.testing.assert_allclose(np.asarray(changed), np.asarray(auto), atol=1e-6)
    with pytest.raises(ValueError, match="unknown attention impl"):
        target_kv_attention(q, k_blk, v_blk, k_ctx, v_ctx, anchors, impl="cuda")


# Attention geometry of the targets (query heads, KV heads, head dim): SmolLM2; Qwen3-8B and Llama-3.1-8B.
TARGET_SHAPES = [(9, 3, 64), (32, 8, 128)]


@pytest.mark.parametrize("variant,platform", [("gpu", "cuda"), ("tpu", "tpu")])
def test_kernels_lower_for_their_accelerator(variant, platform, monkeypatch):
    """Both variants pass their backend's lowering on CPU (no device needed) at the targets' shapes: Triton's
    power-of-two / dot-size rules, Mosaic TPU's (8, 128) block rule. Compiling for the chip (Triton -> PTX,
    Mosaic layout passes) still needs the device: `benchmarks/device_check.sh`."""
    if platform == "tpu":
        from jax._src.pallas.mosaic import tpu_info  # the lowering asks which TPU it targets: say v5e

        if not hasattr(tpu_info, "registry"):
            pytest.skip("this jax has no TPU-info registry to lower for a TPU without one")
        v5e = lambda: tpu_info.get_tpu_info_for_chip(tpu_info.ChipVersion.TPU_V5E, 1)
        monkeypatch.setitem(tpu_info.registry, jax.devices()[0].device_kind, v5e)
    for (heads, kv_heads, head_dim), t, dtype in itertools.product(
        TARGET_SHAPES, (1, 8, 16), (jnp.bfloat16, jnp.float32)
    ):
        b, s = 8, 32768
        shapes = [(b, 1, t, heads, head_dim)] + [(b, 1, t, kv_heads, head_dim)] * 2 + [(b, s, kv_heads, head_dim)] * 2
        args = [jax.ShapeDtypeStruct(x, dtype) for x in shapes] + [jax.ShapeDtypeStruct((b, 1), jnp.int32)] * 2
        fn = functools.partial(pallas_attention, window=2048, settings=KernelSettings(variant))
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()
        assert f"target_kv_attention_{variant}" in text


def test_reference_gradients_are_finite():
    q, k_blk, v_blk, k_ctx, v_ctx = random_inputs(6, blocks=3)
    anchors = jnp.array([[0, 7, 20], [40, 2, 1], [5, 5, 5]])
    grads = jax.jit(jax.grad(lambda *a: reference(*a, anchors, window=16).sum(), argnums=(0, 1, 2, 3, 4)))(
        q, k_blk, v_blk, k_ctx, v_ctx
    )
    assert all(bool(jnp.isfinite(g).all()) for g in grads)
    assert float(jnp.abs(grads[3]).sum()) > 0
