"""Decoder layers scanned or called per layer: the same function, the same results, one traced layer either way;
the stacked parameter tree and its edges (placement, sharding rules, Orbax targets written before stacking)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hspec_jax.checkpoints import load_target, save_target
from hspec_jax.checkpoints.orbax_io import save_pytree
from hspec_jax.decoding.placement import Placement
from hspec_jax.models import TargetConfig, forward, init_cache, init_params, layer_params
from hspec_jax.models import config as config_module
from hspec_jax.models.decoder import per_layer_names, stacked_layers
from hspec_jax.models.layers import for_backend
from hspec_jax.parallel import logical_axes
from hspec_jax.serving.paged import paged_cache

TARGET = TargetConfig(
    model_type="qwen3",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    qk_norm=True,
    layer_types=("sliding_attention", "full_attention", "sliding_attention", "full_attention"),
    sliding_window=3,
)


def close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("packed", [False, True])
def test_scanned_and_per_layer_decoders_agree(packed):
    """Logits, taps (embeddings, a middle layer, the last layer) and every cache row are the same whether the
    layers run under `lax.scan` on stacked weights and a stacked cache, or once per layer; a second call
    continues from the cache the first one wrote (sliding windows reach back into it)."""
    params = init_params(TARGET, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, TARGET.vocab_size)
    positions = jnp.asarray([[0, 1, 2, 3, 0, 1, 2, 3, 4]] * 2) if packed else None
    out = {}
    for scan in (False, True):
        config = TARGET.replace(scan_layers=scan)
        cache = init_cache(config, 2, 16)
        assert isinstance(cache.k, tuple) != scan
        first = forward(params, config, tokens, cache, taps=(0, 2, 4), positions=positions)
        cache = first.cache.replace(lengths=first.cache.lengths + 9)
        second = forward(params, config, tokens[:, :3], cache, taps=(4,), logit_indices=jnp.asarray([[2], [0]]))
        out[scan] = first, second
    (a1, a2), (b1, b2) = out[False], out[True]
    close(a1.logits, b1.logits)
    close(a2.logits, b2.logits)
    assert a2.logits.shape == (2, 1, TARGET.vocab_size)
    for x, y in zip(a1.hidden + a2.hidden, b1.hidden + b2.hidden, strict=True):
        close(x, y)
    for layer in range(TARGET.num_layers):
        for x, y in zip(a2.cache.layer(layer), b2.cache.layer(layer), strict=True):
            close(x[:, :12], y[:, :12])


def test_scanned_decoder_reads_and_writes_a_paged_pool():
    """The scanned decoder on a stacked paged pool gives the dense cache's logits and rows."""
    config = TARGET.replace(scan_layers=True)
    params = init_params(config, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(2), (1, 7), 0, config.vocab_size)
    pool = paged_cache(config, 1, 5, 4, max_pages=4)
    pool = pool.replace(page_table=jnp.asarray([[3, 1, 4, 2]], jnp.int32))
    assert not isinstance(pool.k, tuple) and pool.k.shape[0] == config.num_layers
    paged, dense = forward(params, config, tokens, pool), forward(params, config, tokens, init_cache(config, 1, 16))
    close(paged.logits, dense.logits)
    close(paged.cache.layer(3)[0][:, :7], dense.cache.layer(3)[0][:, :7])


def test_one_layer_is_traced_whatever_the_depth():
    """Scanned, the lowered program does not grow with depth; per layer, the layer is lowered once and called L
    times (XLA compiles the calls inlined)."""

    def lowered(num_layers, scan):
        config = TARGET.replace(num_layers=num_layers, layer_types=("full_attention",) * num_layers, scan_layers=scan)
        params = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
        cache = jax.eval_shape(lambda: init_cache(config, 1, 16))
        tokens = jax.ShapeDtypeStruct((1, 4), jnp.int32)
        return jax.jit(forward, static_argnums=1).trace(params, config, tokens, cache).lower().as_text()

    shallow, deep = lowered(2, True), lowered(12, True)
    assert len(deep) < 1.1 * len(shallow)
    text = lowered(12, False)
    assert text.count("func.func private @decoder_layer") == 1
    assert text.count("call @decoder_layer") == 12


def test_placement_follows_the_backends_default(monkeypatch):
    """Where the decoder scans (TPU; CPU with the packed kernel) placement keeps the layers stacked; where it does
    not (GPU; a CPU without the kernel, as the patched default says; a config with scan_layers=False) it gives one
    tree per layer, once."""
    params = init_params(TARGET, jax.random.key(0))
    for scan in (False, True):  # a config that says how its decoder runs is placed for it, whatever the default
        assert stacked_layers(Placement(None, TARGET.replace(scan_layers=scan)).params(params)["layers"]) == scan
    if config_module.scan_layers_default():
        assert stacked_layers(for_backend(params, pack=False)["layers"])  # packing: tests/test_packed_matmul.py
    monkeypatch.setattr(config_module, "scan_layers_default", lambda: False)
    placed = for_backend(params, pack=False)
    assert stacked_layers(params["layers"]) and isinstance(placed["layers"], tuple)
    assert len(placed["layers"]) == TARGET.num_layers
    np.testing.assert_array_equal(
        placed["layers"][2]["mlp"]["down_proj"]["kernel"], params["layers"]["mlp"]["down_proj"]["kernel"][2]
    )
    again = for_backend(placed, pack=False)
    assert all(x is y for x, y in zip(jax.tree.leaves(again), jax.tree.leaves(placed), strict=True))
    for i in (0, 3):
        close(
            layer_params(placed, i)["self_attn"]["o_proj"]["kernel"],
            layer_params(params, i)["self_attn"]["o_proj"]["kernel"],
        )
    tokens = jnp.arange(6)[None]
    close(
        forward(placed, TARGET, tokens, init_cache(TARGET, 1, 8)).logits,
        forward(params, TARGET, tokens, init_cache(TARGET, 1, 8)).logits,
    )


def test_the_layer_axis_is_never_sharded():
    assert logical_axes("layers/self_attn/q_proj/kernel", (4, 32, 64)) == (None, None, "heads")
    assert logical_axes("layers/mlp/down_proj/kernel", (4, 48, 32)) == (None, "mlp", None)
    assert logical_axes("layers/input_layernorm/scale", (4, 32)) == (None, None)
    assert logical_axes("layers_0/self_attn/q_proj/kernel", (32, 64)) == (None, "heads")  # a drafter's own layer


def test_a_target_saved_before_the_layers_were_stacked_loads_stacked(tmp_path):
    params = init_params(TARGET, jax.random.key(3))
    save_target(str(tmp_path / "new"), params, TARGET)
    save_target(str(tmp_path / "old"), params, TARGET)
    old_params = tmp_path / "old" / "params"
    import shutil

    shutil.rmtree(old_params)
    save_pytree(str(old_params), per_layer_names(params, TARGET.num_layers))
    for name in ("new", "old"):
        _, loaded = load_target(str(tmp_path / name))
        assert stacked_layers(loaded["layers"])
        jax.tree.map(np.testing.assert_array_equal, loaded, params)


def test_a_seed_gives_each_layer_the_same_weights_whatever_the_depth():
    """Each layer's weights come from the random stream of its own name: layer 2 of a 3-layer and of a 4-layer
    target are equal, and the layers differ from each other."""
    three = init_params(TARGET.replace(num_layers=3, layer_types=TARGET.layer_types[:3]), jax.random.key(7))
    four = init_params(TARGET, jax.random.key(7))
    for i in range(3):
        jax.tree.map(np.testing.assert_array_equal, layer_params(three, i), layer_params(four, i))
    assert not np.array_equal(
        layer_params(four, 0)["mlp"]["up_proj"]["kernel"], layer_params(four, 1)["mlp"]["up_proj"]["kernel"]
    )
