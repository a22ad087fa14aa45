"""The training step on the tiny recipe: packed rows behave like separate documents, chunking changes nothing,
every kind trains (the loss falls on a fixed batch), frozen parameters stay put, and the paper-sized recipes
build their step abstractly."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hspec_jax.drafters import drafter_param_shapes, init_drafter, init_from_target
from hspec_jax.drafters.params import trainable_mask
from hspec_jax.drafters.vocab import build_draft_vocab
from hspec_jax.models import forward, init_cache, init_params
from hspec_jax.recipes import drafter_from_recipe, target_config
from train.losses import LossWeights, loss_from_sums, recipe_weights
from train.optim import make_optimizer
from train.step import (
    StepConfig,
    block_target_logits,
    eval_loss_fn,
    eval_sums_fn,
    fresh_state,
    make_train_step,
    target_features,
)

RECIPE = importlib.import_module("configs.tiny").get_config()
TARGET = target_config(RECIPE)
LENGTH = 48


def packed_batch(seed=0, batch=2, anchors=12):
    """Two rows, each packing documents of lengths (20, 28) and (30, 10) + padding; supervised tokens in
    the second half of every document; anchors at supervised positions."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(4, TARGET.vocab_size, (batch, LENGTH)).astype(np.int32)
    positions = np.zeros((batch, LENGTH), np.int32)
    doc_ids = np.full((batch, LENGTH), -1, np.int32)
    loss_mask = np.zeros((batch, LENGTH), bool)
    for b, docs in enumerate([(20, 28), (30, 10)][:batch]):
        start = 0
        for d, n in enumerate(docs):
            positions[b, start : start + n] = np.arange(n)
            doc_ids[b, start : start + n] = d
            loss_mask[b, start + n // 2 : start + n] = True
            start += n
    candidates = [np.flatnonzero(loss_mask[b, 1 : LENGTH - 8] & loss_mask[b, 2 : LENGTH - 7]) + 1 for b in range(batch)]
    chosen = np.zeros((batch, anchors), np.int32)
    valid = np.zeros((batch, anchors), bool)
    for b, c in enumerate(candidates):
        pick = np.sort(rng.choice(c, min(anchors, len(c)), replace=False))
        chosen[b, : len(pick)], valid[b, : len(pick)] = pick, True
    return {
        "tokens": tokens,
        "positions": positions,
        "doc_ids": doc_ids,
        "loss_mask": loss_mask,
        "anchors": chosen,
        "anchor_valid": valid,
    }


@pytest.fixture(scope="module")
def target_params():
    return init_params(TARGET, jax.random.key(0))


def setup_state(kind, target_params, train_overrides=None, seed=1):
    drafter = drafter_from_recipe(RECIPE, kind, TARGET)
    vocab = build_draft_vocab(np.arange(TARGET.vocab_size), TARGET.vocab_size, drafter.vocab_size)
    params = init_from_target(init_drafter(drafter, jax.random.key(seed)), drafter, target_params, vocab)
    train = RECIPE.train.copy_and_resolve_references()
    train.num_steps, train.learning_rate = 40, 3e-3
    for key, value in (train_overrides or {}).items():
        setattr(train, key, value)
    optimizer, schedule = make_optimizer(train, params, drafter)
    return drafter, vocab, fresh_state(params, optimizer, 0), optimizer, schedule


def test_long_packed_rows_equal_separate_documents(target_params):
    """Rows longer than the decoder's blocked-attention threshold: documents still never see each other."""
    from hspec_jax.models.decoder import LONG_INPUT

    length, split = LONG_INPUT + 64, LONG_INPUT // 2
    tokens = jax.random.randint(jax.random.key(7), (1, length), 4, TARGET.vocab_size)
    positions = jnp.concatenate([jnp.arange(split), jnp.arange(length - split)])[None]
    out = forward(target_params, TARGET, tokens, init_cache(TARGET, 1, length), (3,), positions=positions)
    alone = forward(target_params, TARGET, tokens[:, split:], init_cache(TARGET, 1, length - split), (3,))
    np.testing.assert_allclose(np.asarray(out.hidden[0][:, split:]), np.asarray(alone.hidden[0]), atol=5e-5)
    np.testing.assert_allclose(np.asarray(out.logits[:, split:]), np.asarray(alone.logits), atol=5e-5)


def test_packed_rows_equal_separate_documents(target_params):
    """Per-document positions: a packed document's taps and K/V equal those of the document alone."""
    batch = packed_batch(batch=1)
    out = forward(
        target_params,
        TARGET,
        jnp.asarray(batch["tokens"]),
        init_cache(TARGET, 1, LENGTH),
        (2, 6),
        positions=jnp.asarray(batch["positions"]),
    )
    alone = forward(target_params, TARGET, jnp.asarray(batch["tokens"][:, 20:48]), init_cache(TARGET, 1, 28), (2, 6))
    for packed, single in zip(out.hidden, alone.hidden, strict=True):
        np.testing.assert_allclose(np.asarray(packed[:, 20:48]), np.asarray(single), atol=2e-5)
    np.testing.assert_allclose(np.asarray(out.cache.k[3][:, 20:48]), np.asarray(alone.cache.k[3]), atol=2e-5)
    np.testing.assert_allclose(np.asarray(out.logits[:, 20:48]), np.asarray(alone.logits), atol=2e-5)


# The three code paths of the step: H-Spec (its ablations are switches on the same module), DFlash with its own
# injected cache and the Markov + confidence heads (DSpark), and DFlash reading the target's cache; and the two
# optimisers (one of the kinds trains with Muon: the optimiser acts on the parameter tree, whatever the kind).
@pytest.mark.parametrize("kind, algorithm", [("hspec", "adamw"), ("dspark", "muon"), ("dflash_target_kv", "adamw")])
def test_each_drafter_family_trains(kind, algorithm, target_params):
    """Repeated steps on one batch drive the loss down; frozen parameters never move; Muon keeps a momentum per
    trainable matrix and nothing for frozen parameters."""
    drafter, vocab, state, optimizer, schedule = setup_state(kind, target_params, {"optimizer": algorithm})
    frozen_before = jax.tree.map(np.asarray, state.params)
    config = StepConfig(TARGET, drafter, LossWeights(), anchors_per_chunk=8)
    step = make_train_step(config, optimizer, schedule)
    batch = jax.tree.map(jnp.asarray, packed_batch())
    losses = []
    for _ in range(12):
        state, metrics = step(state, target_params, vocab, batch)
        losses.append(float(metrics["loss"]))
    assert np.isfinite(losses).all() and losses[-1] < 0.9 * losses[0], losses
    assert float(metrics["grad_norm"]) > 0 and int(state.step) == 12
    mask = trainable_mask(state.params, drafter)
    for before, after, trainable in zip(
        jax.tree.leaves(frozen_before), jax.tree.leaves(state.params), jax.tree.leaves(mask), strict=True
    ):
        if not trainable:
            np.testing.assert_array_equal(before, np.asarray(after))
    if algorithm == "muon":
        assert losses[-1] < 0.8 * losses[0], losses
        trained = sum(x.size for x, m in zip(jax.tree.leaves(state.params), jax.tree.leaves(mask), strict=True) if m)
        assert sum(x.size for x in jax.tree.leaves(state.opt_state)) < 3 * trained


def test_chunking_does_not_change_the_loss(target_params):
    drafter, vocab, state, *_ = setup_state("hspec", target_params)
    batch = jax.tree.map(jnp.asarray, packed_batch(seed=3))
    results = [
        eval_loss_fn(StepConfig(TARGET, drafter, LossWeights(), anchors_per_chunk=n))(
            state.params, target_params, vocab, batch
        )
        for n in (12, 5, 1)
    ]
    for other in results[1:]:
        for name in ("loss", "ce", "tv", "confidence"):
            np.testing.assert_allclose(float(other[name]), float(results[0][name]), rtol=1e-5)


def test_statistics_pooled_over_batches_give_the_metrics_of_the_batches_together(target_params):
    """What train.main logs on held-out batches: sums added over batches, then `loss_from_sums`."""
    drafter, vocab, state, *_ = setup_state("hspec", target_params)
    config = StepConfig(TARGET, drafter, LossWeights(), anchors_per_chunk=4)
    a, b = packed_batch(seed=6, batch=1), packed_batch(seed=7, batch=1)
    both = {k: np.concatenate([a[k], b[k]]) for k in a}
    sums = eval_sums_fn(config)
    pooled = jax.tree.map(
        lambda x, y: x + y, *(sums(state.params, target_params, vocab, jax.tree.map(jnp.asarray, x)) for x in (a, b))
    )
    _, metrics = loss_from_sums(pooled, config.weights)
    together = eval_loss_fn(config)(state.params, target_params, vocab, jax.tree.map(jnp.asarray, both))
    for name in ("loss", "acc", "overlap", "sim_accept_len", "supervised_slots"):
        np.testing.assert_allclose(np.asarray(metrics[name]), np.asarray(together[name]), rtol=1e-5, atol=1e-6)


def test_blocks_never_see_another_document(target_params):
    """Changing the first document of a row changes nothing for blocks anchored in the second one."""
    drafter, vocab, state, *_ = setup_state("hspec", target_params)
    batch = packed_batch(seed=4, batch=1)
    second = batch["anchors"] >= 20
    batch["anchor_valid"] &= second
    changed = {k: v.copy() for k, v in batch.items()}
    changed["tokens"][:, :20] = (changed["tokens"][:, :20] + 7) % TARGET.vocab_size
    fn = eval_loss_fn(StepConfig(TARGET, drafter, LossWeights(), anchors_per_chunk=4))
    a = fn(state.params, target_params, vocab, jax.tree.map(jnp.asarray, batch))
    b = fn(state.params, target_params, vocab, jax.tree.map(jnp.asarray, changed))
    np.testing.assert_allclose(float(a["loss"]), float(b["loss"]), rtol=1e-6)
    # ... while the first document's blocks do depend on it (the check above could not pass vacuously).
    batch["anchor_valid"] = ~second & (batch["anchors"] > 0)
    changed["anchor_valid"] = batch["anchor_valid"]
    a = fn(state.params, target_params, vocab, jax.tree.map(jnp.asarray, batch))
    b = fn(state.params, target_params, vocab, jax.tree.map(jnp.asarray, changed))
    assert abs(float(a["loss"]) - float(b["loss"])) > 1e-4


def test_recipe_loss_weights():
    assert recipe_weights("hspec") == LossWeights(0.1, 0.9, 1.0, 4.0)
    assert recipe_weights("dflash", 7.0) == LossWeights(1.0, 0.0, 0.0, 7.0)
    assert recipe_weights("dspark", tv=0.5, ce=None) == LossWeights(0.1, 0.5, 1.0, 4.0)
    with pytest.raises(ValueError, match="unknown loss weight"):
        recipe_weights("hspec", kl=1.0)


@pytest.mark.parametrize("name", ["llama", "qwen3_4b", "qwen3_8b"])
def test_paper_recipes_build_their_step(name):
    """The 8B-class steps trace and shape-check without allocating (jax.eval_shape)."""
    recipe = importlib.import_module(f"configs.{name}").get_config()
    target = target_config(recipe)
    drafter = drafter_from_recipe(recipe, "hspec", target)
    length, anchors = 256, 16
    abstract_target = jax.eval_shape(lambda: init_params(target, jax.random.key(0)))
    abstract_params = drafter_param_shapes(drafter)
    train = recipe.train.copy_and_resolve_references()
    optimizer, schedule = make_optimizer(train, abstract_params, drafter)
    abstract_state = jax.eval_shape(
        lambda p: fresh_state(p, optimizer, 0),
        abstract_params,
    )
    vocab = jax.eval_shape(
        lambda: build_draft_vocab(np.arange(drafter.vocab_size), target.vocab_size, drafter.vocab_size)
    )
    batch = {
        "tokens": jax.ShapeDtypeStruct((1, length), jnp.int32),
        "positions": jax.ShapeDtypeStruct((1, length), jnp.int32),
        "doc_ids": jax.ShapeDtypeStruct((1, length), jnp.int32),
        "loss_mask": jax.ShapeDtypeStruct((1, length), bool),
        "anchors": jax.ShapeDtypeStruct((1, anchors), jnp.int32),
        "anchor_valid": jax.ShapeDtypeStruct((1, anchors), bool),
    }
    config = StepConfig(target, drafter, LossWeights(), anchors_per_chunk=8)
    new_state, metrics = jax.eval_shape(
        make_train_step(config, optimizer, schedule), abstract_state, abstract_target, vocab, batch
    )
    assert metrics["loss"].shape == () and metrics["acc"].shape == (drafter.num_drafts,)
    assert jax.tree.map(lambda x: x.shape, new_state.params) == jax.tree.map(lambda x: x.shape, abstract_params)


def test_target_features_hold_no_gradient(target_params):
    drafter = drafter_from_recipe(RECIPE, "hspec", TARGET)
    config = StepConfig(TARGET, drafter, LossWeights())
    batch = packed_batch(batch=1)
    grads = jax.grad(
        lambda p: target_features(p, config, jnp.asarray(batch["tokens"]), jnp.asarray(batch["positions"])).fused.sum()
    )(target_params)
    assert all(float(jnp.abs(g).sum()) == 0 for g in jax.tree.leaves(grads))


def test_block_targets_are_the_target_logits_one_row_earlier(target_params):
    """Slot k of the block at anchor a is supervised with the target's logits at row a + k - 1 (the prediction
    of token a + k), restricted to the draft vocabulary."""
    drafter, vocab, *_ = setup_state("hspec", target_params)
    config = StepConfig(TARGET, drafter, LossWeights())
    batch = packed_batch(batch=1)
    tokens, positions = jnp.asarray(batch["tokens"]), jnp.asarray(batch["positions"])
    features = target_features(target_params, config, tokens, positions)
    anchors = jnp.array([[5, 30]])
    got = block_target_logits(target_params, TARGET, features.last, anchors, drafter.block_size, vocab)
    full = forward(target_params, TARGET, tokens, init_cache(TARGET, 1, LENGTH), positions=positions).logits
    for j, a in enumerate((5, 30)):
        for k in range(1, drafter.block_size):
            np.testing.assert_allclose(np.asarray(got[0, j, k]), np.asarray(full[0, a + k - 1, vocab.d2t]), atol=1e-4)
