"""DSpark's Markov head (causal correction) and confidence head.

Markov head, rank r: `bias(prev) = W2 · W1[prev]` with W1 an embedding over the *target* vocabulary
(`[V, r]`) and W2 a linear map r -> draft vocabulary. Slot i's logits are the backbone's plus the bias
of the token before it (the anchor for slot 1). In training `prev` is the ground truth (teacher forcing);
when drafting, each slot's chosen token becomes the next slot's `prev` (`hspec_jax.decoding.proposal.propose`).

Confidence head: a linear map of [hidden ‖ W1[prev]] -> 1 logit, with no gradient into either input.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

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
