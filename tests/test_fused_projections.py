"""Fused projections (the CPU engines' params): one q/k/v and one gate/up matmul give the unfused model's outputs."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hspec_jax.drafters import draft_block, init_drafter, init_from_target
from hspec_jax.drafters.dflash import drafter_context
from hspec_jax.drafters.vocab import build_draft_vocab
from hspec_jax.models import commit, forward, init_cache, init_params
from hspec_jax.models.layers import fuse_projections
from hspec_jax.recipes import drafter_from_recipe, target_config

RECIPE = importlib.import_module("configs.tiny").get_config()
TARGET = target_config(RECIPE)


def close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_fuse_projections_concatenates_and_leaves_the_input_alone():
    config = TARGET.replace(qkv_bias=True)
    params = init_params(config, jax.random.key(0))
    fused = fuse_projections(params)
    attn, mlp = fused["layers"]["self_attn"], fused["layers"]["mlp"]
    assert set(attn) - {"q_norm", "k_norm"} == {"qkv_proj", "o_proj"} and set(mlp) == {"gate_up_proj", "down_proj"}
    source = params["layers"]["self_attn"]  # stacked: [L, D, F] kernels
    expected = jnp.concatenate([source[p]["kernel"] for p in ("q_proj", "k_proj", "v_proj")], axis=-1)
    assert jnp.array_equal(attn["qkv_proj"]["kernel"], expected)
    assert attn["qkv_proj"]["bias"].shape == (config.num_layers, expected.shape[-1])
    assert "q_proj" in params["layers"]["self_attn"]  # the input tree is unchanged


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_fused_target_forward_matches_unfused(qkv_bias):
    config = TARGET.replace(qkv_bias=qkv_bias)
    params = init_params(config, jax.random.key(0))
    if qkv_bias:  # non-zero biases, so that a bias dropped or misplaced by the fusion shows
        params = jax.tree_util.tree_map_with_path(lambda path, x: x + 0.1 if path[-1].key == "bias" else x, params)
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 3, config.vocab_size)
    step = jax.jit(lambda p, t, c: forward(p, config, t, c, taps=(1, 3)))
    outs = []
    for p in (params, fuse_projections(params)):
        prefill = step(p, tokens, init_cache(config, 2, 16))
        cache = commit(prefill.cache, jnp.array([9, 6]))
        verify = step(p, tokens[:, :4], cache)  # a multi-token step at ragged starts
        outs.append((prefill.logits, prefill.hidden, verify.logits, verify.cache.k[2], verify.cache.v[5]))
    jax.tree.map(close, outs[0], outs[1])


@pytest.mark.parametrize("kind", ["hspec", "dflash"])
def test_fused_drafter_matches_unfused(kind):
    """H-Spec (attention reads the target cache; MLP and attention sub-layers) and DFlash (its k/v injection uses the
    k/v columns of the fused kernel alone)."""
    params = init_params(TARGET, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (1, 12), 3, TARGET.vocab_size)
    config = drafter_from_recipe(RECIPE, kind, TARGET)
    vocab = build_draft_vocab(np.asarray(tokens), TARGET.vocab_size, config.vocab_size, always=(2,))
    dparams = init_from_target(init_drafter(config, jax.random.key(2)), config, params, vocab)
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
    unfused, fused = draft(dparams), draft(fuse_projections(dparams))
    close(unfused.logits, fused.logits)
    if config.owns_kv_cache:
        jax.tree.map(close, unfused.drafter_cache, fused.drafter_cache)
