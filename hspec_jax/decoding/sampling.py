"""Token sampling: greedy, temperature, top-k and top-p, as one distribution shared by target and drafter.

`SamplingConfig` is frozen and hashable (a static argument under jit). `probabilities` is the single
place that turns logits into the distribution tokens are drawn from, so speculative decoding applies
exactly the same processing to the target's p and the drafter's q.

`RowSampling` holds one temperature and one top-p per sequence as arrays (traced, so one compiled program serves
every mix of requests, as a server needs); the loops' un-jitted bodies take it wherever they take a
`SamplingConfig`. A row at temperature 0 is greedy: its distribution is one-hot on the argmax, so its tokens are
exactly greedy decoding's, under draft-and-verify too (a one-hot p accepts a draft iff it is the argmax, and the
residual after a rejection is the argmax).
"""

from __future__ import annotations

import dataclasses

import flax.struct
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


@flax.struct.dataclass
class RowSampling:
    """Per-sequence sampling settings: temperature `[B]` (0: that row is greedy) and top_p `[B]` (1.0: off); no
    top-k. `greedy` is False: the loops compute full distributions (one-hot for the greedy rows)."""

    temperature: jax.Array
    top_p: jax.Array

    greedy = False  # a class constant, not a field: the loops branch on it statically

    @staticmethod
    def of(temperature, top_p) -> RowSampling:
        """From per-row values (lists or arrays), as fp32."""
        return RowSampling(jnp.asarray(temperature, jnp.float32), jnp.asarray(top_p, jnp.float32))


def _per_row(x: jax.Array, like: jax.Array) -> jax.Array:
    """Row values `[B]` shaped `[B, 1, ...]` to broadcast against `like [B, ...]`."""
    return x.reshape(x.shape + (1,) * (like.ndim - 1))


def kth_largest(x: jax.Array, k: int) -> jax.Array:
    """The k-th largest value `[..., 1]` of `x [..., V]`, exactly what `lax.top_k(x, k)[0][..., -1:]` gives, at a
    fraction of its cost for a large V (XLA's CPU TopK: 56.5 ms for 8 x 49,152 logits at k = 50; this, 0.91 ms;
    `benchmarks/results/sampling_filters.md`).
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


def ordered_keys(x: jax.Array) -> jax.Array:
    """uint32 keys of fp32 values in the same order (-inf lowest): the sign bit flipped, negatives' bits inverted."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def top_p_cutoff(logits: jax.Array, top_p: float) -> jax.Array:
    """The smallest logit `[..., 1]` that top-p keeps from `logits [..., V]`: the smallest value u such that the
    tokens above u hold less than `top_p` of the probability (so the most likely token is always kept, and tied
    tokens together). Found by bisection on the values' 32-bit ordered keys, each step one masked sum over V:
    32 sums instead of sorting V (8 x 49,152 logits: 6.3 ms against 65.4 ms for the sort alone, the same cutoffs)."""
    probs = jax.nn.softmax(logits, axis=-1)
    keys = ordered_keys(logits)

    def halve(_, bounds):  # invariant: mass above lo >= top_p > mass above hi
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        below = jnp.sum(jnp.where(keys > mid, probs, 0.0), axis=-1, keepdims=True) < top_p
        return jnp.where(below, lo, mid), jnp.where(below, mid, hi)

    shape = (*logits.shape[:-1], 1)
    bounds = (jnp.zeros(shape, jnp.uint32), jnp.full(shape, 0xFFFFFFFF, jnp.uint32))
    _, hi = jax.lax.fori_loop(0, 32, halve, bounds)
    return jnp.min(jnp.where(keys >= hi, logits, jnp.inf), axis=-1, keepdims=True)


def _row_filtered_logits(logits: jax.Array, rows: RowSampling) -> jax.Array:
    """`filtered_logits` with a temperature and a top-p per row (greedy rows divided by 1: their draw is replaced
    by the argmax); the top-p bisection runs only when some row uses top-p, and changes only those rows."""
    temperature = _per_row(rows.temperature, logits)
    logits = logits.astype(jnp.float32) / jnp.where(temperature > 0, temperature, 1.0)
    top_p = _per_row(rows.top_p, logits)

    def nucleus(x):
        return jnp.where((top_p < 1.0) & (x < top_p_cutoff(x, top_p)), NEG_INF, x)

    return jax.lax.cond(jnp.any(rows.top_p < 1.0), nucleus, lambda x: x, logits)


def filtered_logits(logits: jax.Array, sampling: SamplingConfig | RowSampling) -> jax.Array:
    """`[..., V]` fp32 logits / temperature, with tokens outside top-k / top-p set to -inf."""
    if isinstance(sampling, RowSampling):
        return _row_filtered_logits(logits, sampling)
    logits = logits.astype(jnp.float32) / sampling.temperature
    if sampling.top_k:
        logits = jnp.where(logits < kth_largest(logits, sampling.top_k), NEG_INF, logits)
    if sampling.top_p < 1.0:
        logits = jnp.where(logits < top_p_cutoff(logits, sampling.top_p), NEG_INF, logits)
    return logits


def probabilities(logits: jax.Array, sampling: SamplingConfig | RowSampling) -> jax.Array:
    """The distribution `[..., V]` (fp32) that `sample` draws from; one-hot argmax when greedy (per row for a
    `RowSampling`: logits `[B, ..., V]`)."""
    one_hot = lambda: jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    if sampling.greedy:
        return one_hot()
    probs = jax.nn.softmax(filtered_logits(logits, sampling), axis=-1)
    if isinstance(sampling, RowSampling):
        probs = jnp.where(_per_row(sampling.temperature == 0, logits), one_hot(), probs)
    return probs


def sample(rng: jax.Array, logits: jax.Array, sampling: SamplingConfig | RowSampling) -> jax.Array:
    """Draw token ids `[...]` (int32) from `logits [..., V]` (`[B, ..., V]` for a `RowSampling`)."""
    argmax = lambda: jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if sampling.greedy:
        return argmax()
    drawn = jax.random.categorical(rng, filtered_logits(logits, sampling), axis=-1).astype(jnp.int32)
    if isinstance(sampling, RowSampling):
        drawn = jnp.where(_per_row(sampling.temperature == 0, drawn), argmax(), drawn)
    return drawn
