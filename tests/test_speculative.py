"""The draft-and-verify engine is lossless: greedy outputs equal the target's own greedy decoding for every
drafter, and sampled outputs follow the target's distribution (min(1, p/q) acceptance + residual resampling)."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from peaked import peaked
from scipy import stats as scipy_stats

from hspec_jax.decoding import Bundle, SamplingConfig, generate, pad_batch, probabilities
from hspec_jax.decoding.acceptance import greedy_accept, speculative_accept
from hspec_jax.decoding.speculative import speculative_generate
from hspec_jax.drafters import DRAFTER_KINDS, full_vocab, init_drafter, init_from_target
from hspec_jax.drafters.vocab import build_draft_vocab
from hspec_jax.models import forward, init_cache, init_params
from hspec_jax.models.layers import rms_norm
from hspec_jax.recipes import drafter_from_recipe, target_config

RECIPE = importlib.import_module("configs.tiny").get_config()
TARGET = target_config(RECIPE)
EOS = 2


@pytest.fixture(scope="module")
def target_params():
    params = init_params(TARGET, jax.random.key(0))
    return peaked(params, 4.0)  # peaked: greedy far from ties


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [list(rng.integers(4, TARGET.vocab_size, n)) for n in (5, 11, 8)]


def random_drafter(kind, target_params, vocab_tokens, seed=1):
    config = drafter_from_recipe(RECIPE, kind, TARGET)
    vocab = build_draft_vocab(vocab_tokens, TARGET.vocab_size, config.vocab_size, always=(EOS,))
    params = init_from_target(init_drafter(config, jax.random.key(seed)), config, target_params, vocab)
    return config, params, vocab


@pytest.mark.parametrize("kind", DRAFTER_KINDS)
def test_greedy_is_lossless_for_every_drafter(kind, target_params, prompts):
    """A ragged batch of three decodes to the target's own greedy tokens (and counts) with each drafter kind, and
    the same prompts in another order give the same rows."""
    tokens, lengths = pad_batch(prompts)
    config, params, vocab = random_drafter(kind, target_params, np.concatenate(prompts))
    ar = generate(target_params, TARGET, jnp.asarray(tokens), jnp.asarray(lengths), max_new_tokens=30, eos_ids=(EOS,))
    spec = speculative_generate(
        Bundle(target_params, TARGET, params, config, vocab),
        jnp.asarray(tokens),
        jnp.asarray(lengths),
        max_new_tokens=30,
        eos_ids=(EOS,),
    )
    np.testing.assert_array_equal(np.asarray(spec.num_tokens), np.asarray(ar.num_tokens))
    np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(ar.tokens))
    # Each row's output does not depend on its place or its neighbours: the batch rotated (the same shapes, so the
    # same compiled program) gives the same rows.
    order = [1, 2, 0]
    tokens, lengths = pad_batch([prompts[i] for i in order])
    rotated = speculative_generate(
        Bundle(target_params, TARGET, params, config, vocab),
        jnp.asarray(tokens),
        jnp.asarray(lengths),
        max_new_tokens=30,
        eos_ids=(EOS,),
    )
    np.testing.assert_array_equal(np.asarray(rotated.tokens), np.asarray(ar.tokens)[order])


# --- an "oracle" drafter: a near-bigram target and a drafter whose Markov head reproduces its logits ----------


def assert_follows(tokens, joint: dict) -> tuple[np.ndarray, np.ndarray]:
    """Assert that the sampled rows `tokens [n, L]` follow the exact `joint` distribution (outcome -> probability):
    no row outside its support and a chi-square p-value above 1e-3. Returns (observed, expected) counts."""
    n = len(tokens)
    samples = [tuple(row) for row in tokens]
    outcomes = sorted(joint)
    observed = np.array([samples.count(o) for o in outcomes])
    assert observed.sum() == n  # nothing outside the target's support
    expected = np.array([joint[o] for o in outcomes])
    expected = expected / expected.sum() * n  # the fp32 probabilities sum to 1 only up to rounding
    keep = expected >= 5  # chi-square validity; pool the rare outcomes
    obs = np.append(observed[keep], observed[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    obs, exp = (obs, exp) if exp[-1] > 0 else (obs[:-1], exp[:-1])
    assert scipy_stats.chisquare(obs, exp).pvalue > 1e-3
    return observed, expected


def bigram_target(target_params, attention_scale):
    """Shrink every layer's contribution: the target becomes (almost, or with scale 0 exactly) a bigram model."""
    params = jax.tree.map(lambda x: x, target_params)
    layers = params["layers"]  # every layer at once: stacked on the leading axis
    layers["self_attn"]["o_proj"]["kernel"] = layers["self_attn"]["o_proj"]["kernel"] * attention_scale
    layers["mlp"]["down_proj"]["kernel"] = layers["mlp"]["down_proj"]["kernel"] * attention_scale
    return params


def oracle_drafter(kind, target_params, noise=0.0):
    """Zero backbone logits + a rank-D Markov head equal to the bigram logits: the drafter proposes what a pure
    bigram target would. `noise` perturbs the Markov head so that some drafts get rejected."""
    config = drafter_from_recipe(RECIPE, kind, TARGET).replace(markov_rank=TARGET.hidden_size, draft_vocab_size=None)
    vocab = full_vocab(TARGET.vocab_size)
    params = init_from_target(init_drafter(config, jax.random.key(3)), config, target_params, vocab)
    params["lm_head"] = jnp.zeros_like(params["lm_head"])
    embed = target_params["embed_tokens"]["embedding"]
    w1 = rms_norm(embed, target_params["norm"]["scale"], TARGET.rms_norm_eps)
    w2 = target_params["lm_head"].T
    w2 = w2 + noise * jax.random.normal(jax.random.key(4), w2.shape) * jnp.std(w2)
    params["markov_head"] = {"markov_w1": w1, "markov_w2": w2}
    return config, params, vocab


@pytest.mark.parametrize("kind", ["hspec", "dspark"])
def test_greedy_lossless_with_a_drafter_that_is_usually_right(kind, target_params, prompts):
    """Long accepted runs, EOS inside a block, and max_new_tokens mid-block, all equal to plain decoding (one run:
    the first sequence stops at an EOS it emits mid-stream, the others at max_new_tokens)."""
    target = bigram_target(target_params, 0.01)
    config, params, vocab = oracle_drafter(kind, target)
    tokens, lengths = pad_batch(prompts)
    free = generate(target, TARGET, jnp.asarray(tokens), jnp.asarray(lengths), max_new_tokens=40)
    eos = int(np.asarray(free.tokens)[0, 17])  # a token the first sequence emits mid-stream
    max_new, eos_ids = 23, (eos,)
    ar = generate(target, TARGET, jnp.asarray(tokens), jnp.asarray(lengths), max_new_tokens=max_new, eos_ids=eos_ids)
    spec = speculative_generate(
        Bundle(target, TARGET, params, config, vocab),
        jnp.asarray(tokens),
        jnp.asarray(lengths),
        max_new_tokens=max_new,
        eos_ids=eos_ids,
    )
    np.testing.assert_array_equal(np.asarray(spec.num_tokens), np.asarray(ar.num_tokens))
    np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(ar.tokens))
    assert spec.stats.tau() > 3.0  # many drafts accepted per step: the multi-token path is exercised
    assert int(spec.num_tokens[0]) < max_new  # the first sequence stopped at its EOS
    assert max_new in np.asarray(spec.num_tokens)  # another ran to the limit


def test_stats_count_acceptance(target_params, prompts):
    target = bigram_target(target_params, 0.0)  # an exact bigram model: the oracle is always right
    config, params, vocab = oracle_drafter("hspec", target)
    tokens, lengths = pad_batch(prompts)
    spec = speculative_generate(
        Bundle(target, TARGET, params, config, vocab), jnp.asarray(tokens), jnp.asarray(lengths), max_new_tokens=33
    )
    # 1 token from prefill, then 4 steps of 8 accepted tokens each.
    np.testing.assert_array_equal(np.asarray(spec.stats.steps), [4, 4, 4])
    # Blocks drafted: prefill's, then one after each step but the last.
    np.testing.assert_array_equal(np.asarray(spec.stats.drafted), [4, 4, 4])
    assert spec.stats.tau() == 8.0 and spec.stats.acceptance_by_position() == [1.0] * 7


# --- sampling: the output distribution is the target's ----------------------------------------------------------


def exact_joint(target, prompt, sampling, length, rows=16):
    """P(x_1..x_length) of the target alone under `sampling`, by enumerating every prefix in its support. The
    prefixes of one length go through the target together, in batches of `rows` right-padded to one width (causal
    attention: the padding is never read), so one compiled forward serves every level."""
    width = len(prompt) + length - 1

    @jax.jit
    def next_probs(params, seqs, last):
        logits = forward(params, TARGET, seqs, init_cache(TARGET, rows, width)).logits
        return probabilities(logits[jnp.arange(rows), last], sampling)

    joint = {(): 1.0}
    for level in range(length):
        nxt, prefixes = {}, list(joint)
        for start in range(0, len(prefixes), rows):
            chunk = prefixes[start : start + rows]
            seqs = np.zeros((rows, width), np.int32)
            for i, prefix in enumerate(chunk):
                seqs[i, : len(prompt) + level] = list(prompt) + list(prefix)
            probs = np.asarray(next_probs(target, jnp.asarray(seqs), jnp.int32(len(prompt) + level - 1)), np.float64)
            for prefix, row in zip(chunk, probs, strict=False):
                for tok in np.flatnonzero(row > 0):
                    nxt[(*prefix, int(tok))] = joint[prefix] * row[tok]
        joint = nxt
    return joint


@pytest.mark.parametrize(
    "layer_scale,noise,expect_tau",
    [
        (0.0, 0.0, (7.9, 8.0)),  # q == p exactly: min(1, p/q) accepts everything (greedy-match would not)
        (0.03, 0.5, (1.5, 3.5)),  # q != p: accepts, rejections and residual draws
    ],
)
def test_sampled_outputs_follow_the_target_distribution(layer_scale, noise, expect_tau, target_params):
    target = bigram_target(target_params, layer_scale)
    config, params, vocab = oracle_drafter("hspec", target, noise=noise)
    sampling = SamplingConfig(temperature=1.0, top_k=3)
    prompt, n, length = [7, 19, 33, 41, 5], 6000, 3
    spec = speculative_generate(
        Bundle(target, TARGET, params, config, vocab),
        jnp.asarray([prompt] * n),
        jnp.asarray([len(prompt)] * n),
        max_new_tokens=length,
        sampling=sampling,
        rng=jax.random.key(11),
    )
    observed, expected = assert_follows(np.asarray(spec.tokens), exact_joint(target, prompt, sampling, length))
    tv = 0.5 * np.abs(observed / n - expected / n).sum()
    assert tv < 0.05
    # Acceptance statistics of the steps that verified a full block (max_new_tokens=3 stops after one step).
    long_run = speculative_generate(
        Bundle(target, TARGET, params, config, vocab),
        jnp.asarray([prompt] * 64),
        jnp.asarray([len(prompt)] * 64),
        max_new_tokens=60,
        sampling=sampling,
        rng=jax.random.key(12),
    )
    assert expect_tau[0] <= long_run.stats.tau() <= expect_tau[1]


def test_acceptance_rule_is_min_p_over_q_not_greedy_match():
    """With q == p every draft is accepted (a greedy-match rule would accept only sum p^2 of the time); with
    q != p the first draft is accepted with probability sum min(p, q) and the first token is distributed as p."""
    v, k, n = 5, 3, 40000
    p1 = jnp.array([0.4, 0.3, 0.2, 0.1, 0.0])
    q1 = jnp.array([0.1, 0.1, 0.2, 0.3, 0.3])
    keys = jax.random.split(jax.random.key(0), 3)
    p = jnp.broadcast_to(p1, (n, k + 1, v))
    same = jax.random.categorical(keys[0], jnp.log(p[:, :k]))
    accepted, _ = speculative_accept(keys[1], same, p[:, :k], p)
    assert bool(jnp.all(accepted == k))
    q = jnp.broadcast_to(q1, (n, k, v))
    draft = jax.random.categorical(keys[2], jnp.log(q))
    accepted, nxt = speculative_accept(jax.random.key(5), draft, q, p)
    first = jnp.where(accepted > 0, draft[:, 0], nxt)
    np.testing.assert_allclose(float(jnp.mean(accepted > 0)), float(jnp.minimum(p1, q1).sum()), atol=0.01)
    freq = np.bincount(np.asarray(first), minlength=v) / n
    np.testing.assert_allclose(freq, np.asarray(p1), atol=0.01)


def test_greedy_accept_counts_the_matching_prefix():
    logits = jax.nn.one_hot(jnp.array([[3, 1, 4, 1], [2, 7, 1, 8]]), 10)
    n, nxt = greedy_accept(jnp.array([[3, 1, 5], [9, 7, 1]]), logits)
    np.testing.assert_array_equal(np.asarray(n), [2, 0])
    np.testing.assert_array_equal(np.asarray(nxt), [4, 2])


def test_clear_errors(target_params, prompts):
    config, params, vocab = random_drafter("hspec", target_params, np.concatenate(prompts))
    with pytest.raises(ValueError, match="does not fit in a KV cache of 16 rows"):
        speculative_generate(
            Bundle(target_params, TARGET, params, config, vocab),
            jnp.ones((1, 10), jnp.int32),
            jnp.array([10]),
            max_new_tokens=8,
            cache_capacity=16,
        )
    other = TARGET.replace(num_kv_heads=4)
    with pytest.raises(ValueError, match="num_kv_heads: drafter expects 2, target has 4"):
        speculative_generate(
            Bundle(init_params(other, jax.random.key(0)), other, params, config, vocab),
            jnp.ones((1, 4), jnp.int32),
            jnp.array([4]),
            max_new_tokens=4,
        )


@pytest.fixture(scope="module")
def smollm2_reference(smollm2, smollm2_tokenizer):
    """Three chat prompts as a ragged batch and the target's own greedy outputs for it (each row equals its prompt
    decoded alone: tests/test_decoding.py, on a tiny target)."""
    from hspec_jax.chat import chat_prompt_ids

    target, target_params = smollm2
    texts = ["Name three planets.", "Write one sentence about cats.", "What is 7 times 6?"]
    prompts = [chat_prompt_ids(smollm2_tokenizer, t) for t in texts]
    kw = dict(max_new_tokens=24, eos_ids=target.eos_token_ids, pad_id=target.pad_token_id)
    tokens, lengths = (jnp.asarray(x) for x in pad_batch(prompts, target.pad_token_id))
    ar = generate(target_params, target, tokens, lengths, **kw)
    assert "7 times 6" in smollm2_tokenizer.decode(np.asarray(ar.tokens[2][: ar.num_tokens[2]]))
    return prompts, kw, (tokens, lengths, ar)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["hspec"])  # every kind: on tiny targets above; the shipped H-Spec: tests/test_cli.py
def test_greedy_lossless_on_smollm2(kind, smollm2, smollm2_reference):
    """On the real target, a ragged batch of three chat prompts decodes to its own greedy tokens. (Batch 1 on
    SmolLM2 runs the same code: it is checked by tests/test_cli.py, and on tiny targets above.)"""
    from hspec_jax.recipes import load_config

    target, target_params = smollm2
    prompts, kw, (tokens, lengths, ar) = smollm2_reference
    config = drafter_from_recipe(load_config("configs/smollm2.py"), kind, target)
    vocab = build_draft_vocab(
        np.concatenate(prompts), target.vocab_size, config.vocab_size, always=target.eos_token_ids
    )
    params = init_from_target(init_drafter(config, jax.random.key(0)), config, target_params, vocab)
    spec = speculative_generate(Bundle(target_params, target, params, config, vocab), tokens, lengths, **kw)
    np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(ar.tokens))
    np.testing.assert_array_equal(np.asarray(spec.num_tokens), np.asarray(ar.num_tokens))
