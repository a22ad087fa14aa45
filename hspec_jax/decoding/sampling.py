"""Token sampling: greedy, temperature, top-k and top-p, as one distribution shared by target and drafter.

`SamplingConfig` is frozen and hashable (a static argument under jit). `probabilities` is the single
place that turns logits into the distribution tokens are drawn from, so speculative decoding applies
exactly the same processing to the target's p and the drafter's q.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

NEG_INF = -jnp.inf
# Values per chunk in `kth_largest`'s first pass (fastest of 16-256 on SmolLM2's 49,152 logits at k = 3 and 50).
KTH_CHUNK = 16


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """temperature 0 = greedy (argmax); top_k 0 = off; top_p 1.0 = off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def kth_largest(x: jax.Array, k: int) -> jax.Array:
    """The k-th largest value `[..., 1]` of `x [..., V]`, exactly what `lax.top_k(x, k)[0][..., -1:]` gives, at a
    fraction of its cost for a large V (XLA's CPU TopK: 68 ms for 8 x 49,152 logits at k = 50; this, 1.4 ms).
    Every value among the k largest lies in a chunk whose maximum is among the k largest chunk maxima (ties
    included), so top-k runs on V / KTH_CHUNK maxima, then on the k best chunks' k * KTH_CHUNK values."""
    v = x.shape[-1]
    n = -(-v // KTH_CHUNK)
    if n <= k:
        return jax.lax.top_k(x, k)[0][..., -1:]
    padded = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, n * KTH_CHUNK - v)], constant_values=NEG_INF)
    chunks = padded.reshape(*x.shape[:-1], n, KTH_CHUNK)
    best = jax.lax.top_k(chunks.max(-1), k)[1]
    candidates = jnp.take_along_axis(chunks, best[..., None], axis=-2).reshape(*x.shape[:-1], k * KTH_CHUNK)
    return jax.lax.top_k(candidates, k)[0][..., -1:]


def filtered_logits(logits: jax.Array, sampling: SamplingConfig) -> jax.Array:
    """`[..., V]` fp32 logits / temperature, with tokens outside top-k / top-p set to -inf."""
    logits = logits.astype(jnp.float32) / sampling.temperature
    if sampling.top_k:
        logits = jnp.where(logits < kth_largest(logits, sampling.top_k), NEG_INF, logits)
    if sampling.top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
        sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
        # The smallest logit still kept: the last token whose preceding mass is below top_p.
        keep = mass_before < sampling.top_p
        cutoff = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, NEG_INF, logits)
    return logits


def probabilities(logits: jax.Array, sampling: SamplingConfig) -> jax.Array:
    """The distribution `[..., V]` (fp32) that `sample` draws from; one-hot argmax when greedy."""
    if sampling.greedy:
        return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    return jax.nn.softmax(filtered_logits(logits, sampling), axis=-1)


def sample(rng: jax.Array, logits: jax.Array, sampling: SamplingConfig) -> jax.Array:
    """Draw token ids `[...]` (int32) from `logits [..., V]`."""
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(rng, filtered_logits(logits, sampling), axis=-1).astype(jnp.int32)
