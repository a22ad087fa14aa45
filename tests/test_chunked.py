"""Chunked execution gives the same results as running in one piece: the decoding loops run a few steps at a
time (for streaming and Ctrl-C), and long inputs go through the key-blocked attention."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hspec_jax.decoding import Bundle, SamplingConfig, pad_batch
from hspec_jax.decoding.autoregressive import decode_chunk, prefill, start_decode
from hspec_jax.decoding.speculative import spec_decode_chunk, spec_prefill
from hspec_jax.drafters import init_drafter, init_from_target
from hspec_jax.drafters.dflash import drafter_context
from hspec_jax.drafters.vocab import build_draft_vocab
from hspec_jax.models import init_cache, init_params
from hspec_jax.recipes import drafter_from_recipe, target_config

RECIPE = importlib.import_module("configs.tiny").get_config()
TARGET = target_config(RECIPE)
EOS = (2,)
NEW = 23


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(0)
    tokens, lengths = pad_batch([list(rng.integers(4, TARGET.vocab_size, n)) for n in (5, 11, 8)])
    return jnp.asarray(tokens), jnp.asarray(lengths)


@pytest.fixture(scope="module")
def params():
    return init_params(TARGET, jax.random.key(0))


def test_chunked_decoding_equals_one_loop(params, batch):
    """Chunks of 4 steps, chained, give the tokens of one chunk long enough for everything (the same compiled
    function: `steps` is traced); sampled, so the random keys must follow the same sequence across chunks."""
    tokens, lengths = batch
    sampling = SamplingConfig(1.0, top_k=5)
    kw = dict(max_new_tokens=NEW, sampling=sampling, eos_ids=EOS, pad_id=0)
    first, loop = jax.random.split(jax.random.key(3))

    def prefilled():
        pre = prefill(params, TARGET, tokens, lengths, init_cache(TARGET, 3, 40), first, sampling)
        return start_decode(pre.cache, pre.token, loop, max_new_tokens=NEW, eos_ids=EOS, pad_id=0), pre.cache

    whole, whole_cache = decode_chunk(params, TARGET, *prefilled(), NEW, **kw)
    assert bool(whole.done.all())
    state, cache = prefilled()
    chunks = 0
    while not bool(state.done.all()):
        state, cache = decode_chunk(params, TARGET, state, cache, 4, **kw)
        chunks += 1
    assert chunks > 1
    np.testing.assert_array_equal(state.tokens, whole.tokens)
    np.testing.assert_array_equal(state.num, whole.num)
    np.testing.assert_array_equal(cache.lengths, whole_cache.lengths)


def test_chunked_speculative_decoding_equals_one_loop(params, batch):
    """As above for draft-and-verify (H-Spec, k = 3, sampled): tokens and acceptance statistics."""
    tokens, lengths = batch
    sampling = SamplingConfig(1.0)
    drafter = drafter_from_recipe(RECIPE, "hspec", TARGET).replace(block_size=4)
    vocab = build_draft_vocab(np.asarray(tokens), TARGET.vocab_size, drafter.vocab_size, always=EOS)
    dparams = init_from_target(init_drafter(drafter, jax.random.key(1)), drafter, params, vocab)
    kw = dict(max_new_tokens=NEW, sampling=sampling, eos_ids=EOS, pad_id=0)
    bundle = Bundle(params, TARGET, dparams, drafter, vocab)

    def prefilled():
        caches = init_cache(TARGET, 3, 44), drafter_context(drafter, 3, 44)
        return spec_prefill(bundle, tokens, lengths, *caches, jax.random.key(5), **kw)

    whole = spec_decode_chunk(bundle, *prefilled(), NEW, **kw)[0]
    assert bool(whole.done.all())
    state, cache, context = prefilled()
    while not bool(state.done.all()):
        state, cache, context = spec_decode_chunk(bundle, state, cache, context, 2, **kw)
    np.testing.assert_array_equal(state.tokens, whole.tokens)
    np.testing.assert_array_equal(state.num, whole.num)
    for mine, theirs in zip(state.stats, whole.stats, strict=True):
        np.testing.assert_array_equal(mine, theirs)


def test_blocked_attention_equals_dense_attention():
    from hspec_jax.models.blocked_attention import blocked_attention
    from hspec_jax.models.layers import causal_mask, dot_product_attention

    rng = np.random.default_rng(0)
    b, t, s, n, kv, h = 2, 37, 70, 4, 2, 8
    q = jnp.asarray(rng.normal(size=(b, t, n, h)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(b, s, kv, h)), jnp.float32) for _ in range(2))
    positions = jnp.asarray([3, 30])[:, None] + jnp.arange(t)[None]  # ragged starts; rows past S never read
    window = 9  # the first visible block moves too
    dense = dot_product_attention(q, k, v, causal_mask(positions, s, window))
    blocked = blocked_attention(q, k, v, positions, positions - window + 1, block_q=8, block_k=16)
    np.testing.assert_allclose(blocked, dense, atol=2e-6)


def test_long_prompt_logits_equal_two_short_forwards(params):
    """A prompt longer than LONG_INPUT goes through the blocked attention in prompt tiles in one forward; split in
    two halves shorter than LONG_INPUT (decoding tiles, the second half reading the first from the cache) it must give
    the same logits and the same cache. Layers alternate sliding-window and full attention."""
    from hspec_jax.models import forward
    from hspec_jax.models.decoder import LONG_INPUT

    config = TARGET.replace(layer_types=("sliding_attention", "full_attention") * 3, sliding_window=48)
    half = LONG_INPUT - 10
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, TARGET.vocab_size, (2, 2 * half)), jnp.int32)
    run = jax.jit(lambda w, t, c: forward(w, config, t, c))
    whole = run(params, tokens, init_cache(config, 2, 2 * half + 8))
    first = run(params, tokens[:, :half], init_cache(config, 2, 2 * half + 8))
    second = run(params, tokens[:, half:], first.cache.replace(lengths=first.cache.lengths + half))
    split = jnp.concatenate([first.logits, second.logits], axis=1)
    np.testing.assert_allclose(whole.logits, split, atol=2e-4)
    np.testing.assert_allclose(whole.cache.k[-1], second.cache.k[-1], atol=1e-5)
