"""Shape bucketing in the engine: nearby prompt lengths share one compiled prefill/decode program."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hspec_jax.decoding import Bundle, bucket, bucketed_shapes, generate
from hspec_jax.decoding.autoregressive import decode, prefill
from hspec_jax.decoding.speculative import spec_decode, spec_prefill, speculative_generate
from hspec_jax.drafters import init_drafter, init_from_target
from hspec_jax.drafters.vocab import build_draft_vocab
from hspec_jax.models import init_params
from hspec_jax.recipes import drafter_from_recipe, target_config

RECIPE = importlib.import_module("configs.tiny").get_config()
TARGET = target_config(RECIPE)


def test_bucket_ladder():
    assert [bucket(n) for n in (1, 16, 17, 32, 33, 100, 128, 129, 1000)] == [16, 16, 32, 32, 64, 128, 128, 256, 1024]
    assert all(n <= bucket(n) < 2 * n + 16 for n in range(1, 5000))
    assert bucketed_shapes(300, 310, 8, 64) == (512, 512)  # width and capacity share the ladder
    assert bucketed_shapes(5, 5, 0, 20, capacity=9) == (9, 9)  # a given capacity is kept and bounds the width


def compilations(*fns) -> int:
    return sum(f._cache_size() for f in fns)


@pytest.fixture(scope="module")
def target_params():
    return init_params(TARGET, jax.random.key(0))


KW = dict(max_new_tokens=30, eos_ids=(2,))


def test_prompt_lengths_5_and_6_compile_once(target_params):
    rng = np.random.default_rng(0)
    outputs, counts = [], []
    for n in (5, 6):
        prompt = jnp.asarray(rng.integers(4, TARGET.vocab_size, (1, n)), jnp.int32)
        outputs.append(generate(target_params, TARGET, prompt, jnp.array([n]), **KW))
        counts.append(compilations(prefill, decode))
    assert counts[1] == counts[0]  # the second length compiled nothing new
    assert outputs[0].tokens.shape == outputs[1].tokens.shape == (1, 30)


def test_speculative_prompt_lengths_5_and_6_compile_once(target_params):
    drafter = drafter_from_recipe(RECIPE, "hspec", TARGET)
    vocab = build_draft_vocab(np.arange(TARGET.vocab_size), TARGET.vocab_size, drafter.vocab_size)
    params = init_from_target(init_drafter(drafter, jax.random.key(1)), drafter, target_params, vocab)
    rng = np.random.default_rng(1)
    counts = []
    for n in (5, 6):
        prompt = jnp.asarray(rng.integers(4, TARGET.vocab_size, (1, n)), jnp.int32)
        speculative_generate(Bundle(target_params, TARGET, params, drafter, vocab), prompt, jnp.array([n]), **KW)
        counts.append(compilations(spec_prefill, spec_decode))
    assert counts[1] == counts[0]


def test_new_params_of_the_same_shapes_compile_nothing(target_params):
    """A `Bundle`'s configs are static and its params and vocabulary leaves: new target and drafter params of the
    same shapes (what training's real tau passes after every evaluation) reuse the compiled prefill and loop."""
    drafter = drafter_from_recipe(RECIPE, "hspec", TARGET)
    prompt, length = jnp.asarray([[5, 6, 7, 8, 9]], jnp.int32), jnp.array([5])
    counts = []
    for seed in (1, 2):
        vocab = build_draft_vocab(np.arange(seed, TARGET.vocab_size), TARGET.vocab_size, drafter.vocab_size)
        params = init_from_target(init_drafter(drafter, jax.random.key(seed)), drafter, target_params, vocab)
        target = jax.tree.map(lambda x, seed=seed: x * seed, target_params)
        speculative_generate(Bundle(target, TARGET, params, drafter, vocab), prompt, length, **KW)
        counts.append(compilations(spec_prefill, spec_decode))
    assert counts[1] == counts[0]
