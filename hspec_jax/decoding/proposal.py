"""The draft proposal: k draft tokens (and the distributions they were drawn from) chosen from a drafter's logits,
slot by slot through the Markov head where the drafter has one (`hspec_jax.drafters.heads`), with the same sampling
rule the target's tokens follow (`sampling.py`)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from hspec_jax.decoding.sampling import SamplingConfig, probabilities, sample
from hspec_jax.drafters.heads import confidence_logit, markov_bias, markov_embed
from hspec_jax.drafters.vocab import DraftVocab


class Proposal(NamedTuple):
    tokens: jax.Array  # [B, k] drafted target-vocabulary ids
    probs: jax.Array  # [B, k, Vd] the distribution each token was drawn from (one-hot when greedy)
    confidence: jax.Array  # [B, k] predicted acceptance of each slot given the earlier ones, in [0, 1]


def top_probability(logits: jax.Array) -> jax.Array:
    """`[..., Vd]` -> `[...]` the largest probability of softmax(logits): the acceptance prediction of a drafter
    without a confidence head."""
    return jnp.max(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), axis=-1)


def propose(
    base_logits: jax.Array,
    anchor: jax.Array,
    vocab: DraftVocab,
    sampling: SamplingConfig,
    rng: jax.Array,
    markov_params: dict | None = None,
    hidden: jax.Array | None = None,
    confidence_params: dict | None = None,
) -> Proposal:
    """Choose k draft tokens from the backbone's logits `[B, k, Vd]` (slots 1..k) and the anchor `[B]`.

    Without a Markov head the k choices are independent (one parallel draw). With one, slot i adds the
    bias of the token chosen at slot i-1 (the anchor for i = 1) before drawing: k small sequential steps.
    With `confidence_params` (and the drafter's final hidden states `[B, k, D]` at slots 1..k) the confidence is
    sigmoid of the confidence head on slot i's hidden state and its Markov embedding (as in training); otherwise
    the top probability of slot i's distribution.
    """
    k = base_logits.shape[1]
    if markov_params is None:
        draft_ids = sample(rng, base_logits, sampling)
        probs = probabilities(base_logits, sampling)
        return Proposal(vocab.d2t[draft_ids], probs, top_probability(base_logits))

    def step(prev, inputs):
        logits_i, hidden_i, key = inputs
        embedded = markov_embed(markov_params, prev)
        logits_i = logits_i + markov_bias(markov_params, embedded)
        draft_id = sample(key, logits_i, sampling)
        token = vocab.d2t[draft_id]
        if confidence_params is None:
            conf = top_probability(logits_i)
        else:
            conf = jax.nn.sigmoid(confidence_logit(confidence_params, hidden_i, embedded))
        return token, (token, probabilities(logits_i, sampling), conf)

    keys = jax.random.split(rng, k)
    hidden = jnp.zeros((*base_logits.shape[:2], 0), base_logits.dtype) if hidden is None else hidden
    move = lambda x: jnp.moveaxis(x, 0, 1)
    xs = (move(base_logits), move(hidden), keys)
    _, (tokens, probs, conf) = jax.lax.scan(step, anchor, xs)
    return Proposal(move(tokens), move(probs), move(conf))
