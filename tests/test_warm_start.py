"""Starting a run from a trained drafter (train/warm_start.py): the same drafter, or a smaller one cut from it
(a subset of its sub-layers, a smaller draft vocabulary)."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hspec_jax.checkpoints.drafter_io import save_drafter
from hspec_jax.drafters import draft_block, init_drafter, init_from_target
from hspec_jax.drafters.api import seed_hidden_at
from hspec_jax.drafters.vocab import build_draft_vocab
from hspec_jax.errors import InputError
from hspec_jax.models import commit, forward, init_cache, init_params
from hspec_jax.recipes import drafter_from_recipe, target_config
from train.warm_start import cut_vocab, parse_layers, starting_drafter, starting_params

RECIPE = importlib.import_module("configs.tiny").get_config()
TARGET = target_config(RECIPE)
EOS = TARGET.eos_token_ids[0]
# The tiny recipe's 11 sub-layers: mamba mlp mamba attn mlp mamba attn mlp mamba attn mlp (attention on 2, 3, 4).
CUT = (0, 3, 4, 8, 9, 10)
CUT_PATTERN = ("mamba", "attn", "mlp", "mamba", "attn", "mlp")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A saved tiny H-Spec drafter (random weights, lm_head from the target), its config, params, vocabulary, the
    target's params and supervised-token counts over the target vocabulary."""
    target_params = init_params(TARGET, jax.random.key(0))
    tokens = np.random.default_rng(0).integers(4, TARGET.vocab_size, 4000)
    config = drafter_from_recipe(RECIPE, "hspec", TARGET)
    vocab = build_draft_vocab(tokens, TARGET.vocab_size, config.vocab_size, always=(EOS,))
    params = init_from_target(init_drafter(config, jax.random.key(1)), config, target_params, vocab)
    path = str(tmp_path_factory.mktemp("drafter") / "d")
    save_drafter(path, params, config, vocab)
    counts = np.bincount(tokens[: len(tokens) // 2], minlength=TARGET.vocab_size)
    return path, config, params, vocab, target_params, counts


def logits(params, config, target_params, prev):
    """The drafter's logits `[B, T, Vd]` (Markov bias included) for one block after a short real prefill."""
    tokens = jnp.asarray(np.random.default_rng(1).integers(4, TARGET.vocab_size, (2, 12)))
    out = forward(target_params, TARGET, tokens, init_cache(TARGET, 2, 32), config.fusion_layer_ids)
    cache = commit(out.cache, jnp.array([12, 9]))
    hidden = jnp.concatenate(out.hidden, axis=-1)
    block = jnp.concatenate([jnp.array([[5], [9]]), jnp.full((2, config.block_size - 1), config.mask_token_id)], 1)
    return draft_block(
        params, config, target_params["embed_tokens"]["embedding"], block, cache.lengths,
        target_cache=cache, seed_hidden=seed_hidden_at(hidden, cache.lengths[:, None])[:, 0], prev_tokens=prev,
    ).logits  # fmt: skip


def test_the_same_drafter_starts_from_its_weights_and_vocabulary(trained):
    path, config, params, vocab, target_params, _ = trained
    loaded = starting_params(path, config.replace(param_dtype=jnp.float32), target_params, vocab, None)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), loaded, params))
    np.testing.assert_array_equal(starting_drafter(path, config, None)[1].d2t, vocab.d2t)


def test_a_smaller_vocabulary_keeps_the_most_frequent_tokens_and_their_logits(trained):
    path, config, params, vocab, target_params, counts = trained
    small = config.replace(draft_vocab_size=32)
    cut = cut_vocab(vocab, 32, counts, TARGET.eos_token_ids)
    ids = np.asarray(vocab.d2t)
    kept = np.asarray(cut.d2t)
    assert set(kept) <= set(ids) and EOS in kept and len(kept) == 32
    others = np.setdiff1d(ids, kept)
    assert counts[np.setdiff1d(kept, [EOS])].min() >= counts[others].max()  # the top tokens of the source's
    assert cut_vocab(vocab, vocab.size, counts, TARGET.eos_token_ids) is vocab

    layers = tuple(range(len(config.block_pattern)))  # every sub-layer: only the vocabulary shrinks
    loaded = starting_params(path, small.replace(param_dtype=jnp.float32), target_params, cut, layers)
    prev = jnp.asarray(np.random.default_rng(2).integers(4, TARGET.vocab_size, (2, config.block_size)))
    columns = np.searchsorted(ids, kept)
    full = logits(params, config, target_params, prev)
    np.testing.assert_allclose(logits(loaded, small, target_params, prev), full[..., columns], rtol=1e-5, atol=1e-5)


def test_a_drafter_of_fewer_sub_layers_starts_from_the_chosen_ones(trained):
    path, config, params, vocab, target_params, _ = trained
    sub = config.replace(block_pattern=CUT_PATTERN, attn_kv_layer_ids=(2, 4), param_dtype=jnp.float32)
    loaded = starting_params(path, sub, target_params, vocab, CUT)
    for i, j in enumerate(CUT):
        assert jax.tree.all(
            jax.tree.map(lambda a, b: bool(jnp.all(a == b)), loaded[f"layers_{i}"], params[f"layers_{j}"])
        )
    assert f"layers_{len(CUT)}" not in loaded
    for name in ("fc", "hidden_norm", "seed_projs_0", "norm", "lm_head", "markov_head", "confidence_head"):
        assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), loaded[name], params[name])), name
    prev = jnp.zeros((2, sub.block_size), jnp.int32)
    out = logits(loaded, sub, target_params, prev)
    assert out.shape == (2, sub.block_size, vocab.size) and bool(jnp.all(jnp.isfinite(out)))


def test_per_layer_seed_projections_follow_their_mamba_sub_layers(tmp_path, trained):
    _, _, _, vocab, target_params, _ = trained
    config = drafter_from_recipe(RECIPE, "hspec", TARGET).replace(seed_mode="per_layer")
    params = init_from_target(init_drafter(config, jax.random.key(3)), config, target_params, vocab)
    save_drafter(str(tmp_path / "d"), params, config, vocab)
    sub = config.replace(block_pattern=CUT_PATTERN, attn_kv_layer_ids=(2, 4), param_dtype=jnp.float32)
    loaded = starting_params(str(tmp_path / "d"), sub, target_params, vocab, CUT)
    # Sub-layers 0 and 8 are the source's first and fourth Mamba sub-layers.
    for new, old in ((0, 0), (1, 3)):
        np.testing.assert_array_equal(loaded[f"seed_projs_{new}"]["kernel"], params[f"seed_projs_{old}"]["kernel"])


@pytest.mark.parametrize(
    "changes, layers, message",
    [
        ({"markov_rank": 4}, None, r"does not match the recipe's drafter: markov_rank=16 \(recipe: 4\) \(--config"),
        ({"block_pattern": CUT_PATTERN, "attn_kv_layer_ids": (2, 4)}, None, r"block_pattern=.*init_layers cuts"),
        ({"block_pattern": CUT_PATTERN, "attn_kv_layer_ids": (2, 4)}, (0, 3, 4, 8), r"lists 4 sub-layers; .* has 6"),
        ({"block_pattern": CUT_PATTERN, "attn_kv_layer_ids": (2, 4)}, (0, 1, 4, 8, 9, 10), r"sub-layer 1 is 'attn' in"),
        ({"block_pattern": CUT_PATTERN, "attn_kv_layer_ids": (2, 4)}, (0, 3, 4, 8, 9, 9), r"names a sub-layer twice"),
        ({"block_pattern": CUT_PATTERN, "attn_kv_layer_ids": (2, 4)}, (0, 3, 4, 8, 9, 11), r"sub-layers 0\.\.10"),
        ({"block_pattern": CUT_PATTERN, "attn_kv_layer_ids": (3, 4)}, CUT, r"reads target layer 3 .* reads layer 2"),
        ({"draft_vocab_size": 80}, tuple(range(11)), r"80 tokens cannot be cut from 64"),
    ],
)
def test_a_drafter_that_cannot_start_the_run_is_named(trained, changes, layers, message):
    path, config, *_ = trained
    with pytest.raises(InputError, match=message):
        starting_drafter(path, config.replace(**changes), layers)


def test_another_kind_and_bad_layer_lists_are_errors(trained):
    path, *_ = trained
    with pytest.raises(InputError, match=r"is a drafter of kind hspec; the recipe's is of kind dflash"):
        starting_drafter(path, drafter_from_recipe(RECIPE, "dflash", TARGET), None)
    assert parse_layers("") is None and parse_layers(None) is None and parse_layers("0,3, 4") == (0, 3, 4)
    with pytest.raises(InputError, match=r"init_layers='0,x': give comma-separated sub-layer indices"):
        parse_layers("0,x")
