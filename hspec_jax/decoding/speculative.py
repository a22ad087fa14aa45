"""The jitted draft-and-verify engine: speculative decoding with any drafter, batched, ragged, lossless.

Per step, for every sequence of the batch (all on device, in one `lax.while_loop`):

1. the block drafted at the end of the previous step, [anchor, d_1 .. d_k], is verified in ONE target
   forward over its k+1 positions (fixed length, whatever the sequence accepted before);
2. an acceptance rule (`acceptance.py`) keeps a prefix of n drafts plus one target token;
3. commit: the sequence's committed length grows by n + 1; the rejected rows the verification wrote stay
   beyond the committed length and are overwritten later (no rollback, no dynamic shapes);
4. the next block is drafted from the new state: H-Spec reads the target's cache in place and seeds its
   SSM from the hidden states at the last committed position; DFlash/DSpark first inject the k+1 rows just
   verified into their own cache (only the committed ones are ever read).

With an `AdaptivePolicy` (`policy.py`) the number of drafts verified changes per step, among a few compiled
widths, each run only when chosen (k = 0 is a plain step: one position verified, and the drafter not called for
the step after, unless its policy decides to draft: step 4 is then skipped; DFlash/DSpark keep the new row pending
and inject the pending rows with the next drafting step's, or on their own every `PENDING_ROWS` plain steps). Plain
steps that are certain to come (no sequence wants a block, no probe is due) form a run whose steps do only what plain
decoding does plus the taps: a plain step costs about a plain decoding step. Every width is verified at one place in
the loop, plain steps of runs included, so the compiled loop holds one target forward per choice. Without a policy,
every step verifies the drafter's k.

Sequences stop at EOS, `max_new_tokens`, or when the cache has no room for another block of k+1 rows.
`spec_decode` runs the loop to the end; `spec_decode_chunk` runs a few steps of it, for streaming.
`speculative_generate` drives it in one jit-cached call; `engine.compile_speculative` (ahead-of-time, chunked) and
`hspec_jax.serving.ServingEngine` (continuous batching) drive it too: why three, in `engine.py`'s docstring.
Statistics come back with the tokens: steps, accepted drafts, per draft index how often it was reached
(all earlier drafts accepted), accepted and predicted to be accepted (the drafter's confidence), and how often
each draft length was chosen, so tau, conditional acceptance rates and calibration can be reported.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hspec_jax.decoding import costs as cost_model
from hspec_jax.decoding.acceptance import greedy_accept, speculative_accept
from hspec_jax.decoding.autoregressive import is_eos
from hspec_jax.decoding.batching import bucketed_shapes, pad_to_width
from hspec_jax.decoding.bundle import Bundle, init_caches
from hspec_jax.decoding.placement import Placement
from hspec_jax.decoding.policy import (
    AdaptivePolicy,
    PolicyState,
    Prior,
    draft_width,
    first_prior,
    idled,
    init_policy,
    observe,
    pinned_costs,
    remember,
    step_choice,
    steps_to_probe,
    wants_draft,
    widened,
)
from hspec_jax.decoding.proposal import propose
from hspec_jax.decoding.sampling import SamplingConfig, probabilities, sample
from hspec_jax.drafters.api import decoding_inputs, draft_blocks, inject_context, seed_hidden_at
from hspec_jax.drafters.config import DrafterConfig, check_target
from hspec_jax.drafters.inputs import DraftInputs
from hspec_jax.drafters.output import drafted_slots
from hspec_jax.models.decoder import embedding_matrix, forward
from hspec_jax.models.kv_cache import KVCache, check_capacity, commit


class SpecStats(NamedTuple):
    steps: jax.Array  # [B] target verification steps while the sequence was active (plain steps included)
    accepted: jax.Array  # [B] drafted tokens accepted in total
    reached_at: jax.Array  # [B, k] steps in which draft i was verified with all earlier drafts accepted
    accepted_at: jax.Array  # [B, k] steps in which draft i was accepted
    predicted_at: jax.Array  # [B, k] fp32 sum of the drafter's predicted acceptance of draft i when reached
    chosen: jax.Array  # [B, C] steps that verified each draft length (the policy's choices; fixed k: [k])
    drafted: jax.Array  # [B] blocks the drafter drafted while the sequence was active, verified or declined

    def tau(self) -> float:
        """Mean tokens per step, counting the bonus/correction token (1 <= tau <= k + 1)."""
        steps = float(jnp.sum(self.steps))
        return (float(jnp.sum(self.accepted)) + steps) / max(steps, 1.0)

    def acceptance_by_position(self) -> list[float]:
        """Conditional acceptance rate of draft index i (given it was reached), over the whole batch."""
        reached, accepted = jnp.sum(self.reached_at, axis=0), jnp.sum(self.accepted_at, axis=0)
        return [float(a) / float(r) if r else float("nan") for a, r in zip(accepted, reached, strict=True)]


# How many rows plain steps collect before a drafter that keeps its own cache (DFlash/DSpark) gets them in one
# injection: injecting each plain step's row alone would cost a drafter projection (a read of its weights) per step.
PENDING_ROWS = 8


class Pending(NamedTuple):
    """Rows that plain steps (k = 0) committed and that are not yet in the drafter's own cache: they are injected
    together with the next drafting step's rows, or on their own once `PENDING_ROWS` are waiting."""

    taps: jax.Array  # [B, PENDING_ROWS, F*D] their fused taps, the first `count` valid
    count: jax.Array  # [B]
    first: jax.Array  # [B] the row of taps[:, 0]; first + count = the committed length


def _no_pending(taps: jax.Array, lengths: jax.Array) -> Pending:
    """An empty `Pending` for taps like `taps [B, C, F*D]`, starting at the committed `lengths [B]`."""
    batch, _, width = taps.shape
    return Pending(jnp.zeros((batch, PENDING_ROWS, width), taps.dtype), jnp.zeros_like(lengths), lengths)


def _pending_rows(taps: jax.Array, first: jax.Array) -> tuple:
    """`inject_rows` of `PENDING_ROWS` taps `[B, P, F*D]` from row `first [B]` on."""
    return taps, first[:, None] + jnp.arange(PENDING_ROWS), first


def _with_pending(pending: Pending, inject_rows: tuple) -> tuple:
    """`inject_rows` (taps `[B, C, F*D]` at rows first_row..) preceded by the pending rows: taps `[B, P + C, F*D]`
    from row `pending.first`, contiguous (the pending rows end where the new rows start). Past the last new row
    the taps repeat it: those rows are beyond every committed length, never read, and overwritten later."""
    taps, _, _ = inject_rows
    index = jnp.arange(PENDING_ROWS + taps.shape[1])[None, :]  # [1, P + C]
    count = pending.count[:, None]
    new = jnp.take_along_axis(taps, jnp.clip(index - count, 0, taps.shape[1] - 1)[..., None], axis=1)
    old = jnp.take_along_axis(pending.taps, jnp.minimum(index, PENDING_ROWS - 1)[..., None], axis=1)
    combined = jnp.where((index < count)[..., None], old, new)
    return combined, pending.first[:, None] + index, pending.first


def _pended(pending: Pending, taps: jax.Array, active: jax.Array) -> Pending:
    """`pending` plus the row a plain step committed (taps[:, 0] of `taps [B, C, F*D]`) for the `active [B]`
    sequences (the caller keeps the count below `PENDING_ROWS`, or injects once it reaches it)."""
    row = jnp.where(active, pending.count, PENDING_ROWS)  # finished sequences add nothing (index dropped)
    added = pending.taps.at[jnp.arange(taps.shape[0]), row].set(taps[:, 0], mode="drop")
    return pending._replace(taps=added, count=pending.count + active)


def _after_plain_or_draft(bundle: Bundle, pending: Pending, context, taps, active, drafting, lengths):
    """The pending rows and the drafter cache after a step: a drafting step injected them (with its own rows); a plain
    step adds its committed row (active sequences) and injects all of them once `PENDING_ROWS` wait.
    lengths `[B]`: the committed lengths after the step."""
    added = _pended(pending, taps, active)
    full = jnp.any(added.count >= PENDING_ROWS)
    inject = lambda c: inject_context(bundle.drafter_params, bundle.drafter, c, _pending_rows(added.taps, added.first))
    context = _when(~drafting & full, inject, context)
    reset = drafting | full
    return Pending(added.taps, jnp.where(reset, 0, added.count), jnp.where(reset, lengths, added.first)), context


def _counted(stats: SpecStats, s, active: jax.Array, n: jax.Array, drafts: jax.Array) -> SpecStats:
    """`stats` after a step of the loop state `s` that verified `drafts` (scalar) and accepted `n [B]`."""
    k = s.draft.shape[1]
    slots = jnp.arange(k)
    on = active[:, None].astype(jnp.int32)
    reached = on * (slots < drafts) * (slots <= n[:, None])
    return SpecStats(
        stats.steps + active,
        stats.accepted + n,
        stats.reached_at + reached,
        stats.accepted_at + on * (slots < n[:, None]),
        stats.predicted_at + reached * s.confidence,
        stats.chosen + on * (jnp.arange(stats.chosen.shape[1]) == s.choice),
        stats.drafted,
    )


class PlainRun(NamedTuple):
    """The loop's run of plain steps certain to come (`spec_steps`): none left outside one."""

    left: jax.Array  # [] plain steps left in the run
    active: jax.Array  # [B] the sequences active when it began


class SpecState(NamedTuple):
    """The loop carry, minus the two caches (donated separately so they are updated in place)."""

    step: jax.Array
    tokens: jax.Array  # [B, max_new_tokens + k + 1] output buffer
    num: jax.Array  # [B] tokens emitted
    done: jax.Array  # [B]
    anchor: jax.Array  # [B] last emitted token, slot 0 of the drafted block; not in the target cache yet
    draft: jax.Array  # [B, k] drafted target ids
    draft_probs: jax.Array  # [B, k, Vd] their distributions (sampling) or [B, k, 1] (greedy)
    confidence: jax.Array  # [B, k] the drafter's predicted acceptance of each draft
    choice: jax.Array  # scalar: index of the next step's draft length in the choices (0 without a policy)
    seed: jax.Array  # [B, F*D] H-Spec: fused taps at the last committed position
    stats: SpecStats
    policy: PolicyState | None  # the adaptive policy's estimates and cost table (None: fixed k)
    pending: Pending | None  # DFlash/DSpark with a policy: rows plain steps committed, not yet injected
    rng: jax.Array


class SpecGeneration(NamedTuple):
    tokens: jax.Array  # [B, max_new_tokens]
    num_tokens: jax.Array  # [B]
    stats: SpecStats
    cache: KVCache  # the target cache
    context: tuple  # DFlash/DSpark: the drafter-side cache, a real buffer (empty for H-Spec)
    prior: Prior | None = None  # with a policy: what the next generation's sequences should start from


def draft_next(bundle: Bundle, sampling, inputs: DraftInputs, rng):
    """The engine's drafting step: k tokens after the anchor of `inputs` (`decoding_inputs`) -> (tokens `[B, k]`,
    probs `[B, k, Vd]` or `[B, k, 1]` (greedy), confidence `[B, k]`, drafter cache)."""
    drafter, drafter_params = bundle.drafter, bundle.drafter_params
    k = drafter.num_drafts
    anchor = inputs.block_tokens[:, 0, 0]
    out = drafted_slots(draft_blocks(drafter_params, drafter, inputs), drafter)
    proposal = propose(
        out.logits[:, 0],
        anchor,
        bundle.vocab,
        sampling,
        rng,
        drafter_params.get("markov_head"),
        out.hidden[:, 0],
        drafter_params.get("confidence_head"),
    )
    probs = proposal.probs if not sampling.greedy else jnp.zeros((anchor.shape[0], k, 1), jnp.float32)
    context = out.drafter_cache if out.drafter_cache is not None else inputs.drafter_cache
    return proposal.tokens, probs, proposal.confidence, context


def draft_narrow(bundle: Bundle, sampling, inputs: DraftInputs, rng, drafts: int):
    """`draft_next` with the drafter drafting only `drafts` (static, at most its k) slots, its block cut to that
    length, the outputs padded to k slots (tokens 0, probabilities and confidence 0: never verified). An H-Spec
    drafter (causal inside the block) drafts the same first tokens as at full width, in less time."""
    k = bundle.drafter.num_drafts
    if drafts == k:
        return draft_next(bundle, sampling, inputs, rng)
    narrow = bundle.replace(drafter=bundle.drafter.with_drafts(drafts))
    block = inputs.block_tokens[..., : narrow.drafter.block_size]
    tokens, probs, confidence, context = draft_next(narrow, sampling, inputs.replace(block_tokens=block), rng)
    pad = lambda x: jnp.pad(x, ((0, 0), (0, k - drafts), *((0, 0),) * (x.ndim - 2)))
    return pad(tokens), pad(probs), pad(confidence), context


def _draft_at_width(bundle: Bundle, sampling, policy: AdaptivePolicy, width: jax.Array, kept: tuple) -> tuple:
    """The block drafted at `policy.choices[width]` slots (`draft_narrow`; `width` one of `policy.draft_widths`),
    only that width's drafter running (each in its own `_when`, so the drafter-side cache is updated in place);
    `kept` = (tokens, probs, confidence, context, (inputs, rng)) when `width` is 0. Returns the same five. The
    operands go through `_when`'s loop (its barrier): were they loop invariants of the decoding loop, XLA would
    hoist the whole drafter out of it and run it on every step, drafting or not."""
    out = kept
    for i in policy.draft_widths:

        def drafted(carry, drafts=policy.choices[i]):
            (inputs, rng), context = carry[4], carry[3]
            return (*draft_narrow(bundle, sampling, inputs.replace(drafter_cache=context), rng, drafts), carry[4])

        out = _when(width == i, drafted, out)
    return out


def _fused(hidden: tuple[jax.Array, ...]) -> jax.Array:
    return jnp.concatenate(hidden, axis=-1)


def choices_of(drafter: DrafterConfig, policy: AdaptivePolicy | None) -> tuple[int, ...]:
    """The draft lengths a step may verify: the policy's, or the drafter's k alone."""
    if policy is None:
        return (drafter.num_drafts,)
    if policy.max_drafts != drafter.num_drafts:
        raise ValueError(f"the policy drafts up to {policy.max_drafts} tokens, the drafter {drafter.num_drafts}")
    return policy.choices


def _verify(bundle: Bundle, sampling, state, cache, rng, drafts):
    """Verify [anchor, d_1 .. d_drafts] (drafts static) in one target forward ->
    (n `[B]` drafts accepted, next token `[B]`, cache with the rows written, taps `[B, k+1, F*D]`, rows past
    drafts + 1 zero)."""
    batch, k = state.draft.shape
    draft = state.draft[:, :drafts]
    block = jnp.concatenate([state.anchor[:, None], draft], 1)
    out = forward(bundle.target_params, bundle.target, block, cache, bundle.drafter.fusion_layer_ids)
    if sampling.greedy:
        n, nxt = greedy_accept(draft, out.logits)
    else:
        q = (
            jnp.zeros((batch, drafts, bundle.target.vocab_size), jnp.float32)
            .at[:, :, bundle.vocab.d2t]
            .set(state.draft_probs[:, :drafts])
        )
        n, nxt = speculative_accept(rng, draft, q, probabilities(out.logits, sampling))
    taps = jnp.pad(_fused(out.hidden), ((0, 0), (0, k - drafts), (0, 0)))
    return n, nxt, out.cache, taps


def _when(pred: jax.Array, fn: Callable, operand):
    """`fn(operand)` if the scalar `pred`, else `operand`: a while loop of at most one iteration. Unlike `lax.cond`
    / `lax.switch`, whose outputs XLA copies, a loop carry is updated in place: a step that writes the KV caches
    under a data-dependent choice must not copy them (a plain step would cost a cache copy more than plain
    decoding)."""

    def once(carry):
        # Through a barrier with the loop's flag: XLA then cannot hoist fn's work out of the loop as invariant
        # (it would run on every call, pred or not).
        _, x = jax.lax.optimization_barrier(carry)
        return jnp.bool_(True), fn(x)

    return jax.lax.while_loop(lambda carry: pred & ~carry[0], once, (jnp.bool_(False), operand))[1]


# Both halves of the engine: loop settings are static (and the bundle's configs, its tree metadata), the two caches
# are donated (updated in place).
_ENGINE_STATIC = ("sampling", "max_new_tokens", "eos_ids", "pad_id", "policy")
_engine_jit = functools.partial(jax.jit, static_argnames=_ENGINE_STATIC, donate_argnames=("cache", "context"))


def _room(cache: KVCache, k: int) -> jax.Array:
    """[B] whether another block of k+1 rows fits after the committed rows."""
    return cache.lengths + k + 1 <= cache.capacity


def spec_prefill_unjitted(
    bundle: Bundle,
    prompts: jax.Array,
    lengths: jax.Array,
    cache: KVCache,
    context: tuple,
    rng: jax.Array,
    costs: jax.Array | None = None,
    prior: Prior | None = None,
    *,
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    eos_ids: tuple[int, ...] = (),
    pad_id: int = 0,
    policy: AdaptivePolicy | None = None,
) -> tuple[SpecState, KVCache, tuple]:
    """Prefill `bundle`'s target on right-padded `prompts [B, T]`, sample the first token, draft the first block
    (with a `policy`, H-Spec drafts it only if the prior's estimates want one).
    Returns the loop state, the target cache and the drafter-side cache (empty unless DFlash/DSpark). The prompts
    go at each sequence's committed length, so a long prompt can be fed in pieces (earlier pieces committed by
    earlier calls, whose states are discarded). With a `policy`, `costs [C]` is its cost table (`costs.py`),
    `prior` what the sequences' estimates start from (default: the policy's first prior; see `policy.py`), and the
    first step's draft length is chosen from the first block's confidence and that prior. `spec_prefill` is its
    jitted form; this one is for callers that trace it inside their own jit (`sampling` may be a `RowSampling`
    there)."""
    target_params, drafter = bundle.target_params, bundle.drafter
    k = drafter.num_drafts
    batch = prompts.shape[0]
    start = cache.lengths
    first_rng, draft_rng, loop_rng = jax.random.split(rng, 3)
    last = (lengths - 1)[:, None]  # logits only at each sequence's last prompt position: [B, 1, V], not [B, T, V]
    out = forward(target_params, bundle.target, prompts, cache, drafter.fusion_layer_ids, logit_indices=last)
    token = sample(first_rng, out.logits[:, 0], sampling)
    cache = commit(out.cache, lengths)
    inputs = decoding_inputs(drafter, embedding_matrix(target_params), token, cache, _fused(out.hidden), start, context)
    seed = inputs.seed_hidden[:, 0]
    tokens = jnp.full((batch, max_new_tokens + k + 1), pad_id, jnp.int32).at[:, 0].set(token)
    num = jnp.ones((batch,), jnp.int32)
    done = is_eos(token, eos_ids) | (num >= max_new_tokens) | ~_room(cache, k)
    zeros = jnp.zeros((batch,), jnp.int32)
    per_slot = jnp.zeros((batch, k), jnp.int32)
    choices = choices_of(drafter, policy)
    chosen = jnp.zeros((batch, len(choices)), jnp.int32)
    stats = SpecStats(zeros, zeros, per_slot, per_slot, per_slot.astype(jnp.float32), chosen, zeros)
    first_block = lambda operands: draft_next(bundle, sampling, *operands)
    operands = (inputs, draft_rng)
    estimates, choice, drafting = None, jnp.int32(0), jnp.bool_(True)
    if policy is None:
        draft, probs, confidence, context = first_block(operands)
    else:
        if costs is None:
            raise ValueError("an adaptive policy needs its cost table (costs.py: step_costs)")
        estimates = init_policy(policy, batch, costs, prior)
        # A drafter with its own cache always drafts here (the prompt's rows go into its cache); H-Spec only when
        # the prior wants a block: an engine that learnt a drafter does not pay calls it would not use.
        width = draft_width(estimates, policy, ~done)
        if drafter.owns_kv_cache:
            width = jnp.maximum(width, 1)
        width = policy.drafted(width)
        drafting = width > 0
        blank = jax.tree.map(jnp.zeros_like, jax.eval_shape(first_block, operands)[:3])
        kept = (*blank, context, operands)
        draft, probs, confidence, context, _ = _draft_at_width(bundle, sampling, policy, width, kept)
        choice = jnp.where(drafting, step_choice(estimates, policy, confidence, ~done, width), 0)
        estimates = estimates._replace(drafted=jnp.broadcast_to(drafting, (batch,)))
    stats = stats._replace(drafted=(drafting & ~done).astype(jnp.int32))
    pending = _no_pending(inputs.seed_hidden, cache.lengths) if policy is not None and drafter.owns_kv_cache else None
    state = SpecState(
        jnp.int32(0),
        tokens,
        num,
        done,
        token,
        draft,
        probs,
        confidence,
        choice,
        seed,
        stats,
        estimates,
        pending,
        loop_rng,
    )
    return state, cache, context


spec_prefill = _engine_jit(spec_prefill_unjitted)


def spec_steps(bundle: Bundle, state, cache, context, steps, max_new_tokens, sampling, eos_ids, pad_id, policy):
    """Up to `steps` draft-and-verify steps (fewer once every sequence is done) -> (state, cache, context): the
    loop `spec_decode_chunk` and `spec_decode` jit, for callers that trace it inside their own jit (`sampling` may
    be a `RowSampling` there)."""
    drafter = bundle.drafter
    k = drafter.num_drafts
    batch = state.anchor.shape[0]
    slots = jnp.arange(k + 1)
    choices = choices_of(drafter, policy)
    limit = jnp.minimum(state.step + steps, max_new_tokens)
    verifiers = [functools.partial(_verify, bundle, sampling, drafts=c) for c in choices]

    def cond(carry):
        s = carry[0]
        return (s.step < limit) & ~jnp.all(s.done)

    def emit(s, cache, n, nxt):
        """Commit n `[B]` drafts + 1 of the active sequences; emit d_1..d_n then the target's token `nxt [B]`, cut
        after the first EOS and at max_new_tokens -> (tokens, num, done, cache)."""
        active = ~s.done
        cache = commit(cache, jnp.where(active, n + 1, 0))
        emitted = jnp.where(slots < n[:, None], jnp.pad(s.draft, ((0, 0), (0, 1))), nxt[:, None])
        eos_hits = is_eos(emitted, eos_ids) & (slots <= n[:, None])
        first_eos = jnp.where(eos_hits.any(-1), jnp.argmax(eos_hits, -1), k + 1)
        count = jnp.minimum(jnp.minimum(n + 1, first_eos + 1), max_new_tokens - s.num)
        count = jnp.where(active, count, 0)
        write_at = jnp.where(slots < count[:, None], s.num[:, None] + slots, s.tokens.shape[1])  # past end: dropped
        tokens = s.tokens.at[jnp.arange(batch)[:, None], write_at].set(emitted, mode="drop")
        num = s.num + count
        done = s.done | (eos_hits & (slots < count[:, None])).any(-1) | (num >= max_new_tokens) | ~_room(cache, k)
        return tokens, num, done, cache

    def plain_run_length(s):
        """Scalar: plain steps certain to follow (0 unless this step is plain, its block was not drafted and the
        estimates, which plain steps leave as they are, want no block under the current cost table): up to the step
        before a probe falls due, within the chunk, and while DFlash's pending rows have room."""
        active = ~s.done
        undrafted = (s.choice == 0) & ~jnp.any(active & s.policy.drafted) & ~wants_draft(s.policy, policy, active)
        until_probe = jnp.min(jnp.where(active, steps_to_probe(s.policy), max_new_tokens)) - 1
        last = jnp.minimum(until_probe, limit - s.step)
        if s.pending is not None:
            last = jnp.minimum(last, PENDING_ROWS - 1 - jnp.max(jnp.where(active, s.pending.count, 0)))
        return jnp.where(undrafted, jnp.maximum(last, 0), 0)

    def new_run(s):
        return PlainRun(plain_run_length(s), ~s.done)

    def verify_chosen(s, cache, rng):
        """The chosen width's verification -> (n, next token, cache, taps): with a policy, one target forward per
        choice, each in its own `_when`, and only the chosen one runs."""
        if policy is None:
            return verifiers[0](s, cache, rng)
        taps = jax.eval_shape(verifiers[0], s, cache, rng)[3]
        out = (jnp.zeros((batch,), jnp.int32), s.anchor, cache, jnp.zeros(taps.shape, taps.dtype))
        for i, verify in enumerate(verifiers):
            out = _when(s.choice == i, lambda o, verify=verify: verify(s, o[2], rng), out)
        return out

    def draft(inputs, rng, context):
        return draft_next(bundle, sampling, inputs.replace(drafter_cache=context), rng)

    def in_plain_run(operand):
        """The rest of a step of a run of certain plain steps: only what plain decoding does plus the taps (no
        drafter, no policy arithmetic). Sequences that finish during the run are remembered together at its end
        (their estimates do not change once done)."""
        (s, cache, context, run), (step, _) = operand
        taps, start, running = step["taps"], step["start"], step["active"]
        pending = None if s.pending is None else _pended(s.pending, taps, running)
        seed = seed_hidden_at(taps, cache.lengths[:, None], start)[:, 0]
        left = run.left - 1
        over = (left == 0) | jnp.all(s.done)
        idle = idled(s.policy, running)
        estimates = jax.tree.map(lambda e, p: jnp.where(over, e, p), remember(idle, run.active & s.done), idle)
        s = s._replace(seed=seed, pending=pending, policy=estimates)
        return (s, cache, context, run._replace(left=jnp.where(over, 0, left))), operand[1]

    def after_verify(operand):
        """The rest of a step outside such runs: the policy's observation and decisions, then drafting the next
        block when it wants one (always, without a policy)."""
        (s, cache, context, _), (step, draft_rng) = operand
        taps, start, active, n, drafts = step["taps"], step["start"], step["active"], step["n"], step["drafts"]
        inputs = decoding_inputs(drafter, embedding_matrix(bundle.target_params), s.anchor, cache, taps, start)
        seed = inputs.seed_hidden[:, 0]
        pending = s.pending
        if pending is not None:  # a drafting step injects the rows plain steps left pending, then its own
            inputs = inputs.replace(inject_rows=_with_pending(pending, inputs.inject_rows))
        operands = (inputs, draft_rng)
        if policy is None:
            draft_tokens, probs, confidence, context = draft(*operands, context)
            estimates, choice, drafting = None, s.choice, jnp.bool_(True)
        else:
            matched = s.draft[:, 0] == s.anchor  # a declined block's first draft against the plain step's token
            estimates = remember(observe(s.policy, policy, s.confidence, drafts, n, active, matched), active & s.done)
            width = policy.drafted(draft_width(estimates, policy, ~s.done, widened(policy, s.choice, drafts, n)))
            drafting = width > 0
            kept = (s.draft, s.draft_probs, jnp.zeros_like(s.confidence), context, operands)
            draft_tokens, probs, confidence, context, (inputs, _) = _draft_at_width(
                bundle, sampling, policy, width, kept
            )
            cache = inputs.target_cache
            if pending is not None:
                pending, context = _after_plain_or_draft(
                    bundle, pending, context, taps, active, drafting, cache.lengths
                )
            choice = jnp.where(drafting, step_choice(estimates, policy, confidence, ~s.done, width), 0)
            estimates = estimates._replace(drafted=jnp.broadcast_to(drafting, (batch,)))
        s = s._replace(
            stats=s.stats._replace(drafted=s.stats.drafted + (drafting & ~s.done)),
            draft=draft_tokens,
            draft_probs=probs,
            confidence=confidence,
            choice=choice,
            seed=seed,
            policy=estimates,
            pending=pending,
        )
        return (s, cache, context, None if policy is None else new_run(s)), operand[1]

    def body(carry):
        """One step: verify the chosen width (one site per width, plain steps of runs included), emit, then either
        a plain run's bookkeeping or the policy and drafting (`in_plain_run`, `after_verify`)."""
        s, cache, context, run = carry
        accept_rng, draft_rng, rng = jax.random.split(s.rng, 3)
        active = ~s.done
        start = cache.lengths
        n, nxt, cache, taps = verify_chosen(s, cache, accept_rng)
        drafts = jnp.asarray(choices, jnp.int32)[s.choice]
        n = jnp.where(active, n, 0)
        tokens, num, done, cache = emit(s, cache, n, nxt)
        stats = _counted(s.stats, s, active, n, drafts)
        s = s._replace(step=s.step + 1, tokens=tokens, num=num, done=done, anchor=nxt, stats=stats, rng=rng)
        # The step's values go through the `_when` loops' carries: as loop invariants XLA could hoist their users.
        step = dict(taps=taps, start=start, active=active, n=n, drafts=drafts)
        operand = ((s, cache, context, run), (step, draft_rng))
        if policy is None:
            return after_verify(operand)[0]
        in_run = run.left > 0
        operand = _when(in_run, in_plain_run, operand)
        return _when(~in_run, after_verify, operand)[0]

    run = None if policy is None else new_run(state)
    state, cache, context, _ = jax.lax.while_loop(cond, body, (state, cache, context, run))
    return state, cache, context


@_engine_jit
def spec_decode(
    bundle: Bundle,
    state: SpecState,
    cache: KVCache,
    context: tuple,
    *,
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    eos_ids: tuple[int, ...] = (),
    pad_id: int = 0,
    policy: AdaptivePolicy | None = None,
) -> SpecGeneration:
    """Run draft-and-verify steps on device until every sequence is done (see the module docstring)."""
    final, cache, context = spec_steps(
        bundle, state, cache, context, max_new_tokens, max_new_tokens, sampling, eos_ids, pad_id, policy
    )
    if final.pending is not None:  # the drafter cache handed back holds every committed row
        rows = _pending_rows(final.pending.taps, final.pending.first)
        context = inject_context(bundle.drafter_params, bundle.drafter, context, rows)
    prior = None if final.policy is None else final.policy.prior
    return SpecGeneration(final.tokens[:, :max_new_tokens], final.num, final.stats, cache, context, prior)


@_engine_jit
def spec_decode_chunk(
    bundle: Bundle,
    state: SpecState,
    cache: KVCache,
    context: tuple,
    steps: int | jax.Array,
    *,
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    eos_ids: tuple[int, ...] = (),
    pad_id: int = 0,
    policy: AdaptivePolicy | None = None,
) -> tuple[SpecState, KVCache, tuple]:
    """At most `steps` more draft-and-verify steps (traced: one compilation serves every chunk size), for callers
    that stream or stop between chunks. Chained from `spec_prefill` until every sequence is done, it gives exactly
    `spec_decode`'s tokens and statistics; `state.tokens[:, :max_new_tokens]` and `state.num` are the output so far."""
    return spec_steps(bundle, state, cache, context, steps, max_new_tokens, sampling, eos_ids, pad_id, policy)


def measure_costs(
    prefill: Callable[[jax.Array], tuple],
    chunk: Callable[[tuple, int], tuple],
    policy: AdaptivePolicy,
    shape: dict,
) -> np.ndarray:
    """The policy's cost table `[C]` for this machine and `shape` (`costs.engine_shape`), cached or measured:
    `prefill(costs)` starts a fresh loop (new caches) with a cost table, `chunk(carry, steps)` runs it on.

    The choices are timed in one running generation: before each reading the table pinned to the choice is put in
    the loop's state and one untimed step goes from the last reading's width to this one, so the readings of a round
    are milliseconds apart; a fresh prefill (untimed) starts again only when the generation has ended (before the
    reading, or with that untimed step)."""
    steps = min(cost_model.MEASURED_STEPS, policy.probe_every - 1) or 1
    live: dict[str, tuple] = {}
    warm = set()

    def start(index: int) -> tuple:
        pinned = pinned_costs(policy, index)
        carry = live.get("carry")
        if carry is not None and not bool(carry[0].done.all()):
            state = carry[0]
            estimates = state.policy._replace(costs=pinned, idle=jnp.zeros_like(state.policy.idle))
            carry = chunk((state._replace(policy=estimates), *carry[1:]), 1)
            if not bool(carry[0].done.all()):
                return carry
        return prefill(pinned)

    def run(carry: tuple) -> tuple:
        live["carry"] = chunk(carry, steps)
        return live["carry"]

    def measure(index: int) -> float:
        seconds = cost_model.time_steps(lambda: start(index), run, repeats=1, warm_up=index not in warm)
        warm.add(index)
        return seconds

    return cost_model.step_costs(shape, policy.choices, measure)


def adaptive_costs(
    bundle: Bundle,
    prompts: jax.Array,
    lengths: jax.Array,
    fresh_caches: Callable[[], tuple],
    capacity: int,
    rng: jax.Array,
    *,
    policy: AdaptivePolicy,
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    eos_ids: tuple[int, ...] = (),
    pad_id: int = 0,
) -> np.ndarray:
    """The cost table `[C]` of `policy` for `bundle` on `prompts [B, T]` with caches of `capacity` rows
    (`fresh_caches()` -> new target and drafter caches), cached per machine and shape or measured on this loop
    (`measure_costs`)."""
    kw = dict(max_new_tokens=max_new_tokens, sampling=sampling, eos_ids=eos_ids, pad_id=pad_id, policy=policy)

    def prefill(step_costs):
        return spec_prefill(bundle, prompts, lengths, *fresh_caches(), rng, step_costs, first_prior(policy), **kw)

    def chunk(carry, steps):
        return spec_decode_chunk(bundle, *carry, steps, **kw)

    shape = cost_model.engine_shape(
        bundle.target,
        bundle.drafter,
        sampling,
        prompts.shape[0],
        capacity,
        (bundle.target_params, bundle.drafter_params),
    )
    return measure_costs(prefill, chunk, policy, shape)


def speculative_generate(
    bundle: Bundle,
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
    policy: AdaptivePolicy | None = None,
    costs: jax.Array | None = None,
    prior: Prior | None = None,
) -> SpecGeneration:
    """Prefill, then draft-and-verify with `bundle`'s drafter until done. prompts `[B, W]` (right-padded), lengths
    `[B]` -> `SpecGeneration`: tokens `[B, max_new_tokens]` (valid up to `num_tokens [B]`), `stats` (`SpecStats`),
    the caches and, with a policy, the learnt `prior`. `cache_capacity` defaults to the longest
    prompt plus `max_new_tokens` plus one block, so the cache never stops a sequence before `max_new_tokens`; it and
    the prompt width are rounded up to a bucket (`batching.bucketed_shapes`). With a `mesh`, both models' params, the
    batch and the caches are sharded and the whole loop runs SPMD. With an adaptive `policy` the draft length changes
    per step; its cost table `costs [C]` is measured on this machine for this shape when not given (and cached), and
    `prior` (default: the policy's first) is what its estimates start from; the generation's `prior` is what they
    learnt, for the next call."""
    target, drafter = bundle.target, bundle.drafter
    if drafter is None:
        raise ValueError("draft-and-verify needs a drafter in the bundle (plain decoding: autoregressive.generate)")
    k = drafter.num_drafts
    check_target(drafter, target)
    longest = int(jnp.max(lengths))
    width, capacity = bucketed_shapes(longest, prompts.shape[1], k + 1, max_new_tokens, cache_capacity)
    check_capacity(jax.device_get(lengths), k + 1, capacity)
    prompts = pad_to_width(jnp.asarray(prompts), width, pad_id)
    rng = jax.random.key(0) if rng is None else rng
    choices_of(drafter, policy)

    place = Placement(mesh, target)
    bundle = place.bundle(bundle)
    prompts, lengths = place.batch(prompts, lengths)

    def fresh_caches():
        return place.kv(init_caches(bundle, prompts.shape[0], capacity))

    kw = dict(max_new_tokens=max_new_tokens, sampling=sampling, eos_ids=eos_ids, pad_id=pad_id, policy=policy)
    if policy is not None:
        costs = adaptive_costs(bundle, prompts, lengths, fresh_caches, capacity, rng, **kw) if costs is None else costs
        prior = first_prior(policy) if prior is None else prior  # a learnt prior passed later: the same program
    state, cache, context = spec_prefill(bundle, prompts, lengths, *fresh_caches(), rng, costs, prior, **kw)
    return spec_decode(bundle, state, cache, context, **kw)
