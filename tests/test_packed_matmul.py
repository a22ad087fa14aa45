"""The packed CPU matmul kernel (`hspec_jax.kernels.cpu_matmul`): the native kernel against its `jnp` reference, the
packed layout, its build cache, and models placed with packed linear layers against the same models unpacked."""

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hspec_jax.drafters import draft_block, init_drafter, init_from_target
from hspec_jax.drafters.dflash import drafter_context
from hspec_jax.drafters.vocab import build_draft_vocab
from hspec_jax.kernels import cpu_matmul
from hspec_jax.kernels.cpu_matmul import native
from hspec_jax.machine import cpu_flags
from hspec_jax.models import commit, forward, init_cache, init_params
from hspec_jax.models.layers import for_backend, fuse_projections, pack_linear_layers
from hspec_jax.recipes import drafter_from_recipe, target_config

RECIPE = importlib.import_module("configs.tiny").get_config()
TARGET = target_config(RECIPE)
needs_kernel = pytest.mark.skipif(not cpu_matmul.available(), reason=f"{native.unavailable_reason()}")


def close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_pack_is_the_kernel_in_blocks_of_16_columns():
    kernel = jnp.arange(6 * 32, dtype=jnp.float32).reshape(6, 32)
    packed = cpu_matmul.pack(kernel)
    assert packed.shape == (2, 6, 16)
    assert jnp.array_equal(packed[1, 4], kernel[4, 16:32])
    assert jnp.array_equal(cpu_matmul.unpack(packed), kernel)
    assert jnp.array_equal(cpu_matmul.pack_rows(kernel.T), packed)
    assert not cpu_matmul.packable(kernel[:, :24]) and not cpu_matmul.packable(kernel.astype(jnp.bfloat16))


@needs_kernel
@pytest.mark.parametrize(("rows", "depth", "columns"), [(1, 64, 16), (3, 7, 48), (8, 576, 960), (37, 100, 4096)])
def test_native_kernel_matches_the_reference(rows, depth, columns):
    x = jax.random.normal(jax.random.key(0), (rows, depth))
    packed = cpu_matmul.pack(jax.random.normal(jax.random.key(1), (depth, columns)))
    native_out = jax.jit(lambda a, w: cpu_matmul.packed_matmul(a, w, impl="native"))(x, packed)
    reference = cpu_matmul.packed_matmul(x, packed, impl="reference")
    np.testing.assert_allclose(np.asarray(native_out), np.asarray(reference), rtol=1e-5, atol=1e-4)


@needs_kernel
def test_a_row_gives_the_same_bits_whatever_rows_come_with_it():
    """One FMA chain per output element, in k order: a plain step's row equals the same row of an 8-row verify."""
    x = jax.random.normal(jax.random.key(0), (2, 8, 576))
    packed = cpu_matmul.pack(jax.random.normal(jax.random.key(1), (576, 1536)))
    run = jax.jit(lambda a: cpu_matmul.packed_matmul(a, packed))
    full = np.asarray(run(x))
    for rows in (1, 3, 5):
        np.testing.assert_array_equal(np.asarray(run(x[:, :rows])), full[:, :rows])
    assert np.asarray(run(x[:, :0])).shape == (2, 0, 1536)


@needs_kernel
@pytest.mark.skipif("avx512f" not in cpu_flags(), reason="the CPU has no AVX-512F: the kernel has one path here")
def test_the_avx512_and_avx2_paths_give_the_same_bits(tmp_path):
    """The AVX-512F path (8 rows per pass) and the AVX2 path (4 rows per pass; a process with
    HSPEC_PACKED_MATMUL_AVX2=1) compute each element as the same FMA chain: identical outputs for 1 to 9 rows."""
    x = np.asarray(jax.random.normal(jax.random.key(0), (9, 576)))
    packed = np.asarray(cpu_matmul.pack(jax.random.normal(jax.random.key(1), (576, 960))))
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "w.npy", packed)
    script = (
        "import sys, numpy as np, jax\n"
        "from hspec_jax.kernels import cpu_matmul\n"
        "x, w = np.load(sys.argv[1] + '/x.npy'), np.load(sys.argv[1] + '/w.npy')\n"
        "run = jax.jit(lambda a: cpu_matmul.packed_matmul(a, w, impl='native'))\n"
        "np.save(sys.argv[1] + '/' + cpu_matmul.kernel_path() + '.npy', np.stack([np.pad(np.asarray(run(x[:m])),"
        " ((0, 9 - m), (0, 0))) for m in range(1, 10)]))\n"
    )
    root = Path(__file__).resolve().parents[1]
    for forced in ("0", "1"):
        env = {**os.environ, "HSPEC_PACKED_MATMUL_AVX2": forced}
        done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=root, env=env, capture_output=True)
        assert done.returncode == 0, done.stderr.decode()[-2000:]
    np.testing.assert_array_equal(np.load(tmp_path / "avx512f.npy"), np.load(tmp_path / "avx2.npy"))


def test_the_build_is_keyed_by_its_source(tmp_path, monkeypatch):
    if native.compiler() is None:
        pytest.skip("no C++ compiler")
    edited = tmp_path / "packed_matmul.cc"
    edited.write_text(native.SOURCE.read_text() + "\n// edited\n")
    before = native.library_path(native.compiler())
    assert before.parent == native.SOURCE.parent / "build" or before.parent.name == "kernels"
    monkeypatch.setattr(native, "SOURCE", edited)
    path = native.library_path(native.compiler())
    assert path != before and path.parent == tmp_path / "build"
    assert native.build(native.compiler()) == path and path.exists()
    built = path.stat().st_mtime_ns
    assert native.build(native.compiler()) == path and path.stat().st_mtime_ns == built  # not rebuilt
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left


def test_a_read_only_package_builds_into_the_user_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(native.os, "access", lambda path, mode: False)
    assert native.library_dir() == tmp_path / "hspec_jax" / "kernels"


def test_a_cpu_without_avx2_keeps_xla_dots(monkeypatch):
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"sse2"}))
    assert native.unavailable_reason() == "the CPU lacks avx2, fma"


def test_packing_keeps_every_other_array_and_is_idempotent():
    params = fuse_projections(init_params(TARGET.replace(tie_word_embeddings=True), jax.random.key(0)))
    params = {**params, "layers": tuple(jax.tree.map(lambda x, i=i: x[i], params["layers"]) for i in range(2))}
    packed = pack_linear_layers(params)
    layer = packed["layers"][1]
    assert set(layer["mlp"]["down_proj"]) == {"packed_kernel"}
    assert jnp.array_equal(
        cpu_matmul.unpack(layer["mlp"]["down_proj"]["packed_kernel"]), params["layers"][1]["mlp"]["down_proj"]["kernel"]
    )
    assert layer["input_layernorm"]["scale"] is params["layers"][1]["input_layernorm"]["scale"]
    embedding = params["embed_tokens"]["embedding"]  # tied: kept for the token lookup, packed as the lm_head
    assert packed["embed_tokens"]["embedding"] is embedding
    assert jnp.array_equal(packed["packed_lm_head"], cpu_matmul.pack_rows(embedding))
    again = pack_linear_layers(packed)
    assert all(x is y for x, y in zip(jax.tree.leaves(again), jax.tree.leaves(packed), strict=True))
    assert "kernel" in params["layers"][1]["mlp"]["down_proj"]  # the input tree is unchanged


@pytest.mark.parametrize("tied", [True, False])
def test_packed_target_forward_matches_unpacked(tied):
    config = TARGET.replace(qkv_bias=True, tie_word_embeddings=tied)
    params = fuse_projections(init_params(config, jax.random.key(0)))
    params = jax.tree_util.tree_map_with_path(lambda path, x: x + 0.1 if path[-1].key == "bias" else x, params)
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 3, config.vocab_size)
    step = jax.jit(lambda p, t, c: forward(p, config, t, c, taps=(1, 3)))
    outs = []
    for p in (params, pack_linear_layers(params)):
        prefill = step(p, tokens, init_cache(config, 2, 16))
        cache = commit(prefill.cache, jnp.array([9, 6]))
        verify = step(p, tokens[:, :4], cache)  # a multi-token step at ragged starts
        outs.append((prefill.logits, prefill.hidden, verify.logits, verify.cache.k[2], verify.cache.v[5]))
    jax.tree.map(close, outs[0], outs[1])


@pytest.mark.parametrize("kind", ["hspec", "dflash"])
def test_packed_drafter_matches_unpacked(kind):
    """H-Spec (Mamba-2 projections packed, its depthwise conv left alone) and DFlash (k/v injection reads the
    k/v columns of the packed fused kernel)."""
    params = init_params(TARGET, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (1, 12), 3, TARGET.vocab_size)
    config = drafter_from_recipe(RECIPE, kind, TARGET)
    vocab = build_draft_vocab(np.asarray(tokens), TARGET.vocab_size, config.vocab_size, always=(2,))
    dparams = fuse_projections(init_from_target(init_drafter(config, jax.random.key(2)), config, params, vocab))
    packed = pack_linear_layers(dparams)
    assert "packed_lm_head" in packed and "lm_head" not in packed
    if kind == "hspec":
        conv = [v for k, v in jax.tree_util.tree_leaves_with_path(packed) if "conv1d" in jax.tree_util.keystr(k)]
        assert conv and all(x.ndim <= 2 for x in conv)
    out = forward(params, TARGET, tokens, init_cache(TARGET, 1, 32), config.fusion_layer_ids)
    cache = commit(out.cache, jnp.array([12]))
    taps = jnp.concatenate(out.hidden, axis=-1)
    rows = jnp.arange(12, dtype=jnp.int32)[None]
    block = jnp.concatenate([tokens[:, -1:], jnp.full((1, config.num_drafts), config.mask_token_id)], 1)
    kw = dict(
        target_cache=cache,
        seed_hidden=taps[:, -1],
        drafter_cache=drafter_context(config, 1, 32),
        inject_rows=(taps, rows, rows[:, 0]) if config.owns_kv_cache else None,
    )
    embedding = params["embed_tokens"]["embedding"]
    draft = jax.jit(lambda p: draft_block(p, config, embedding, block, cache.lengths, **kw))
    unpacked, with_packed = draft(dparams), draft(packed)
    close(unpacked.logits, with_packed.logits)
    if config.owns_kv_cache:
        jax.tree.map(close, unpacked.drafter_cache, with_packed.drafter_cache)


@needs_kernel
def test_cpu_placement_packs_where_the_kernel_runs():
    """Where the kernel runs the CPU decoder scans its layers: they stay stacked, each kernel packed per layer."""
    params = init_params(TARGET, jax.random.key(0))
    placed = for_backend(params)
    assert TARGET.scans_layers and "packed_lm_head" in placed
    packed = placed["layers"]["mlp"]["gate_up_proj"]["packed_kernel"]
    gate = params["layers"]["mlp"]["gate_proj"]["kernel"]
    assert packed.shape == (TARGET.num_layers, 2 * TARGET.intermediate_size // 16, TARGET.hidden_size, 16)
    assert jnp.array_equal(cpu_matmul.unpack(packed)[..., : gate.shape[-1]], gate)


@needs_kernel
@pytest.mark.parametrize("first_block", [0, 2])
def test_native_kernel_reads_one_layer_of_a_stack(first_block):
    """A `StackedLayer` (the stack and a traced layer index) multiplies by that layer's kernel from `first_block` on,
    natively as in the reference; an index past the stack is an error, not a read out of bounds."""
    x = jax.random.normal(jax.random.key(0), (3, 64))
    kernels = jax.random.normal(jax.random.key(1), (4, 64, 96))
    stack = cpu_matmul.pack(kernels)
    assert jnp.array_equal(cpu_matmul.unpack(stack), kernels)
    run = jax.jit(
        lambda i, impl: cpu_matmul.packed_matmul(x, cpu_matmul.StackedLayer(stack, i), impl, first_block),
        static_argnums=1,
    )
    for i in range(4):
        expected = np.asarray(x @ kernels[i])[:, 16 * first_block :]
        for impl in ("native", "reference"):
            np.testing.assert_allclose(np.asarray(run(jnp.int32(i), impl)), expected, rtol=1e-5, atol=1e-4)
    with pytest.raises(Exception, match="layer index out of range"):
        jax.block_until_ready(run(jnp.int32(4), "native"))
    with pytest.raises(ValueError, match="StackedLayer"):  # a bare stack names no layer
        cpu_matmul.packed_matmul(x, stack)


@needs_kernel
@pytest.mark.parametrize("capacity", [128, 512])
def test_a_scanned_step_copies_no_layer_weights_nor_cache(capacity):
    """The point of scanning on CPU: in the compiled decoding step no packed kernel is sliced out of its stack and
    neither a layer of the (donated) cache nor the stack is copied whole (at 128 rows, a key block of every row
    made XLA copy the stack)."""
    params = for_backend(init_params(TARGET, jax.random.key(0)))
    cache = init_cache(TARGET, 2, capacity)
    step = jax.jit(lambda p, t, c: forward(p, TARGET, t, c), donate_argnums=2)
    hlo = step.lower(params, jnp.ones((2, 1), jnp.int32), cache).compile().as_text()
    sliced = {m.group(1) for m in re.finditer(r"f32\[([\d,]+)\][^=]*= *f32\[[\d,]+\][^ ]* dynamic-slice\(", hlo)}
    sliced |= {m.group(1) for m in re.finditer(r"= f32\[([\d,]+)\]\{[\d,]+\} (?:dynamic-slice|copy)\(", hlo)}
    kernels = {",".join(map(str, a.shape[1:])) for a in jax.tree.leaves(params["layers"]) if a.ndim == 4}
    layer = ",".join(map(str, cache.k.shape[1:]))
    assert kernels and not any(s.removeprefix("1,") in kernels for s in sliced), sliced
    assert layer not in {s.removeprefix("1,") for s in sliced} and ",".join(map(str, cache.k.shape)) not in sliced
