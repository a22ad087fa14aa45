"""Drafters on the tiny recipe: every kind runs jitted with finite gradients, initialisation copies the right
target layers, and each ablation differs from H-Spec exactly where it should."""

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hspec_jax.decoding import SamplingConfig
from hspec_jax.decoding.proposal import propose
from hspec_jax.drafters import (
    DRAFTER_KINDS,
    DFlashConfig,
    DraftInputs,
    draft_block,
    draft_blocks,
    empty_context,
    init_drafter,
    init_from_target,
)
from hspec_jax.drafters.api import block_inputs, seed_hidden_at
from hspec_jax.drafters.dflash import drafter_context
from hspec_jax.drafters.heads import markov_bias, markov_embed
from hspec_jax.drafters.params import trainable_mask
from hspec_jax.drafters.vocab import build_draft_vocab
from hspec_jax.models import commit, forward, init_cache, init_params
from hspec_jax.models.decoder import AttentionProjections, layer_params
from hspec_jax.models.layers import rms_norm
from hspec_jax.recipes import drafter_from_recipe, target_config

RECIPE = importlib.import_module("configs.tiny").get_config()
TARGET = target_config(RECIPE)
PROMPT_LENGTHS = (12, 7)


@pytest.fixture(scope="module")
def setup():
    """Target params, a draft vocabulary, and a real prefill of two ragged prompts."""
    params = init_params(TARGET, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 4, TARGET.vocab_size)
    vocab = build_draft_vocab(np.asarray(tokens), TARGET.vocab_size, RECIPE.drafter.draft_vocab_size, always=(2,))
    taps = RECIPE.drafter.fusion_layer_ids
    out = forward(params, TARGET, tokens, init_cache(TARGET, 2, 32), taps)
    cache = commit(out.cache, jnp.array(PROMPT_LENGTHS))
    hidden = jnp.concatenate(out.hidden, axis=-1)  # [B, S, F*D]
    return params, vocab, tokens, cache, hidden


def make_drafter(kind, setup, seed=1):
    target_params, vocab = setup[0], setup[1]
    config = drafter_from_recipe(RECIPE, kind, TARGET)
    return config, init_from_target(init_drafter(config, jax.random.key(seed)), config, target_params, vocab)


def run(config, params, setup, *, cache=None, hidden=None, anchor_tokens=(5, 9)):
    target_params, _, _, prefill_cache, prefill_hidden = setup
    cache = prefill_cache if cache is None else cache
    hidden = prefill_hidden if hidden is None else hidden
    anchors = cache.lengths
    block = jnp.concatenate(
        [jnp.array(anchor_tokens)[:, None], jnp.full((2, config.block_size - 1), config.mask_token_id)], 1
    )
    positions = jnp.broadcast_to(jnp.arange(hidden.shape[1]), hidden.shape[:2])
    kw = dict(  # every input; each kind reads what it uses
        target_cache=cache,
        seed_hidden=seed_hidden_at(hidden, anchors[:, None])[:, 0],
        drafter_cache=drafter_context(config, 2, 32),
        inject_rows=(hidden, positions, positions[:, 0]),
    )
    return _draft_block(params, config, target_params["embed_tokens"]["embedding"], block, anchors, kw)


@functools.partial(jax.jit, static_argnums=1)
def _draft_block(params, config, embedding, block, anchors, kw):
    """`draft_block` jitted once per (equal) config: the tests that run a kind several times reuse its program."""
    return draft_block(params, config, embedding, block, anchors, **kw)


@pytest.mark.parametrize("kind", DRAFTER_KINDS)
def test_a_shorter_block_drafts_the_same_first_tokens_when_causal(kind, setup):
    """`with_drafts(2)` runs the same weights on a 3-slot block: the H-Spec kinds (causal inside the block) give
    the first slots' logits of the full block within fp32 rounding, so the same drafted tokens; the bidirectional
    DFlash family sees fewer masks, and its logits move by far more than rounding. (Bitwise equality across the
    two shapes is not promised: XLA's CPU code may sum in another order for another shape or processor.)"""
    config, params = make_drafter(kind, setup)
    full, short = run(config, params, setup), run(config.with_drafts(2), params, setup)
    slots = short.logits.shape[1]
    assert slots == 3 - config.sample_from_anchor
    first, shorter = np.asarray(full.logits[:, :slots]), np.asarray(short.logits)
    moved = np.abs(first - shorter).max() / np.abs(first).max()
    if kind.startswith("hspec"):
        assert moved < 1e-5
        np.testing.assert_array_equal(first.argmax(-1), shorter.argmax(-1))
    else:
        assert moved > 1e-3


@pytest.mark.parametrize("kind", DRAFTER_KINDS)
def test_every_kind_drafts_a_block(kind, setup):
    config, params = make_drafter(kind, setup)
    out = run(config, params, setup)
    assert out.logits.shape == (2, config.block_size, config.vocab_size)
    assert out.hidden.shape == (2, config.block_size, TARGET.hidden_size)
    assert bool(jnp.isfinite(out.logits).all())
    if config.owns_kv_cache:  # the drafter-side cache is a real buffer, rows written for the context
        k0 = out.drafter_cache.layer(0)[0]
        assert k0.shape == (2, 32, TARGET.num_kv_heads, TARGET.head_dim)
        assert float(jnp.abs(k0[:, :16]).sum()) > 0 and float(jnp.abs(k0[:, 16:]).sum()) == 0
    else:
        assert out.drafter_cache is None


def many_block_inputs(config, setup, anchors, block, prev):
    """`DraftInputs` for several blocks per sequence over the prefilled context (every kind's inputs)."""
    target_params, _, _, cache, hidden = setup
    positions = jnp.broadcast_to(jnp.arange(hidden.shape[1]), hidden.shape[:2])
    return DraftInputs(
        embedding=target_params["embed_tokens"]["embedding"],
        block_tokens=block,
        anchors=anchors,
        seed_hidden=seed_hidden_at(hidden, anchors),
        target_cache=cache,
        drafter_cache=drafter_context(config, 2, hidden.shape[1]),
        inject_rows=(hidden, positions, positions[:, 0]),
        prev_tokens=prev,
    )


def training_loss(config, setup, params, anchors):
    """Teacher-forced cross-entropy over many blocks per sequence (the training path: reference attention)."""
    vocab, tokens = setup[1], setup[2]
    block, prev, labels = block_inputs(tokens, anchors, config.block_size, config.mask_token_id)
    out = draft_blocks(params, config, many_block_inputs(config, setup, anchors, block, prev))
    draft_labels = jnp.clip(jnp.cumsum(vocab.t2d) - 1, 0)[labels]
    logp = jax.nn.log_softmax(out.logits)
    loss = -jnp.take_along_axis(logp, draft_labels[..., None], -1)[..., 1:, 0].mean()
    if out.confidence is not None:
        loss += jax.nn.sigmoid(out.confidence).mean()
    return loss


@pytest.mark.parametrize("kind", DRAFTER_KINDS)
def test_training_path_gradients(kind, setup):
    config, params = make_drafter(kind, setup)
    anchors = jnp.array([[1, 4, 6], [2, 3, 5]])  # several blocks per sequence
    loss, grads = jax.jit(jax.value_and_grad(lambda p: training_loss(config, setup, p, anchors)))(params)
    leaves = jax.tree.leaves(grads)
    assert np.isfinite(float(loss)) and all(bool(jnp.isfinite(g).all()) for g in leaves)
    mask = trainable_mask(params, config)
    trained = [float(jnp.abs(g).sum()) for g, m in zip(leaves, jax.tree.leaves(mask), strict=True) if m]
    assert sum(t > 0 for t in trained) >= 0.9 * len(trained)  # nearly every trainable tensor gets a gradient


def test_multi_block_training_path_equals_single_blocks(setup):
    """A block in a many-anchor training batch sees exactly what the inference call sees."""
    config, params = make_drafter("hspec", setup)
    target_params, _, tokens, cache, hidden = setup
    anchors = jnp.array([[3, 7], [5, 7]])
    block, prev, _ = block_inputs(tokens, anchors, config.block_size, config.mask_token_id)
    multi = jax.jit(lambda p, x: draft_blocks(p, config, x))(
        params, many_block_inputs(config, setup, anchors, block, prev)
    )
    single_block = jax.jit(
        lambda p, b, a, c, h, prev: draft_block(
            p, config, target_params["embed_tokens"]["embedding"], b, a, target_cache=c, seed_hidden=h, prev_tokens=prev
        )
    )
    for j in range(2):
        single = single_block(
            params, block[:, j], anchors[:, j], cache, seed_hidden_at(hidden, anchors[:, j : j + 1])[:, 0], prev[:, j]
        )
        np.testing.assert_allclose(np.asarray(multi.logits[:, j]), np.asarray(single.logits), atol=2e-5)


def test_init_copies_the_mapped_target_layers(setup):
    target_params, vocab = setup[0], setup[1]
    config, params = make_drafter("hspec", setup)
    attn_layers = config.sublayers("attn")
    for i, layer in zip(attn_layers, config.attn_kv_layer_ids, strict=True):
        mine, theirs = params[f"layers_{i}"]["self_attn"], layer_params(target_params, layer)["self_attn"]
        for key in ("q_proj", "k_proj", "v_proj", "q_norm", "k_norm"):
            jax.tree.map(np.testing.assert_array_equal, mine[key], theirs[key])
        assert not np.array_equal(mine["o_proj"]["kernel"], theirs["o_proj"]["kernel"])  # o_proj is not copied
    np.testing.assert_array_equal(params["lm_head"], target_params["lm_head"][vocab.d2t])
    mask = trainable_mask(params, config)
    assert mask["lm_head"] is False and mask[f"layers_{attn_layers[0]}"]["self_attn"]["k_norm"]["scale"] is False
    assert mask[f"layers_{attn_layers[0]}"]["self_attn"]["k_proj"]["kernel"] is True


def test_block_keys_continue_the_target_cache(setup):
    """With copied q/k/v, the drafter's key for a token at position p equals the target's cached key."""
    target_params, _, tokens, _, _ = setup
    config, params = make_drafter("hspec", setup)
    layer_name = f"layers_{config.block_pattern.index('attn')}"
    target_layer = config.attn_kv_layer_ids[0]
    out = forward(target_params, TARGET, tokens[:, :12], init_cache(TARGET, 2, 16), taps=(target_layer,))
    scale = layer_params(target_params, target_layer)["input_layernorm"]["scale"]
    x = rms_norm(out.hidden[0], scale, TARGET.rms_norm_eps)  # the input of the target layer's attention
    positions = jnp.broadcast_to(jnp.arange(12), (2, 12))
    attn = params[layer_name]["self_attn"]
    k, _ = AttentionProjections(TARGET).apply({"params": attn}, x, positions, method="key_value")
    np.testing.assert_allclose(np.asarray(k), np.asarray(out.cache.k[target_layer][:, :12]), atol=1e-5)


def test_kv_only_ignores_hidden_states(setup):
    config, params = make_drafter("hspec_kv_only", setup)
    other = setup[4] + jax.random.normal(jax.random.key(3), setup[4].shape)
    np.testing.assert_array_equal(
        np.asarray(run(config, params, setup).logits), np.asarray(run(config, params, setup, hidden=other).logits)
    )
    assert not any(k.startswith(("fc", "seed_projs")) for k in params)
    hspec, hparams = make_drafter("hspec", setup)
    assert (
        float(jnp.abs(run(hspec, hparams, setup).logits - run(hspec, hparams, setup, hidden=other).logits).max()) > 1e-4
    )


def _perturbed_cache(cache):
    noise = lambda x, i: x + jax.random.normal(jax.random.key(i), x.shape)
    return cache.replace(
        k=tuple(noise(x, i) for i, x in enumerate(cache.k)), v=tuple(noise(x, 50 + i) for i, x in enumerate(cache.v))
    )


def test_last_token_only_ignores_target_kv(setup):
    config, params = make_drafter("hspec_last_token", setup)
    other = _perturbed_cache(setup[3])
    np.testing.assert_array_equal(
        np.asarray(run(config, params, setup).logits), np.asarray(run(config, params, setup, cache=other).logits)
    )
    hspec, hparams = make_drafter("hspec", setup)
    assert (
        float(jnp.abs(run(hspec, hparams, setup).logits - run(hspec, hparams, setup, cache=other).logits).max()) > 1e-4
    )


def test_hspec_reads_only_committed_rows_of_the_mapped_layers(setup):
    """Uncommitted rows (>= the anchor), and target layers it does not map, never change the draft."""
    config, params = make_drafter("hspec", setup)
    cache = setup[3]
    rows = jnp.arange(cache.capacity)[None, :, None, None]
    beyond = rows >= cache.lengths[:, None, None, None]
    mapped = set(config.attn_kv_layer_ids)
    noisy = lambda x, i, keep: x if keep else x + jax.random.normal(jax.random.key(i), x.shape)
    changed = cache.replace(
        k=tuple(jnp.where(beyond, x + 5.0, noisy(x, i, i in mapped)) for i, x in enumerate(cache.k)),
        v=tuple(jnp.where(beyond, x - 5.0, noisy(x, 90 + i, i in mapped)) for i, x in enumerate(cache.v)),
    )
    np.testing.assert_allclose(
        np.asarray(run(config, params, setup).logits),
        np.asarray(run(config, params, setup, cache=changed).logits),
        atol=1e-6,
    )


def test_dflash_injection_then_draft_equals_one_call(setup):
    config, params = make_drafter("dflash", setup)
    target_params, _, _, cache, hidden = setup
    embedding = target_params["embed_tokens"]["embedding"]
    block = jnp.concatenate([jnp.array([[5], [9]]), jnp.full((2, 7), config.mask_token_id)], 1)
    positions = jnp.broadcast_to(jnp.arange(16), (2, 16))
    one = draft_block(
        params,
        config,
        embedding,
        block,
        cache.lengths,
        drafter_cache=empty_context(config, 2, 32),
        inject_rows=(hidden, positions, positions[:, 0]),
    )
    # inject in two pieces (a prompt, then newly accepted rows), then draft with nothing new
    first = draft_block(
        params,
        config,
        embedding,
        block,
        jnp.array([4, 4]),
        drafter_cache=empty_context(config, 2, 32),
        inject_rows=(hidden[:, :4], positions[:, :4], positions[:, 0]),
    )
    second = draft_block(
        params,
        config,
        embedding,
        block,
        jnp.array([4, 4]),
        drafter_cache=first.drafter_cache,
        inject_rows=(hidden[:, 4:], positions[:, 4:], positions[:, 4]),
    )
    two = draft_block(params, config, embedding, block, cache.lengths, drafter_cache=second.drafter_cache)
    np.testing.assert_allclose(np.asarray(two.logits), np.asarray(one.logits), atol=1e-5)


def test_markov_proposal_is_sequential(setup):
    config, params = make_drafter("hspec", setup)
    _, vocab, *_ = setup
    out = run(config, params, setup)
    base = out.logits[:, 1:]
    proposal = propose(base, jnp.array([5, 9]), vocab, SamplingConfig(), jax.random.key(0), params["markov_head"])
    prev = jnp.array([5, 9])
    for i in range(config.num_drafts):
        logits = base[:, i] + markov_bias(params["markov_head"], markov_embed(params["markov_head"], prev))
        expected = vocab.d2t[jnp.argmax(logits, -1)]
        np.testing.assert_array_equal(np.asarray(proposal.tokens[:, i]), np.asarray(expected))
        prev = expected
    no_markov = propose(base, prev, vocab, SamplingConfig(), jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(no_markov.tokens), np.asarray(vocab.d2t[jnp.argmax(base, -1)]))


def test_confidence_head_does_not_train_the_backbone(setup):
    config, params = make_drafter("dspark", setup)
    tokens = setup[2]
    anchors = jnp.array([[2, 5], [1, 4]])
    block, prev, _ = block_inputs(tokens, anchors, config.block_size, config.mask_token_id)
    inputs = many_block_inputs(config, setup, anchors, block, prev)

    def confidence_only(p):
        return draft_blocks(p, config, inputs).confidence.sum()

    grads = jax.jit(jax.grad(confidence_only))(params)
    assert float(jnp.abs(grads["confidence_head"]["proj"]["kernel"]).sum()) > 0
    others = [g for k, g in grads.items() if k != "confidence_head"]
    assert all(float(jnp.abs(x).sum()) == 0 for x in jax.tree.leaves(others))


@pytest.mark.parametrize("mode,projections", [("shared", 1), ("per_layer", 4), ("once", 1)])
def test_seed_modes(mode, projections, setup):
    config = drafter_from_recipe(RECIPE, "hspec", TARGET).replace(seed_mode=mode)
    params = init_drafter(config, jax.random.key(0))
    assert sum(k.startswith("seed_projs") for k in params) == projections
    assert [config.seed_index(i) for i in range(4)] == {
        "shared": [0] * 4,
        "per_layer": [0, 1, 2, 3],
        "once": [0, None, None, None],
    }[mode]


@pytest.mark.parametrize("name", ["llama", "qwen3_4b", "qwen3_8b", "smollm2"])
def test_eval_shape_for_every_paper_config(name):
    recipe = importlib.import_module(f"configs.{name}").get_config()
    target = target_config(recipe)
    for kind in DRAFTER_KINDS:
        config = drafter_from_recipe(recipe, kind, target)
        shapes = jax.eval_shape(lambda c=config: init_drafter(c, jax.random.key(0)))
        assert shapes["lm_head"].shape == (recipe.drafter.draft_vocab_size, target.hidden_size)
        if kind == "hspec":
            m = recipe.drafter.mamba
            assert shapes["seed_projs_0"]["kernel"].shape == (
                recipe.drafter.fusion_rank,
                m.num_heads * m.head_dim * m.d_state,
            )


def test_config_errors():
    with pytest.raises(ValueError, match="attention sub-layers but attn_kv_layer_ids maps 2"):
        drafter_from_recipe(RECIPE, "hspec", TARGET).replace(attn_kv_layer_ids=(1, 2))
    with pytest.raises(ValueError, match="unknown drafter kind"):
        from hspec_jax.drafters import drafter_config

        drafter_config("eagle", TARGET, fusion_layer_ids=(1,))
    with pytest.raises(ValueError, match="out of range"):
        DFlashConfig(target=TARGET, fusion_layer_ids=(1, 99))
    with pytest.raises(ValueError, match=r"unknown drafter config field.*'mamba_heads'"):
        drafter_config("dspark", TARGET, fusion_layer_ids=(1,), mamba_heads=8)
