"""Autoregressive decoding: prefill/decode consistency, ragged batches, in-place cache, stops, sampling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from peaked import peaked

from hspec_jax.decoding import SamplingConfig, generate, pad_batch
from hspec_jax.decoding.autoregressive import decode, prefill
from hspec_jax.models import TargetConfig, commit, init_cache, init_params
from hspec_jax.models import forward as eager_forward

TINY = TargetConfig(
    model_type="qwen3",
    vocab_size=96,
    hidden_size=64,
    intermediate_size=80,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    qk_norm=True,
)


# The target forward as the engine runs it (jitted; one program per input shape): op-by-op it is several times slower.
forward = jax.jit(eager_forward, static_argnums=1)


@pytest.fixture(scope="module")
def tiny():
    """A tiny random target with peaked (large-norm) weights so greedy choices are far from ties."""
    params = init_params(TINY, jax.random.key(1))
    params = peaked(params, 6.0)
    return TINY, params


def test_prefill_then_decode_equals_one_forward(tiny):
    """A 12-token prefill, a 4-token block and four single tokens, each reading the cache the previous one
    committed, give the logits of one forward over all 20 tokens."""
    config, params = tiny
    tokens = jax.random.randint(jax.random.key(2), (2, 20), 0, config.vocab_size)
    full = forward(params, config, tokens, init_cache(config, 2, 32)).logits
    cache = init_cache(config, 2, 32)
    out = forward(params, config, tokens[:, :12], cache)
    cache = commit(out.cache, jnp.full((2,), 12))
    pieces = [out.logits]
    block = forward(params, config, tokens[:, 12:16], cache)  # a 4-token block (verification-style)
    pieces.append(block.logits)
    cache = commit(block.cache, jnp.full((2,), 4))
    for t in range(16, 20):  # then single tokens
        step = forward(params, config, tokens[:, t : t + 1], cache)
        pieces.append(step.logits)
        cache = commit(step.cache, jnp.ones((2,), jnp.int32))
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), np.asarray(full), atol=1e-5, rtol=0)


def test_uncommitted_rows_are_invisible_and_overwritten(tiny):
    """Rows written but not committed (a rejected draft) must not affect later steps."""
    config, params = tiny
    tokens = jax.random.randint(jax.random.key(3), (1, 10), 0, config.vocab_size)
    cache = commit(forward(params, config, tokens[:, :6], init_cache(config, 1, 16)).cache, jnp.array([6]))
    garbage = forward(params, config, jnp.array([[5, 9, 13, 77]]), cache).cache  # written, not committed
    clean = forward(params, config, tokens[:, 6:], cache).logits
    dirty = forward(params, config, tokens[:, 6:], garbage).logits
    np.testing.assert_allclose(np.asarray(dirty), np.asarray(clean), atol=1e-6, rtol=0)


def test_ragged_batch_equals_each_sequence_alone(tiny):
    config, params = tiny
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, 96, n)) for n in (5, 11, 8)]
    tokens, lengths = pad_batch(prompts, pad_id=0)
    batch = generate(params, config, jnp.asarray(tokens), jnp.asarray(lengths), max_new_tokens=12)
    for i, prompt in enumerate(prompts):
        alone = generate(params, config, jnp.asarray([prompt]), jnp.asarray([len(prompt)]), max_new_tokens=12)
        np.testing.assert_array_equal(np.asarray(batch.tokens[i]), np.asarray(alone.tokens[0]))
    assert len({tuple(np.asarray(r)) for r in batch.tokens}) == 3


def test_decode_step_updates_cache_in_place():
    """The cache is donated: its buffers alias the output and no full copy appears in temporaries."""
    config = TINY.replace(num_layers=6)
    params = init_params(config, jax.random.key(0))
    cache = init_cache(config, 2, 8192)
    step = jax.jit(lambda p, t, c: commit(forward(p, config, t, c).cache, jnp.ones(2, jnp.int32)), donate_argnums=2)
    stats = step.lower(params, jnp.zeros((2, 1), jnp.int32), cache).compile().memory_analysis()
    cache_bytes = sum(x.nbytes for x in jax.tree.leaves((cache.k, cache.v)))
    assert stats.alias_size_in_bytes >= cache_bytes
    assert stats.temp_size_in_bytes < cache_bytes / 4
    first = prefill(params, config, jnp.ones((2, 4), jnp.int32), jnp.array([4, 2]), cache, jax.random.key(0))
    assert all(x.is_deleted() for x in jax.tree.leaves(cache.k))  # prefill consumed (donated) the buffers
    out = decode(params, config, first.cache, first.token, jax.random.key(1), max_new_tokens=5)
    assert all(x.is_deleted() for x in jax.tree.leaves(first.cache.k))
    np.testing.assert_array_equal(np.asarray(out.cache.lengths), [4 + 4, 2 + 4])


def test_eos_stops_and_pads(tiny):
    config, params = tiny
    prompt = jnp.asarray([[7, 8, 9, 10]])
    free = generate(params, config, prompt, jnp.array([4]), max_new_tokens=10)
    stop_token = int(free.tokens[0, 3])
    first_hit = int(np.argmax(np.asarray(free.tokens[0]) == stop_token))
    out = generate(params, config, prompt, jnp.array([4]), max_new_tokens=10, eos_ids=(stop_token,), pad_id=-1)
    assert int(out.num_tokens[0]) == first_hit + 1
    np.testing.assert_array_equal(
        np.asarray(out.tokens[0, : first_hit + 1]), np.asarray(free.tokens[0, : first_hit + 1])
    )
    assert np.all(np.asarray(out.tokens[0, first_hit + 1 :]) == -1)


def test_stops_at_cache_capacity(tiny):
    config, params = tiny
    out = generate(params, config, jnp.asarray([[1, 2, 3, 4, 5]]), jnp.array([5]), max_new_tokens=20, cache_capacity=9)
    # 4 free rows: tokens 1..4 are fed back into the cache, and the 5th is sampled from the last row.
    assert int(out.num_tokens[0]) == 5 and int(out.cache.lengths[0]) == 9


def test_prompt_longer_than_cache_is_a_clear_error(tiny):
    config, params = tiny
    with pytest.raises(ValueError, match="does not fit in a KV cache of 8 rows"):
        generate(params, config, jnp.ones((1, 12), jnp.int32), jnp.array([12]), max_new_tokens=4, cache_capacity=8)


def test_sampling_is_seeded(tiny):
    config, params = tiny
    prompt, lengths = jnp.asarray([[3, 4, 5, 6]]), jnp.array([4])
    sampling = SamplingConfig(temperature=1.0, top_k=20, top_p=0.95)
    runs = [
        generate(params, config, prompt, lengths, max_new_tokens=16, sampling=sampling, rng=jax.random.key(s)).tokens
        for s in (0, 0, 1)
    ]
    np.testing.assert_array_equal(np.asarray(runs[0]), np.asarray(runs[1]))
    assert not np.array_equal(np.asarray(runs[0]), np.asarray(runs[2]))
