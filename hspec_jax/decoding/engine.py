"""Ahead-of-time compiled generation, streamed in chunks: plain decoding or draft-and-verify behind one `Engine`.

`compile_autoregressive` / `compile_speculative` lower and compile prefill and a decoding chunk once for a batch
shape, with the caches donated between chunks; `generate_streaming` runs one generation `chunk` steps at a time
(the command line `eval.generate` streams text this way, `eval.main` times every method through it).

This is one of three drivers of the same jitted loop (`spec_prefill`, `spec_decode_chunk` of `speculative.py`),
kept apart because each schedules it differently: this one compiles ahead of time for one batch shape, so timing
never includes compilation and text streams with Ctrl-C between chunks; `speculative.speculative_generate` is one
call jit-compiled and cached per bucketed shape (the library entry point, and training's real tau, which calls it
again with new drafter params and reuses the program, where an engine compiled here would be rebuilt);
`hspec_jax.serving.ServingEngine` batches continuously (slots joined and left between steps, a paged pool).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hspec_jax.decoding.autoregressive import decode_chunk, prefill, start_decode
from hspec_jax.decoding.bundle import Bundle, init_caches
from hspec_jax.decoding.costs import engine_shape
from hspec_jax.decoding.placement import Placement
from hspec_jax.decoding.policy import AdaptivePolicy, first_prior
from hspec_jax.decoding.speculative import SpecStats, measure_costs, spec_decode_chunk, spec_prefill
from hspec_jax.models import init_cache

# Decoding steps per streamed chunk: the overhead against one uninterrupted loop is measured in
# benchmarks/results/streaming.md (python -m benchmarks.streaming).
DEFAULT_CHUNK = 8


def stop_ids(config, tokenizer) -> tuple[int, ...]:
    """The ids that end a generation: the target config's EOS ids and the tokenizer's EOS, sorted."""
    ids = set(config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))


class Result(NamedTuple):
    tokens: np.ndarray  # [B, max_new_tokens]
    num_tokens: np.ndarray  # [B]
    prefill_seconds: float
    decode_seconds: float
    stats: SpecStats | None  # with a drafter
    interrupted: bool

    @property
    def seconds(self) -> float:
        """Prefill plus decoding."""
        return self.prefill_seconds + self.decode_seconds


class Engine(NamedTuple):
    """Ahead-of-time compiled generation: `start(prompts=None, seed=None)` -> state after prefill (of the compiled
    prompts and seed, or of new `(tokens, lengths)` of the same shape and a new seed); `step(state, steps)` ->
    state after at most `steps` (an int32 array) more decoding steps; `view(state)` -> (tokens
    [B, max_new_tokens], num [B], done [B], stats or None) on the host. One compilation serves every chunk size.
    `costs`: the adaptive policy's cost table T(k) / T(0) (numpy), None without one. `finish(state)`, called with
    a generation's last state, lets the engine keep what it learnt for its next `start` (the policy's prior)."""

    start: Callable
    step: Callable
    view: Callable
    costs: np.ndarray | None = None
    finish: Callable = lambda state: None


def generate_streaming(
    engine: Engine,
    chunk: int,
    on_chunk: Callable | None = None,
    stop: Callable[[], bool] = lambda: False,
    prompts: tuple | None = None,
    seed: int | None = None,
) -> Result:
    """One generation, `chunk` decoding steps at a time: `on_chunk(tokens, num)` after prefill and after every
    chunk; stops early (`interrupted`) when `stop()` turns true between chunks. `prompts` / `seed`: see `Engine`."""
    steps = jnp.int32(chunk)
    begin = time.perf_counter()
    state = jax.block_until_ready(engine.start(prompts, seed))
    prefill_end = time.perf_counter()
    tokens, num, done, stats = engine.view(state)
    while True:
        if on_chunk is not None:
            on_chunk(tokens, num)
        if done.all() or stop():
            break
        state = engine.step(state, steps)
        tokens, num, done, stats = engine.view(state)  # waits for the chunk
    end = time.perf_counter()
    engine.finish(state)
    return Result(tokens, num, prefill_end - begin, end - prefill_end, stats, not done.all())


def compile_beside(prefill: jax.stages.Lowered, lower_chunk: Callable[[], jax.stages.Lowered]) -> tuple:
    """(prefill, chunk) compiled: `prefill` in a background thread while `lower_chunk()` lowers the decoding chunk
    and it compiles here (on 2 CPU cores, one answer with the shipped drafter from an empty cache took 27.5 s as a
    whole process instead of 30.2 s: CHANGELOG, 2026-12-06)."""
    with ThreadPoolExecutor(1) as background:
        prefill_c = background.submit(prefill.compile)
        chunk_c = lower_chunk().compile()
        return prefill_c.result(), chunk_c


def compile_autoregressive(
    params, config, tokens, lengths, capacity, *, max_new_tokens, sampling, eos_ids, pad_id, seed, mesh=None
) -> Engine:
    """Compile prefill and a decoding chunk ahead of time; each `start()` uses a fresh cache."""
    first_rng, loop_rng = jax.random.split(jax.random.key(seed))
    place = Placement(mesh, config)
    params, (tokens, lengths) = place.params(params), place.batch(tokens, lengths)

    def fresh_cache():
        return place.kv(init_cache(config, tokens.shape[0], capacity))

    loop = dict(max_new_tokens=max_new_tokens, eos_ids=eos_ids, pad_id=pad_id)

    def lower_chunk():
        pre = jax.eval_shape(lambda: prefill(params, config, tokens, lengths, fresh_cache(), first_rng, sampling))
        state = jax.eval_shape(functools.partial(start_decode, **loop), pre.cache, pre.token, loop_rng)
        return decode_chunk.lower(params, config, state, pre.cache, jnp.int32(1), sampling=sampling, **loop)

    pre_c, step_c = compile_beside(
        prefill.lower(params, config, tokens, lengths, fresh_cache(), first_rng, sampling), lower_chunk
    )

    def start(prompts=None, seed=None):
        prompts = (tokens, lengths) if prompts is None else place.batch(*prompts)
        first, then = (first_rng, loop_rng) if seed is None else jax.random.split(jax.random.key(seed))
        out = pre_c(params, *prompts, jax.block_until_ready(fresh_cache()), first)
        return start_decode(out.cache, out.token, then, **loop), out.cache

    def view(carry):
        return (*jax.device_get((carry[0].tokens, carry[0].num, carry[0].done)), None)

    return Engine(start, lambda carry, steps: step_c(params, *carry, steps), view)


def compile_speculative(
    bundle: Bundle,
    tokens,
    lengths,
    capacity,
    *,
    max_new_tokens,
    sampling,
    eos_ids,
    pad_id,
    seed,
    mesh=None,
    policy: AdaptivePolicy | None = None,
    costs: np.ndarray | None = None,
) -> Engine:
    """As `compile_autoregressive`, for draft-and-verify with `bundle`'s drafter; `view` also returns the
    `SpecStats`. With an adaptive `policy`, its step costs `[C]` are `costs` if given, else read from the cache or
    measured here for this machine and shape (`costs.py`), and each generation starts from the prior the last
    finished one learnt (`policy.py`; the first from the policy's own)."""
    rng = jax.random.key(seed)
    place = Placement(mesh, bundle.target)
    bundle = place.bundle(bundle)
    tokens, lengths = place.batch(tokens, lengths)

    def fresh_caches():
        return place.kv(init_caches(bundle, tokens.shape[0], capacity))

    kw = dict(max_new_tokens=max_new_tokens, sampling=sampling, eos_ids=eos_ids, pad_id=pad_id, policy=policy)
    table = None if policy is None else jnp.ones(len(policy.choices), jnp.float32)  # a stand-in while compiling
    learnt = {"prior": None if policy is None else first_prior(policy)}

    def lower_chunk():
        carry = jax.eval_shape(
            lambda: spec_prefill(bundle, tokens, lengths, *fresh_caches(), rng, table, learnt["prior"], **kw)
        )
        return spec_decode_chunk.lower(bundle, *carry, jnp.int32(1), **kw)

    pre_c, step_c = compile_beside(
        spec_prefill.lower(bundle, tokens, lengths, *fresh_caches(), rng, table, learnt["prior"], **kw), lower_chunk
    )
    run_steps = lambda carry, steps: step_c(bundle, *carry, jnp.int32(steps))

    def prefill_with(step_costs, prompts=(tokens, lengths), key=rng):
        caches = jax.block_until_ready(fresh_caches())
        return pre_c(bundle, *prompts, *caches, key, step_costs, learnt["prior"])

    if policy is not None and costs is not None:
        costs = jnp.asarray(costs, jnp.float32)
    elif policy is not None:
        shape = engine_shape(
            bundle.target,
            bundle.drafter,
            sampling,
            tokens.shape[0],
            capacity,
            (bundle.target_params, bundle.drafter_params),
        )
        costs = measure_costs(prefill_with, run_steps, policy, shape)

    def start(prompts=None, seed=None):
        prompts = (tokens, lengths) if prompts is None else place.batch(*prompts)
        key = rng if seed is None else jax.random.key(seed)
        return prefill_with(costs, prompts, key)

    def view(carry):
        s = carry[0]
        tokens, num, done, stats = jax.device_get((s.tokens[:, :max_new_tokens], s.num, s.done, s.stats))
        return tokens, num, done, SpecStats(*stats)

    if policy is None:
        return Engine(start, run_steps, view)

    def finish(carry):
        learnt["prior"] = carry[0].policy.prior

    return Engine(start, run_steps, view, np.asarray(costs), finish)


def format_chosen(choices: tuple[int, ...], stats: SpecStats) -> str:
    """Share of steps at each draft length, e.g. `k=0:0.81,1:0.12,2:0.07,4:0.00,7:0.00`."""
    counts = np.asarray(stats.chosen).sum(0)
    shares = counts / max(int(counts.sum()), 1)
    return "k=" + ",".join(f"{c}:{x:.2f}" for c, x in zip(choices, shares, strict=True))
