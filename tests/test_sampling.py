"""Sampling filters agree with transformers' logits processors; greedy is argmax; draws follow the distribution."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from hspec_jax.decoding import SamplingConfig, probabilities, sample
from hspec_jax.decoding.sampling import KTH_CHUNK, RowSampling, kth_largest, top_p_cutoff


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 12, 0.6)])
def test_filtered_distribution_matches_transformers(temperature, top_k, top_p):
    logits = np.random.default_rng(0).normal(size=(4, 50)).astype(np.float32) * 3
    ref = torch.tensor(logits)
    ref = TemperatureLogitsWarper(temperature)(None, ref)
    if top_k:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1.0:
        ref = TopPLogitsWarper(top_p)(None, ref)
    expected = torch.softmax(ref, -1).numpy()
    got = np.asarray(probabilities(jnp.asarray(logits), SamplingConfig(temperature, top_k, top_p)))
    np.testing.assert_allclose(got, expected, atol=1e-6)
    if top_k or top_p < 1:
        assert (got == 0).any()


@pytest.mark.parametrize(
    "shape,k,values",
    [
        ((2, 8, 49152), 50, "normal"),  # SmolLM2's vocabulary, a block of 8 positions
        ((3, 49152), 1, "normal"),
        ((4, 1003), 7, "ties"),  # not a multiple of the chunk; integer logits, many ties across chunks
        ((4, 1003), 40, "ties"),
        ((5, 300), 9, "masked"),  # -inf (already filtered) entries, fewer finite values per row than chunks
        ((2, 8 * KTH_CHUNK + 1), 8, "normal"),  # the last chunk holds one value and padding
    ],
)
def test_kth_largest_is_top_k_s_kth_value(shape, k, values):
    rng = np.random.default_rng(k)
    x = rng.normal(size=shape).astype(np.float32)
    if values == "ties":
        x = np.round(x * 2)
    if values == "masked":
        x[rng.random(shape) < 0.9] = -np.inf
    expected = np.asarray(jax.lax.top_k(jnp.asarray(x), k)[0][..., -1:])
    np.testing.assert_array_equal(np.asarray(jax.jit(kth_largest, static_argnums=1)(jnp.asarray(x), k)), expected)


def sorted_top_p_cutoff(row: np.ndarray, top_p: float) -> float:
    """The definition, by sorting (float64): the smallest kept logit, a token being kept while the mass of the
    tokens before it in descending order is below top_p."""
    ordered = np.sort(row.astype(np.float64))[::-1]
    probs = np.exp(ordered - ordered[0])
    probs /= probs.sum()
    return ordered[np.cumsum(probs) - probs < top_p].min()


@pytest.mark.parametrize(
    "shape,top_p,values",
    [
        ((8, 49152), 0.9, "normal"),
        ((6, 500), 0.3, "ties"),  # many tokens share a logit: kept or dropped together
        ((6, 500), 0.97, "masked"),  # -inf (top-k filtered) entries
        ((4, 50), 1e-4, "normal"),  # only the most likely token
        ((4, 50), 0.999, "normal"),
    ],
)
def test_top_p_cutoff_is_the_sorted_definition(shape, top_p, values):
    rng = np.random.default_rng(int(top_p * 1000))
    x = (rng.normal(size=shape) * 3).astype(np.float32)
    if values == "ties":
        x = np.round(x)
    if values == "masked":
        x[rng.random(shape) < 0.8] = -np.inf
        x[:, 0] = 0.0
    got = np.asarray(jax.jit(top_p_cutoff, static_argnums=1)(jnp.asarray(x), top_p))
    np.testing.assert_array_equal(got[:, 0], [sorted_top_p_cutoff(row, top_p) for row in x])


def test_greedy_is_one_hot_argmax():
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(3, 40)), jnp.float32)
    probs = probabilities(logits, SamplingConfig())
    np.testing.assert_array_equal(np.asarray(probs.argmax(-1)), np.asarray(logits.argmax(-1)))
    assert float(probs.sum()) == 3.0 and float(probs.max()) == 1.0
    np.testing.assert_array_equal(
        np.asarray(sample(jax.random.key(0), logits, SamplingConfig())), np.asarray(logits.argmax(-1))
    )


def test_sample_frequencies_follow_probabilities():
    logits = jnp.asarray([[2.0, 1.0, 0.0, -1.0, 0.5]])
    sampling = SamplingConfig(temperature=1.0, top_k=3)
    draws = jax.vmap(lambda k: sample(k, logits, sampling))(jax.random.split(jax.random.key(0), 20000))
    freq = np.bincount(np.asarray(draws).ravel(), minlength=5) / 20000
    np.testing.assert_allclose(freq, np.asarray(probabilities(logits, sampling))[0], atol=0.01)
    assert freq[2] == 0 and freq[3] == 0


def test_invalid_settings_are_rejected():
    for bad in (dict(temperature=-1.0), dict(top_k=-2), dict(top_p=0.0), dict(top_p=1.5)):
        with pytest.raises(ValueError):
            SamplingConfig(**bad)


def test_row_sampling_is_each_row_s_own_setting():
    """A `RowSampling` gives each row the distribution its own temperature and top-p give alone (one-hot argmax at
    temperature 0), and draws argmax for its greedy rows, whatever the other rows do; logits `[B, T, V]` too."""
    logits = jax.random.normal(jax.random.key(0), (4, 3, 50)) * 3
    settings = [(0.0, 1.0), (0.7, 1.0), (1.3, 0.6), (0.0, 0.3)]
    rows = RowSampling.of([t for t, _ in settings], [p for _, p in settings])
    probs = probabilities(logits, rows)
    for i, (t, p) in enumerate(settings):
        alone = probabilities(logits[i], SamplingConfig(temperature=t, top_p=p))
        np.testing.assert_allclose(np.asarray(probs[i]), np.asarray(alone), atol=1e-6, err_msg=f"row {i}")
    drawn = np.asarray(sample(jax.random.key(1), logits, rows))
    argmax = np.asarray(jnp.argmax(logits, -1))
    np.testing.assert_array_equal(drawn[[0, 3]], argmax[[0, 3]])
    assert RowSampling.greedy is False
    no_nucleus = RowSampling.of([0.7] * 4, [1.0] * 4)  # no row uses top-p: nothing cut
    np.testing.assert_allclose(
        np.asarray(probabilities(logits, no_nucleus)), np.asarray(jax.nn.softmax(logits / 0.7, -1)), atol=1e-6
    )
