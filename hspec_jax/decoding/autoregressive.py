"""Plain autoregressive decoding with the target: the baseline every speedup is measured against.

`prefill` runs the prompt batch (right-padded, ragged lengths) through the target, commits each
sequence's prompt rows, and samples the first new token. `decode` then loops on device
(`lax.while_loop`), one target forward of one token per step, until every sequence has hit EOS,
`max_new_tokens`, or the end of its cache. `generate` is the two together. To stream tokens, or to stop
early, run the same loop in chunks: `start_decode`, then `decode_chunk` (a few steps, cache donated)
until every sequence is done.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from hspec_jax.decoding.batching import bucketed_shapes, pad_to_width
from hspec_jax.decoding.placement import Placement
from hspec_jax.decoding.sampling import RowSampling, SamplingConfig, sample
from hspec_jax.models.config import TargetConfig
from hspec_jax.models.decoder import forward
from hspec_jax.models.kv_cache import KVCache, check_capacity, commit, init_cache


class Prefilled(NamedTuple):
    cache: KVCache  # prompt rows committed
    token: jax.Array  # [B] first generated token


class Generation(NamedTuple):
    tokens: jax.Array  # [B, max_new_tokens] int32; `pad_id` after each sequence's end
    num_tokens: jax.Array  # [B] int32, tokens generated per sequence (EOS included)
    cache: KVCache


def is_eos(tokens: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
    """Elementwise: is the token one of `eos_ids`?"""
    if not eos_ids:
        return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, jnp.asarray(eos_ids, jnp.int32))


def prefill_unjitted(
    params: dict,
    config: TargetConfig,
    prompts: jax.Array,
    lengths: jax.Array,
    cache: KVCache,
    rng: jax.Array,
    sampling: SamplingConfig | RowSampling = SamplingConfig(),
) -> Prefilled:
    """prompts `[B, T]` right-padded with `lengths [B]` into an empty cache -> first token per sequence. `prefill`
    is its jitted form; this one is for callers that trace it inside their own jit (`sampling` may be a
    `RowSampling` there)."""
    out = forward(params, config, prompts, cache, logit_indices=(lengths - 1)[:, None])
    token = sample(rng, out.logits[:, 0], sampling)
    return Prefilled(commit(out.cache, lengths), token)


prefill = functools.partial(jax.jit, static_argnames=("config", "sampling"), donate_argnames=("cache",))(
    prefill_unjitted
)


class DecodeState(NamedTuple):
    """The decoding loop's carry, minus the cache (donated separately): what a chunked caller holds between
    chunks (`decode_chunk`), and what `decode` runs to the end in one call."""

    step: jax.Array  # int32 scalar, the next output slot
    tokens: jax.Array  # [B, max_new_tokens] output buffer, `pad_id` beyond each sequence's end
    current: jax.Array  # [B] the last emitted token, not in the cache yet
    num: jax.Array  # [B] tokens emitted
    done: jax.Array  # [B]
    rng: jax.Array


def start_decode(
    cache: KVCache, first_token: jax.Array, rng: jax.Array, *, max_new_tokens: int, eos_ids=(), pad_id: int = 0
) -> DecodeState:
    """The loop state after prefill: `first_token [B]` emitted, nothing decoded yet."""
    batch = first_token.shape[0]
    tokens = jnp.full((batch, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(first_token)
    num = jnp.ones((batch,), jnp.int32)
    done = is_eos(first_token, eos_ids) | (num >= max_new_tokens) | (cache.lengths >= cache.capacity)
    return DecodeState(jnp.int32(1), tokens, first_token, num, done, rng)


def decode_steps(
    params, config, state: DecodeState, cache: KVCache, steps: int, max_new_tokens, sampling, eos_ids, pad_id
):
    """Up to `steps` decoding steps (fewer once every sequence is done) -> (state, cache): the loop `decode_chunk`
    and `decode` jit, for callers that trace it inside their own jit (`sampling` may be a `RowSampling` there)."""
    limit = jnp.minimum(state.step + steps, max_new_tokens)

    def cond(carry):
        s, _ = carry
        return (s.step < limit) & ~jnp.all(s.done)

    def body(carry):
        s, cache = carry
        out = forward(params, config, s.current[:, None], cache)
        cache = commit(out.cache, jnp.where(s.done, 0, 1))
        nxt = sample(jax.random.fold_in(s.rng, s.step), out.logits[:, 0], sampling)
        # Each sequence writes at its own count (sequences of a served batch start at different steps).
        write_at = jnp.where(s.done, s.tokens.shape[1], s.num)  # past the end: dropped
        tokens = s.tokens.at[jnp.arange(s.num.shape[0]), write_at].set(nxt, mode="drop")
        nxt = jnp.where(s.done, pad_id, nxt)
        num = s.num + jnp.where(s.done, 0, 1)
        done = s.done | is_eos(nxt, eos_ids) | (num >= max_new_tokens) | (cache.lengths >= cache.capacity)
        return DecodeState(s.step + 1, tokens, nxt, num, done, s.rng), cache

    return jax.lax.while_loop(cond, body, (state, cache))


_LOOP_STATIC = ("config", "max_new_tokens", "sampling", "eos_ids", "pad_id")


@functools.partial(jax.jit, static_argnames=_LOOP_STATIC, donate_argnames=("cache",))
def decode_chunk(
    params: dict,
    config: TargetConfig,
    state: DecodeState,
    cache: KVCache,
    steps: int | jax.Array,
    *,
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    eos_ids: tuple[int, ...] = (),
    pad_id: int = 0,
) -> tuple[DecodeState, KVCache]:
    """At most `steps` more decoding steps (traced: one compilation serves every chunk size), for callers that
    stream tokens or stop between chunks. Chained from `start_decode` until every sequence is done, it gives
    exactly `decode`'s tokens."""
    return decode_steps(params, config, state, cache, steps, max_new_tokens, sampling, eos_ids, pad_id)


@functools.partial(jax.jit, static_argnames=_LOOP_STATIC, donate_argnames=("cache",))
def decode(
    params: dict,
    config: TargetConfig,
    cache: KVCache,
    first_token: jax.Array,
    rng: jax.Array,
    *,
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    eos_ids: tuple[int, ...] = (),
    pad_id: int = 0,
) -> Generation:
    """Continue from `first_token [B]` (already generated, not yet in the cache) on device, to the end."""
    state = start_decode(cache, first_token, rng, max_new_tokens=max_new_tokens, eos_ids=eos_ids, pad_id=pad_id)
    state, cache = decode_steps(params, config, state, cache, max_new_tokens, max_new_tokens, sampling, eos_ids, pad_id)
    return Generation(state.tokens, state.num, cache)


def generate(
    params: dict,
    config: TargetConfig,
    prompts: jax.Array,
    lengths: jax.Array,
    *,
    max_new_tokens: int,
    rng: jax.Array | None = None,
    sampling: SamplingConfig = SamplingConfig(),
    eos_ids: tuple[int, ...] = (),
    pad_id: int = 0,
    cache_capacity: int | None = None,
    mesh=None,
) -> Generation:
    """Prefill then decode. prompts `[B, W]` (right-padded), lengths `[B]` -> `Generation` with tokens
    `[B, max_new_tokens]` valid up to `num_tokens [B]`. `cache_capacity` defaults to the longest prompt plus
    `max_new_tokens`, and the prompt width is padded, both rounded up to a bucket (`batching.bucketed_shapes`) so that
    nearby prompt lengths reuse one compiled program. With a `mesh` (`hspec_jax.parallel.make_mesh`), params, batch
    and cache are sharded and the loop runs SPMD."""
    longest = int(jnp.max(lengths))
    width, capacity = bucketed_shapes(longest, prompts.shape[1], 0, max_new_tokens, cache_capacity)
    check_capacity(jax.device_get(lengths), 0, capacity)
    prompts = pad_to_width(jnp.asarray(prompts), width, pad_id)
    rng = jax.random.key(0) if rng is None else rng
    first_rng, loop_rng = jax.random.split(rng)
    place = Placement(mesh, config)
    params, (prompts, lengths) = place.params(params), place.batch(prompts, lengths)
    cache = place.kv(init_cache(config, prompts.shape[0], capacity))
    pre = prefill(params, config, prompts, lengths, cache, first_rng, sampling)
    return decode(
        params,
        config,
        pre.cache,
        pre.token,
        loop_rng,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        eos_ids=eos_ids,
        pad_id=pad_id,
    )
