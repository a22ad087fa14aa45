"""DSpark's Markov head (causal correction) and confidence head, and the sequential draft proposal.

Markov head, rank r: `bias(prev) = W2 · W1[prev]` with W1 an embedding over the *target* vocabulary
(`[V, r]`) and W2 a linear map r -> draft vocabulary. Slot i's logits are the backbone's plus the bias
of the token before it (the anchor for slot 1). In training `prev` is the ground truth (teacher forcing);
when drafting, each slot's chosen token becomes the next slot's `prev` (`propose`).

Confidence head: a linear map of [hidden ‖ W1[prev]] -> 1 logit, with no gradient into either input.
"""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from hspec_jax.decoding.sampling import SamplingConfig, probabilities, sample
from hspec_jax.drafters.vocab import DraftVocab
from hspec_jax.models.layers import INIT_STD, dense


def markov_embed(params: dict, prev: jax.Array) -> jax.Array:
    """prev target ids `[...]` -> `[..., r]` (rows of W1 `[V, r]`)."""
    return params["markov_w1"][prev]


def markov_bias(params: dict, embedded: jax.Array) -> jax.Array:
    """`[..., r]` -> draft-vocabulary logit bias `[..., Vd]` (fp32), through W2 `[r, Vd]`."""
    w2 = params["markov_w2"]
    return jnp.einsum("...r,rv->...v", embedded.astype(w2.dtype), w2, preferred_element_type=jnp.float32)


class MarkovHead(nn.Module):
    target_vocab_size: int
    draft_vocab_size: int
    rank: int
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, prev: jax.Array) -> tuple[jax.Array, jax.Array]:
        """prev `[...]` -> (embedding `[..., r]`, bias `[..., Vd]`)."""
        init = nn.initializers.normal(INIT_STD)
        params = {
            "markov_w1": self.param("markov_w1", init, (self.target_vocab_size, self.rank), self.param_dtype),
            "markov_w2": self.param("markov_w2", init, (self.rank, self.draft_vocab_size), self.param_dtype),
        }
        embedded = markov_embed(params, prev)
        return embedded, markov_bias(params, embedded)


class ConfidenceHead(nn.Module):
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, hidden: jax.Array, markov_embedding: jax.Array) -> jax.Array:
        """hidden `[..., D]`, markov_embedding `[..., r]` -> logit `[...]` (fp32); inputs are not trained through."""
        x = jnp.concatenate([jax.lax.stop_gradient(hidden), jax.lax.stop_gradient(markov_embedding)], axis=-1)
        proj = dense(1, "proj", bias=True, dtype=jnp.float32, param_dtype=self.param_dtype)
        return proj(x.astype(jnp.float32))[..., 0]


def confidence_logit(params: dict, hidden: jax.Array, markov_embedding: jax.Array) -> jax.Array:
    """`ConfidenceHead` applied with its params `{"proj": {"kernel", "bias"}}` (drafting, outside the module)."""
    return ConfidenceHead().apply({"params": params}, hidden, markov_embedding)


class Proposal(NamedTuple):
    tokens: jax.Array  # [B, k] drafted target-vocabulary ids
    draft_ids: jax.Array  # [B, k] the same tokens as draft-vocabulary ids
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
        return Proposal(vocab.d2t[draft_ids], draft_ids, probs, top_probability(base_logits))

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
        return token, (token, draft_id, probabilities(logits_i, sampling), conf)

    keys = jax.random.split(rng, k)
    hidden = jnp.zeros((*base_logits.shape[:2], 0), base_logits.dtype) if hidden is None else hidden
    move = lambda x: jnp.moveaxis(x, 0, 1)
    xs = (move(base_logits), move(hidden), keys)
    _, (tokens, draft_ids, probs, conf) = jax.lax.scan(step, anchor, xs)
    return Proposal(move(tokens), move(draft_ids), move(probs), move(conf))
