"""Continuous batching over the paged KV pool: requests queue, a fixed number of slots decode together, and
prompts are prefilled between decoding steps.

    engine = ServingEngine(Bundle(target_params, target, drafter_params, drafter, vocab), ServingConfig(...))
    refused = engine.submit(Request("r1", prompt_ids))      # None, or a refused Completion (with the reason)
    while engine.busy:
        for completion in engine.step(): ...

One `step` is one scheduling iteration:

1. admit queued requests (first come, first served) into free slots while the pool has pages for their prompts;
2. feed every admitted slot that has not started decoding one chunk of its prompt (`prefill_chunk` tokens, so a
   long prompt takes several iterations, interleaved with the others' decoding); the last chunk samples the first
   token (and drafts the first block) and the slot starts decoding;
3. give every decoding slot pages for the rows the next `steps_per_iteration` steps can write; when the pool runs
   out, preempt the most recently admitted request: its pages are freed and it goes back to the front of the
   queue, to restart from its prompt later (recompute);
4. run `steps_per_iteration` decoding steps for all slots at once: plain decoding or draft-and-verify with any
   drafter, the very loops of `hspec_jax.decoding` on the paged cache, jitted with static shapes `[slots, ...]`
   (idle slots ride along as finished sequences); with `ServingConfig.policy` the draft length is chosen per step
   (`hspec_jax/decoding/policy.py`: the batch verifies the largest k any running request chose, k = 0 a plain
   step), from the cost table given to the engine; a request starts from the acceptance estimates the requests
   that finished before it ended with (the policy's prior, kept in the loop state), not from scratch;
5. hand back the finished requests and free their slots and pages at once.

`cancel(request_id)` takes a request out between two iterations, queued or running: its slot and pages are free
for the next one (a server cancels so a request whose client went away, or that reached its own token limit or
stop string). With `on_tokens`, each request's tokens are handed over as they become available: its first at the
end of its prefill, the others after each iteration's decoding steps (one read of the output buffer per iteration);
a preempted request starts again from its prompt, and its tokens are handed over again from the first.

With `ServingConfig.per_request_sampling` each request samples at its own temperature and top-p (`Request`), every
mix of them in one compiled program (`hspec_jax.decoding.sampling.RowSampling`); a request at temperature 0 gets
exactly its greedy answer, next to others that sample.

A request that can never be served (an empty prompt, a prompt over `max_prompt_tokens`, more pages than the whole
pool) is refused when submitted, with the reason in its `Completion`: never a crash, never a truncated answer. A
preempted request keeps its submission time; its first token and token times are those of the run that completes.
Every slot's state lives on the device; the host keeps the page allocator and the per-request bookkeeping.

The fixed-batch drivers (`speculative_generate`, `hspec_jax.decoding.engine.compile_speculative`) run the same loop
on one batch from prefill to its end; this engine stays separate because requests enter and leave slots between
steps, prefill is chunked between decoding steps, and the caches are paged.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hspec_jax.decoding.autoregressive import decode_steps, prefill_unjitted, start_decode
from hspec_jax.decoding.batching import bucket, pad_batch
from hspec_jax.decoding.bundle import Bundle, init_caches
from hspec_jax.decoding.placement import Placement
from hspec_jax.decoding.policy import AdaptivePolicy, first_prior
from hspec_jax.decoding.sampling import RowSampling, SamplingConfig
from hspec_jax.decoding.speculative import SpecStats, adaptive_costs, spec_prefill_unjitted, spec_steps
from hspec_jax.drafters.config import check_target
from hspec_jax.models.kv_cache import KVBuffers
from hspec_jax.serving.allocator import PageAllocator, pages_for
from hspec_jax.serving.paged import PagedBuffers, paged_cache, paged_context

LAYOUTS = ("paged", "dense")


@dataclasses.dataclass(frozen=True)
class ServingConfig:
    """Static engine settings: the shapes every jitted step is compiled for, and the decoding rule."""

    slots: int  # sequences decoded together (the batch of every decoding step)
    num_pages: int | None = None  # pages in the pool, the null page included; None: every slot at its longest
    page_size: int = 16  # rows per page
    max_prompt_tokens: int = 512  # longer prompts are refused; with the new tokens, sets the pages per sequence
    max_new_tokens: int = 64
    prefill_chunk: int = 64  # prompt tokens per prefill call
    steps_per_iteration: int = 4  # decoding steps between two scheduling decisions
    sampling: SamplingConfig = SamplingConfig()
    eos_ids: tuple[int, ...] = ()
    pad_id: int = 0
    seed: int = 0
    layout: str = "paged"  # "paged": the shared pool; "dense": one contiguous cache row per slot (no gather)
    policy: AdaptivePolicy | None = None  # adaptive draft length (with a drafter); None: the drafter's k every step
    # True: each request brings its own temperature and top-p (`Request`; `sampling` is the default of those that do
    # not), one compiled program for every mix (`RowSampling`); False: every request samples with `sampling`.
    per_request_sampling: bool = False

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        for name in ("slots", "page_size", "max_prompt_tokens", "max_new_tokens", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.steps_per_iteration < 1:
            raise ValueError(f"steps_per_iteration must be >= 1, got {self.steps_per_iteration}")
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (the null page and one more), got {self.num_pages}")
        if self.per_request_sampling and self.sampling.top_k:
            raise ValueError("per-request sampling has a temperature and a top-p per request, no top-k")


class Request(NamedTuple):
    id: str
    prompt: tuple[int, ...]  # token ids
    seed: int = 0  # sampling seed of its prefill
    temperature: float | None = None  # None: the engine's `ServingConfig.sampling`; other values need
    top_p: float | None = None  # `ServingConfig.per_request_sampling`


@dataclasses.dataclass
class Completion:
    request: Request
    tokens: np.ndarray  # generated ids, EOS included; empty when refused
    submitted: float  # clock times (seconds)
    first_token: float | None
    finished: float
    bursts: list[tuple[float, int]]  # (clock time, tokens that became available then), from the first token on
    steps: int = 0  # draft-and-verify steps (0 for plain decoding)
    accepted: int = 0  # drafted tokens accepted
    preemptions: int = 0
    refused: str | None = None  # why the request was not served
    cancelled: bool = False  # taken out by `cancel`: `tokens` are those generated until then
    stats: SpecStats | None = None  # draft-and-verify: the request's own statistics (one row)


@dataclasses.dataclass
class _Slot:
    request: Request
    submitted: float
    order: int  # admission counter: preemption takes the largest
    preemptions: int
    fed: int = 0  # prompt tokens prefilled
    emitted: int = 0  # tokens generated so far (0 until the prompt is prefilled)
    first_token: float | None = None
    bursts: list = dataclasses.field(default_factory=list)

    @property
    def decoding(self) -> bool:
        return self.emitted > 0


# Loop settings are static (and the bundle's configs, its tree metadata); the slots' state and caches are donated.
_STATIC = ("sampling", "max_new_tokens", "eos_ids", "pad_id", "policy")
_serve_jit = functools.partial(jax.jit, static_argnames=_STATIC, donate_argnames=("state", "cache", "context"))
# Loop-state fields of the whole batch (the policy's cost table too); every other field has one row per slot.
_SHARED_FIELDS = ("step", "rng", "choice")
_SHARED_POLICY_FIELDS = ("costs", "prior")


def _per_slot(state) -> dict:
    """The loop state's per-slot leaves by field (the adaptive policy's estimates without its cost table)."""
    rows = {f: getattr(state, f) for f in state._fields if f not in _SHARED_FIELDS and f != "policy"}
    policy = getattr(state, "policy", None)
    if policy is not None:
        rows["policy"] = {f: getattr(policy, f) for f in policy._fields if f not in _SHARED_POLICY_FIELDS}
    return rows


def _with_per_slot(state, rows: dict):
    """`state` with its per-slot leaves replaced by `rows` (as `_per_slot` gives them)."""
    rows = dict(rows)
    if "policy" in rows:
        rows["policy"] = state.policy._replace(**rows["policy"])
    return state._replace(**rows)


def _slot_of(context, slot):
    return context.slot(slot) if _has_rows(context) else context


def _has_rows(context) -> bool:
    """Whether a drafter-side cache is there (DFlash/DSpark), paged or dense; () stands for none."""
    return isinstance(context, PagedBuffers | KVBuffers)


def _start_one(bundle: Bundle, cache, context, tokens, length, rng, costs, prior, **kw):
    """Prefill `tokens [1, C]` (the first `length [1]` real) into a one-sequence cache at its committed length ->
    (that sequence's decoding state as if it started now, cache, context): `prefill` + `start_decode`, or
    `spec_prefill` (`costs`, `prior`: the adaptive policy's cost table and the prior the engine learnt so far,
    None without one)."""
    if bundle.drafter is None:
        first_rng, loop_rng = jax.random.split(rng)
        pre = prefill_unjitted(bundle.target_params, bundle.target, tokens, length, cache, first_rng, kw["sampling"])
        loop = {name: kw[name] for name in ("max_new_tokens", "eos_ids", "pad_id")}
        return start_decode(pre.cache, pre.token, loop_rng, **loop), pre.cache, context
    return spec_prefill_unjitted(bundle, tokens, length, cache, context, rng, costs, prior, **kw)


@_serve_jit
def prefill_slot(
    bundle: Bundle,
    state,
    cache,
    context,
    slot,
    tokens,
    length,
    final,
    rng,
    rows,
    *,
    max_new_tokens,
    sampling,
    eos_ids,
    pad_id,
    policy,
):
    """One chunk `tokens [1, C]` (the first `length [1]` real) of slot `slot`'s prompt, written at its committed
    length and committed. On the `final` chunk the slot's row of the loop state becomes that of a sequence that
    just started (first token sampled, first block drafted); before it, the row is left as it is (finished).
    `rows`: every slot's `RowSampling` (per-request sampling), or None (`sampling` for all)."""
    if rows is not None:
        sampling = jax.tree.map(lambda x: x[slot][None], rows)
    kw = dict(max_new_tokens=max_new_tokens, sampling=sampling, eos_ids=eos_ids, pad_id=pad_id, policy=policy)
    costs, prior = (None, None) if policy is None else (state.policy.costs, state.policy.prior)
    view_cache, view_context = cache.slot(slot), _slot_of(context, slot)
    one, view, view_context = _start_one(bundle, view_cache, view_context, tokens, length, rng, costs, prior, **kw)
    cache = cache.with_slot(slot, view)
    if _has_rows(context):
        context = context.with_slot(slot, view_context)

    def put(rows, row):
        return rows.at[slot].set(jnp.where(final, row[0], rows[slot]))

    return _with_per_slot(state, jax.tree.map(put, _per_slot(state), _per_slot(one))), cache, context


@_serve_jit
def decode_slots(
    bundle: Bundle,
    state,
    cache,
    context,
    steps,
    rng,
    rows,
    *,
    max_new_tokens,
    sampling,
    eos_ids,
    pad_id,
    policy,
):
    """Up to `steps` decoding steps of every slot (the loops of `decode_chunk` or `spec_decode_chunk`, counted from
    0), sampling each slot with its row of `rows` (a `RowSampling`), or all with `sampling` (`rows` None)."""
    sampling = sampling if rows is None else rows
    loop = (max_new_tokens, sampling, eos_ids, pad_id)
    if bundle.drafter is None:
        state = state._replace(step=jnp.int32(0), rng=rng)
        state, cache = decode_steps(bundle.target_params, bundle.target, state, cache, steps, *loop)
        return state, cache, context
    state = state._replace(step=jnp.int32(0))
    return spec_steps(bundle, state, cache, context, steps, *loop, policy)


def engine_costs(
    bundle: Bundle, policy: AdaptivePolicy, slots: int, prompt: list[int], max_new_tokens: int, sampling, seed: int = 0
) -> np.ndarray:
    """The adaptive policy's cost table for an engine of `slots` slots: cached per machine and shape, or measured on
    the contiguous-cache loop at that batch, every sequence answering `prompt`."""
    tokens, lengths = pad_batch([prompt] * slots, 0, bucket(len(prompt)))
    capacity = bucket(tokens.shape[1] + max_new_tokens + bundle.lookahead)
    return adaptive_costs(
        bundle,
        tokens,
        lengths,
        lambda: init_caches(bundle, slots, capacity),
        capacity,
        jax.random.key(seed),
        policy=policy,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
    )


class ServingEngine:
    """See the module docstring: serves `bundle` (its target alone, or with its drafter). `clock` gives the times in
    `Completion`s (seconds). With `config.policy`, `costs` is its cost table T(k) / T(0) per choice
    (`hspec_jax/decoding/costs.py`). `on_tokens(request, tokens)`, if given, receives each request's new token ids
    (int32 numpy) as they become available, in order, from inside `step`."""

    def __init__(
        self,
        bundle: Bundle,
        config: ServingConfig,
        clock=time.perf_counter,
        costs=None,
        on_tokens: Callable[[Request, np.ndarray], None] | None = None,
    ):
        if bundle.drafter is not None:
            check_target(bundle.drafter, bundle.target)
        if config.policy is not None and (bundle.drafter is None or costs is None):
            raise ValueError("an adaptive draft length needs a drafter and a cost table (costs)")
        # Params as the backend runs them best, as every decoding driver places them (fused projections on CPU; one
        # tree per layer where the decoder does not scan: on slices of the stacked tree a per-layer step reads copies
        # of every layer's weights).
        bundle = Placement(None, bundle.target).bundle(bundle)
        self.bundle, self.config, self.clock = bundle, config, clock
        self.costs, self.on_tokens = costs, on_tokens
        c = config
        self.max_pages = pages_for(c.max_prompt_tokens + c.max_new_tokens + bundle.lookahead, c.page_size)
        num_pages = c.num_pages or c.slots * self.max_pages + 1
        if c.layout == "dense" and num_pages != c.slots * self.max_pages + 1:
            raise ValueError(
                f"the dense layout holds every slot at its longest ({c.slots * self.max_pages + 1} pages); "
                f"leave num_pages unset, got {num_pages}"
            )
        self.allocator = PageAllocator(num_pages, c.slots, self.max_pages, c.page_size)
        if c.layout == "dense":
            self.cache, self.context = init_caches(bundle, c.slots, self.max_pages * c.page_size)
        else:
            self.cache = paged_cache(bundle.target, c.slots, num_pages, c.page_size, self.max_pages)
            self.context = paged_context(bundle.drafter, self.cache)
        self._kw = dict(
            max_new_tokens=c.max_new_tokens, sampling=c.sampling, eos_ids=c.eos_ids, pad_id=c.pad_id, policy=c.policy
        )
        # Per-request sampling: each slot's temperature and top-p (host copy; the device copy follows on change).
        self.temperature = np.full(c.slots, c.sampling.temperature, np.float32)
        self.top_p = np.full(c.slots, c.sampling.top_p, np.float32)
        self.rows = RowSampling.of(self.temperature, self.top_p) if c.per_request_sampling else None
        self.state = self._empty_state()
        self.queue: collections.deque[tuple[Request, float, int]] = collections.deque()
        self.slots: list[_Slot | None] = [None] * c.slots
        self.lengths = np.zeros(c.slots, np.int64)  # committed rows per slot, as of the last device read
        self.occupancy: list[int] = []  # pages in use at the end of each iteration
        self.preemptions = 0
        self.iterations = 0
        self._admitted = 0
        self._table_dirty = False

    # ------------------------------------------------------------------ public

    @property
    def busy(self) -> bool:
        """Whether requests are queued or running."""
        return bool(self.queue) or any(s is not None for s in self.slots)

    @property
    def running(self) -> int:
        return sum(s is not None for s in self.slots)

    def request_pages(self, prompt_tokens: int) -> int:
        """Pages a request needs at its longest: prompt, new tokens and one verified block."""
        rows = prompt_tokens + self.config.max_new_tokens + self.bundle.lookahead
        return pages_for(rows, self.config.page_size)

    def refusal(self, request: Request) -> str | None:
        """Why `request` can never be served by this engine (None if it can)."""
        n = len(request.prompt)
        if n == 0:
            return "empty prompt"
        if n > self.config.max_prompt_tokens:
            return f"prompt of {n} tokens exceeds the serving limit of {self.config.max_prompt_tokens}"
        if max(request.prompt) >= self.bundle.target.vocab_size or min(request.prompt) < 0:
            return f"token ids outside the model's vocabulary of {self.bundle.target.vocab_size}"
        sampling = self.config.sampling
        if request.temperature is not None and not 0 <= request.temperature < float("inf"):
            return f"temperature must be a finite number >= 0, got {request.temperature}"
        if request.top_p is not None and not 0 < request.top_p <= 1:
            return f"top_p must be in (0, 1], got {request.top_p}"
        own = (self._temperature(request), self._top_p(request)) != (sampling.temperature, sampling.top_p)
        if own and not self.config.per_request_sampling:
            return (
                f"this engine samples every request at temperature {sampling.temperature}, top_p {sampling.top_p} "
                "(ServingConfig.per_request_sampling is off)"
            )
        pages = self.request_pages(n)
        if pages > self.allocator.usable:
            return f"needs {pages} KV pages, more than the pool's {self.allocator.usable}"
        return None

    def submit(self, request: Request) -> Completion | None:
        """Queue `request`; a request that can never be served is refused at once (returned, with the reason)."""
        now = self.clock()
        reason = self.refusal(request)
        if reason is not None:
            return Completion(request, np.zeros(0, np.int32), now, None, now, [], refused=reason)
        self.queue.append((request, now, 0))
        return None

    def step(self) -> list[Completion]:
        """One scheduling iteration (module docstring) -> the requests that finished in it."""
        self._admit()
        self._prefill()
        decoding = self._reserve()
        self._sync_table()
        if decoding:
            rng = jax.random.fold_in(jax.random.key(self.config.seed), self.iterations)
            steps = jnp.int32(self.config.steps_per_iteration)
            self.state, self.cache, self.context = decode_slots(
                self.bundle, self.state, self.cache, self.context, steps, rng, self._device_rows(), **self._kw
            )
        finished = self._collect()
        self.iterations += 1
        self.occupancy.append(self.allocator.used)
        return finished

    def cancel(self, request_id: str) -> Completion | None:
        """Take request `request_id` out, queued or running (call it between iterations): a running request's slot
        and pages are free for the next iteration -> its `Completion` (`cancelled`, with the tokens generated so
        far), None when no queued or running request has that id (it finished, or never came)."""
        for i, (request, submitted, preemptions) in enumerate(self.queue):
            if request.id == request_id:
                del self.queue[i]
                empty = np.zeros(0, np.int32)
                return Completion(request, empty, submitted, None, self.clock(), [], 0, 0, preemptions, cancelled=True)
        for slot, s in enumerate(self.slots):
            if s is not None and s.request.id == request_id:
                completion = self._completion(slot, s, self.clock())
                completion.cancelled = True
                self._free(slot)
                return completion
        return None

    def reset_counters(self) -> None:
        """Forget the occupancy samples, preemptions and iterations so far (after a warm-up run, when idle)."""
        if self.busy:
            raise RuntimeError("reset_counters needs an idle engine")
        self.occupancy, self.preemptions, self.iterations = [], 0, 0

    # ------------------------------------------------------------------ the iteration's parts

    def _empty_state(self):
        """The loop state with every slot finished (idle), shaped like `_start_one`'s output for `slots` rows."""
        c = self.config
        tokens, length = jnp.zeros((1, c.prefill_chunk), jnp.int32), jnp.ones((1,), jnp.int32)
        view, view_context = self.cache.slot(jnp.int32(0)), _slot_of(self.context, jnp.int32(0))
        costs = None if self.costs is None else jnp.asarray(self.costs, jnp.float32)
        prior = None if c.policy is None else first_prior(c.policy)
        key = jax.random.key(0)
        one = jax.eval_shape(
            lambda: _start_one(
                self.bundle, view, view_context, tokens, length, key, costs, prior, **self._kw_one_row()
            )[0]
        )
        rows = jax.tree.map(lambda x: jnp.zeros((c.slots, *x.shape[1:]), x.dtype), _per_slot(one))
        rows["done"] = jnp.ones((c.slots,), bool)
        rows["tokens"] = jnp.full(rows["tokens"].shape, c.pad_id, jnp.int32)
        shared = {"step": jnp.int32(0), "rng": jax.random.key(c.seed)}
        if "choice" in one._fields:  # draft-and-verify: a fixed k's only choice, or the policy's plain step
            shared["choice"] = jnp.int32(0)
        if self.config.policy is not None:
            shared["policy"] = one.policy._replace(costs=costs, prior=prior)
        return _with_per_slot(one._replace(**shared), rows)

    def _admit(self) -> None:
        """Queued requests into free slots, in order, while the pool has pages for their prompts."""
        for slot in range(self.config.slots):
            if not self.queue:
                return
            if self.slots[slot] is not None:
                continue
            request, submitted, preemptions = self.queue[0]
            if not self.allocator.grow(slot, len(request.prompt)):
                return  # wait for pages: finishing requests free them
            self.queue.popleft()
            self.slots[slot] = _Slot(request, submitted, self._admitted, preemptions)
            self._admitted += 1
            self.lengths[slot] = 0
            self._table_dirty = True
            if self.config.per_request_sampling:
                self.temperature[slot], self.top_p[slot] = self._temperature(request), self._top_p(request)
                self.rows = None  # copied to the device again (`_device_rows`)

    def _temperature(self, request: Request) -> float:
        return self.config.sampling.temperature if request.temperature is None else request.temperature

    def _top_p(self, request: Request) -> float:
        return self.config.sampling.top_p if request.top_p is None else request.top_p

    def _device_rows(self) -> RowSampling | None:
        """Every slot's sampling settings on the device (per-request sampling), None otherwise."""
        if not self.config.per_request_sampling:
            return None
        if self.rows is None:
            self.rows = RowSampling.of(self.temperature, self.top_p)
        return self.rows

    def _kw_one_row(self) -> dict:
        """The loop settings of one sequence started alone (`_start_one`): one row of `RowSampling` if per request."""
        if not self.config.per_request_sampling:
            return self._kw
        return self._kw | {"sampling": RowSampling.of(self.temperature[:1], self.top_p[:1])}

    def _prefill(self) -> None:
        """One prompt chunk for every admitted slot that has not started decoding."""
        c = self.config
        self._sync_table()
        started = []
        for slot, s in self._by_admission():
            if s.decoding:
                continue
            chunk = s.request.prompt[s.fed : s.fed + c.prefill_chunk]
            tokens = np.full((1, c.prefill_chunk), c.pad_id, np.int32)
            tokens[0, : len(chunk)] = chunk
            final = s.fed + len(chunk) == len(s.request.prompt)
            self.state, self.cache, self.context = prefill_slot(
                self.bundle,
                self.state,
                self.cache,
                self.context,
                jnp.int32(slot),
                tokens,
                np.asarray([len(chunk)], np.int32),
                jnp.asarray(final),
                jax.random.key(s.request.seed),
                self._device_rows(),
                **self._kw,
            )
            s.fed += len(chunk)
            self.lengths[slot] = s.fed
            if final:
                started.append((slot, s))
        if started:
            jax.block_until_ready(self.state.num)
            now = self.clock()
            first = self._read_tokens()
            for slot, s in started:
                s.emitted, s.first_token = 1, now
                s.bursts.append((now, 1))
                if first is not None:
                    self.on_tokens(s.request, first[slot, :1])

    def _reserve(self) -> bool:
        """Pages for the rows the next decoding steps may write, oldest requests first, preempting the youngest
        when the pool runs out -> whether any slot is decoding."""
        rows_ahead = self.config.steps_per_iteration * self.bundle.rows_per_step
        decoding = False
        for slot, s in self._by_admission():
            if self.slots[slot] is not s or not s.decoding:
                continue  # preempted just now, or still prefilling
            limit = len(s.request.prompt) + self.config.max_new_tokens + self.bundle.lookahead
            need = min(int(self.lengths[slot]) + rows_ahead, limit)
            while not self.allocator.grow(slot, need):
                victim = max(self._by_admission(), key=lambda item: item[1].order)[0]
                self._preempt(victim)
                if victim == slot:
                    break
            else:
                self._table_dirty = True
                decoding = True
        return decoding

    def _preempt(self, slot: int) -> None:
        s = self.slots[slot]
        self._free(slot)
        self.queue.appendleft((s.request, s.submitted, s.preemptions + 1))
        self.preemptions += 1

    def _free(self, slot: int) -> None:
        """Release the slot and its pages; its row of the loop state becomes finished, its length 0."""
        self.allocator.release(slot)
        self.slots[slot] = None
        self.lengths[slot] = 0
        self.state = self.state._replace(done=self.state.done.at[slot].set(True))
        self.cache = self.cache.replace(lengths=self.cache.lengths.at[slot].set(0))
        self._table_dirty = True

    def _collect(self) -> list[Completion]:
        """Read every slot's progress; hand back and free the finished ones."""
        num, done, lengths = jax.device_get((self.state.num, self.state.done, self.cache.lengths))
        tokens = self._read_tokens()
        now = self.clock()
        finished = []
        for slot, s in self._by_admission():
            if not s.decoding:
                continue
            self.lengths[slot] = lengths[slot]
            if num[slot] > s.emitted:
                s.bursts.append((now, int(num[slot] - s.emitted)))
                if tokens is not None:
                    self.on_tokens(s.request, tokens[slot, s.emitted : num[slot]])
                s.emitted = int(num[slot])
            if done[slot]:
                finished.append(self._completion(slot, s, now))
                self._free(slot)
        return finished

    def _read_tokens(self) -> np.ndarray | None:
        """Every slot's output buffer `[slots, ...]` when tokens are handed over (`on_tokens`), else None."""
        return None if self.on_tokens is None else np.asarray(jax.device_get(self.state.tokens))

    def _completion(self, slot: int, s: _Slot, now: float) -> Completion:
        tokens = np.asarray(jax.device_get(self.state.tokens[slot, : s.emitted]))
        steps = accepted = 0
        row = None
        stats = getattr(self.state, "stats", None)
        if stats is not None and s.decoding:  # before its prefill ends, the slot's row is its previous request's
            row = SpecStats(*(np.asarray(x) for x in jax.device_get(jax.tree.map(lambda x: x[slot : slot + 1], stats))))
            steps, accepted = int(row.steps[0]), int(row.accepted[0])
        return Completion(
            s.request, tokens, s.submitted, s.first_token, now, s.bursts, steps, accepted, s.preemptions, stats=row
        )

    def _by_admission(self) -> list[tuple[int, _Slot]]:
        """(slot, bookkeeping) of the occupied slots, oldest admission first."""
        return sorted(((i, s) for i, s in enumerate(self.slots) if s is not None), key=lambda item: item[1].order)

    def _sync_table(self) -> None:
        """Copy the allocator's page table to the device caches after a change."""
        if not self._table_dirty or self.config.layout == "dense":
            return
        self.cache = self.cache.replace(page_table=jnp.asarray(self.allocator.table))
        if isinstance(self.context, PagedBuffers):  # its own copy: both caches are donated to the same call
            self.context = self.context.replace(page_table=jnp.asarray(self.allocator.table))
        self._table_dirty = False
