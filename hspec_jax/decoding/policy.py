"""Adaptive draft length: per step, draft only as far as it pays.

A step that drafts k tokens costs T(k) (drafting + verifying k + 1 positions; T(0) = one plain step, the drafter
not called) and yields 1 + sum_{j<=k} prod_{i<=j} a_i tokens, with a_i the conditional acceptance of slot i.
Each step takes the k among the compiled choices (`AdaptivePolicy.for_drafts`: by default 0, 1, 2, 4, 7 on
accelerators; 0, 3 on CPU, where `auto_drafting` cuts the drafter to 3 drafts) that maximises yield / cost. The
costs `[C]` are T(k) / T(0), measured on the device (`costs.py`), a traced array: a new table needs no
recompilation.

Acceptance estimates, per sequence and slot i (all in the loop state, `PolicyState`):

* c_i, the drafter's prediction for the block just drafted: sigmoid of its confidence head where it has one,
  else the top probability of its draft distribution at slot i;
* decayed sums over the steps in which slot i was verified (reached: all earlier drafts accepted):
  R_i (times reached) and A_i (times accepted), started at `prior_weight` pseudo-steps of acceptance `prior`;
  a block drafted but then not verified (decision 2 below chose k = 0) counts as slot 1 reached, accepted if the
  target's token of that plain step is the block's first draft (what a verification of one draft would have found
  under greedy decoding; under sampling the target's token is a sample, so a match stands in for an acceptance);
* one calibration ratio per sequence, A / P: decayed sums over the steps that verified drafts (or declined a
  drafted block, its first slot scored as above) of the drafts accepted (A) and of their predictions c_i (P),
  started at `prior_weight` pseudo-drafts predicted and accepted alike (so the drafter is trusted at first). It is
  pooled over slots: slot 1 decides most steps, and a ratio learned there must also temper later slots that have
  not been reached yet.

Two decisions per step, both per sequence:

1. *whether and how far to draft* the next block (before the drafter runs): with the history estimate
   a_i = A_i / R_i, the k of the best yield / cost. If it is 0, the next step is a plain one and the drafter is not
   called. A sequence that took `probe_every` plain steps in a row drafts anyway (a probe, with at least the
   smallest k > 0), so its estimates can recover when the text turns predictable again. A `narrow` policy drafts
   only the slots of the widest k an active sequence chose (`draft_width`), one choice wider for a sequence whose
   last verification accepted every draft (`widened`); otherwise (the default) the drafter drafts its k.
2. *how far to verify* (after drafting): with the calibrated prediction a_i = min(1, c_i * A / P), the k
   of the best yield / cost among the choices up to the drafted width (a probe at least the smallest k > 0);
   0 declines the block.

An uncalibrated or untrained drafter (high c_i, nothing accepted) thus drives A / P and A_1 / R_1 towards 0
within about a dozen steps and falls back to plain decoding, probing once every `probe_every` steps (more where a
probe costs more than two plain steps: `steps_to_probe`).

Probes back off: a probe after which the history still says drafting does not pay (nothing accepted, or too little
for the cost table) doubles the plain steps before the next one (up to `probe_max`); a verification after which
drafting pays sets the wait back to `probe_every`. A drafter whose occasional hits never pay for their steps is thus
probed ever more rarely: each probe costs about a plain step more than it yields. In a batch of B sequences each
waits B times as long: a probe makes the whole batch verify a wider block, so the batch probes about as often as one
sequence alone.

Across sequences: a new sequence starts from the engine's `Prior` (per-slot acceptance and calibration ratio,
weighted `prior_weight` pseudo-steps), at first the policy's `prior` with full trust; whenever sequences finish, the
prior moves a quarter of the way to their pooled final estimates (`PRIOR_MIX`). An engine that keeps its loop
state (serving) or hands the prior on to its next generation (`engine.compile_speculative`,
`speculative_generate(prior=...)`) thus starts a request with what earlier requests learnt of this drafter: an
untrained drafter is not trusted again at every request's start (after a few of them).
Its first probe is still due after `probe_every` plain steps, whatever the waits of earlier sequences had grown to:
a new text can be as predictable as the earlier ones were not, and a prior that went low on them, handed on with
their long waits, would never be tested again (measured with `smollm2-hspec-cut` on `eval.main`'s eight tasks x 3
prompts, 64 tokens each: with the waits handed on, 16 of the 27 sequences never verified a draft; with the first
probe at `probe_every`, 1 of 27). One probe per sequence costs a drafter that never pays about T(smallest k) - 1
plain steps in `probe_every` of them, under 2%.
It only changes which widths are verified, never the output.

Plain steps certain to come (the estimates want no block and no probe is due) run as a run of steps in the engine
(`speculative.py`) without the drafter and the policy's bookkeeping, so that a plain step costs about what plain
decoding costs.

Batch policy: the drafter runs when any active sequence wants to draft, and the step verifies the largest k any
active sequence chose. Every sequence then verifies all k drafted slots of that width: the target pays for the
width anyway, and acceptance is lossless for any k.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from hspec_jax.cli import AUTO

# The draft lengths below the drafter's k that `AdaptivePolicy.for_drafts` compiles, per platform. Every choice is a
# target forward in the compiled loop and a column of the cost table measured at first use. On CPU the packed matmul
# kernel multiplies rows in groups of 4 (AVX2) or 8 (AVX-512F), so verifying 2, 3 or 4 rows costs about what one row
# does and a draft of 3 costs what a draft of 1 or 2 does: a SmolLM2 forward over 1, 2, 4 and 5 tokens took 19.8,
# 21.4, 23.7 and 29.8 ms on the AVX2 path (19.5, 20.0, 21.9, 24.5 on the AVX-512F one;
# benchmarks/results/packed_matmul.md), and with the shipped drafter T(3) / T(0) was 1.44, T(7) / T(0) 1.84 on the
# AVX2 path (benchmarks/results/cost_tables.md). Shorter drafts there would only cost compiling and measuring
# (benchmarks/results/draft_choices.md). Accelerators keep the short drafts: a verification's cost grows with its
# rows there only at large batches, where they can pay.
SHORT_DRAFTS = {"cpu": (3,), "default": (1, 2, 4)}

# The longest draft `auto` verifies, per platform (absent: the drafter's k); `auto_drafting` cuts the drafter to it.
# On CPU a step verifying 7 drafts costs 1.8-1.9 plain steps against 1.5 for 3 (Intel Xeon; 1.4 against 1.2 on an
# AMD EPYC with AVX-512), so 7 pays over 3 only where nearly every draft is accepted: with `smollm2-hspec-cut` the
# policy chose 7 on 0-3% of steps (benchmarks/results/whole_runs_intel_xeon.md, eval_smollm2_auto_v10). Without it
# the loop compiles one verification less and the first-use cost table times one choice less: `eval.startup` from an
# empty cache took 19.9 s instead of 23.8 s on an Intel Xeon (results/startup_intel_xeon.md). A block of 3 drafted as
# 3 slots costs about what 7 slots do there (T(3)/T(0) 1.56 against 1.55), 4% less on the AMD EPYC (draft_width.md).
LONGEST_DRAFT = {"cpu": 3}


@dataclasses.dataclass(frozen=True)
class AdaptivePolicy:
    """Static settings of the adaptive draft length (hashable: part of the engine's jit key).

    choices: the draft lengths the loop compiles a verification for, increasing, starting at 0 (a plain step);
    the largest is the drafter's k. prior / prior_weight: the first sequence's acceptance estimate and the weight
    in steps of every sequence's starting estimates (8: with 2, two misses in a row turned a drafter of slot-1
    acceptance ~0.45 off for the rest of a 64-token answer and handed the low estimate on; with 8 the eight tasks of
    `eval.main` drafted 113 steps and accepted 77 drafts against 59 and 21, and an untrained drafter stops drafting
    within a dozen steps of its first sequence instead of six). decay: the weight of older observations (per
    verification of that slot). probe_every: plain steps in a row after which a sequence drafts again; probe_max:
    the longest such wait after failed probes. narrow: draft each block only as far as decision 1 chose and verify
    at most that far, instead of drafting the drafter's k and verifying as far as decision 2 chooses. On CPU a block
    of 3 drafted as 3 slots instead of 7 made that step 1.30-1.40 plain steps instead of 1.36-1.43, but the loop then
    holds one drafter program per width: from an empty compilation cache `eval.generate` compiled 4.7 s longer
    (13.1 s instead of 8.3 s), and each drafting step saves about 1 ms, so only a long-running process (a server)
    gains; off by default (benchmarks/results/draft_width.md)."""

    choices: tuple[int, ...] = (0, 1, 2, 4, 7)
    prior: float = 0.5
    prior_weight: float = 8.0
    decay: float = 0.9
    probe_every: int = 32
    probe_max: int = 256
    narrow: bool = False

    def __post_init__(self):
        c = self.choices
        if len(c) < 2 or c[0] != 0 or any(b <= a for a, b in itertools.pairwise(c)):
            raise ValueError(f"choices must increase from 0 and include some k > 0, got {c}")
        if not 0.0 < self.prior < 1.0 or self.prior_weight <= 0.0:
            raise ValueError(f"prior must be in (0, 1) with a positive weight, got {self.prior}, {self.prior_weight}")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")
        if not 1 <= self.probe_every <= self.probe_max:
            raise ValueError(f"need 1 <= probe_every <= probe_max, got {self.probe_every}, {self.probe_max}")

    @classmethod
    def for_drafts(cls, k: int, platform: str | None = None, **settings) -> AdaptivePolicy:
        """The default choices for a drafter of k drafts on `platform` (default: JAX's default backend):
        `SHORT_DRAFTS` of that platform below k, then k, after 0."""
        short = SHORT_DRAFTS.get(platform or jax.default_backend(), SHORT_DRAFTS["default"])
        return cls(choices=tuple(sorted({c for c in short if c < k} | {0, k})), **settings)

    @classmethod
    def auto_drafting(cls, drafter, platform: str | None = None, **settings):
        """`--k auto` for `drafter` (a DrafterConfig) on `platform` (default: JAX's default backend) -> (the drafter
        cut to the longest draft `auto` verifies there, `LONGEST_DRAFT`; the policy for it, `for_drafts`). A cut
        H-Spec block drafts the same first tokens as the whole one (causal inside the block); DFlash's and DSpark's
        differ (bidirectional), still verified."""
        limit = LONGEST_DRAFT.get(platform or jax.default_backend(), drafter.num_drafts)
        if drafter.num_drafts > limit:
            drafter = drafter.with_drafts(limit)
        return drafter, cls.for_drafts(drafter.num_drafts, platform, **settings)

    @property
    def max_drafts(self) -> int:
        return self.choices[-1]

    @property
    def draft_widths(self) -> tuple[int, ...]:
        """The indices into `choices` of the widths a block may be drafted at: every k > 0 when `narrow`, else k."""
        return tuple(range(1, len(self.choices))) if self.narrow else (len(self.choices) - 1,)

    def drafted(self, width: jax.Array) -> jax.Array:
        """The index of the width a block is drafted at when decision 1 chose index `width` (0: none)."""
        return width if self.narrow else jnp.where(width > 0, len(self.choices) - 1, 0)


def drafting(drafter, k: int | str | None) -> tuple:
    """(drafter, policy) for a draft length `k` as the tools take it: an int drafts k tokens every step and None
    the drafter's own k (policy None); `AUTO` chooses per step (`AdaptivePolicy.auto_drafting`: the drafter cut to
    the platform's longest draft, and the policy for it)."""
    if k == AUTO:
        return AdaptivePolicy.auto_drafting(drafter)
    return (drafter if k is None else drafter.with_drafts(k)), None


# How far the prior moves towards the estimates of the sequences that just finished: a running mean over about the
# last four finishes rather than the last one's estimates alone. Handed on whole, the prior followed whichever
# texts came last: after a few sequences that suited the drafter poorly (translation, summarization) it sat near
# zero and the next, well-suited ones started without drafting (eval.main, eight tasks x 3 prompts,
# smollm2-hspec-cut: drafts accepted 77 with the prior handed on whole, 137 with 0.25; code and tool use drafted 7
# and 3 steps, then 38 and 16).
PRIOR_MIX = 0.25


class Prior(NamedTuple):
    """What a new sequence's estimates start from (each weighted `prior_weight` pseudo-steps)."""

    acceptance: jax.Array  # [k] conditional acceptance per slot
    ratio: jax.Array  # [] calibration: drafts accepted per unit of predicted acceptance


def first_prior(policy: AdaptivePolicy) -> Prior:
    """The prior before any sequence finished: acceptance `policy.prior` at every slot, the drafter trusted."""
    acceptance = jnp.full((policy.max_drafts,), policy.prior, jnp.float32)
    return Prior(acceptance, jnp.float32(1.0))


class PolicyState(NamedTuple):
    costs: jax.Array  # [C] T(k) / T(0) per choice
    prior: Prior  # what the next sequence to start begins with (shared by the batch)
    reached: jax.Array  # [B, k] decayed count of steps that verified slot i with all earlier drafts accepted
    accepted: jax.Array  # [B, k] decayed count of those in which slot i was accepted
    calibration: jax.Array  # [B, 2] decayed sums of drafts accepted and of their predictions c_i
    idle: jax.Array  # [B] plain steps in a row
    wait: jax.Array  # [B] plain steps in a row after which a probe is due (doubled by each failed probe)
    drafted: jax.Array  # [B] bool: the block of the next step was drafted for it (not left from an earlier step)


def init_policy(policy: AdaptivePolicy, batch: int, costs: jax.Array, prior: Prior | None = None) -> PolicyState:
    """The starting state: `prior_weight` pseudo-steps at the `prior`'s acceptance and calibration (default:
    `first_prior`) for every slot of `batch` sequences."""
    k = policy.max_drafts
    prior = first_prior(policy) if prior is None else prior
    weight = jnp.full((batch, k), policy.prior_weight, jnp.float32)
    costs = jnp.asarray(costs, jnp.float32)
    if costs.shape != (len(policy.choices),):
        raise ValueError(f"costs has shape {costs.shape}, expected one per choice {policy.choices}")
    if prior.acceptance.shape != (k,):
        raise ValueError(f"the prior has {prior.acceptance.shape} acceptances, expected one per draft ({k})")
    calibration = policy.prior_weight * jnp.stack([prior.ratio, jnp.float32(1.0)])
    calibration = jnp.broadcast_to(calibration, (batch, 2)).astype(jnp.float32)
    idle = jnp.zeros((batch,), jnp.int32)
    wait = jnp.full((batch,), policy.probe_every, jnp.int32)
    accepted = weight * prior.acceptance.astype(jnp.float32)
    return PolicyState(costs, prior, weight, accepted, calibration, idle, wait, jnp.ones((batch,), bool))


def expected_yield(acceptance: jax.Array, choices: tuple[int, ...]) -> jax.Array:
    """Conditional acceptance `[B, k]` -> expected tokens per step `[B, C]` for each choice of k:
    1 + sum_{j<=k} prod_{i<=j} a_i."""
    reach = jnp.cumsum(jnp.cumprod(acceptance, axis=-1), axis=-1)  # [B, k]
    padded = jnp.concatenate([jnp.zeros_like(reach[:, :1]), reach], axis=-1)  # [B, k+1], index k = k drafts
    return 1.0 + padded[:, jnp.asarray(choices)]


def best_choice(
    acceptance: jax.Array, costs: jax.Array, choices: tuple[int, ...], widest: jax.Array | int | None = None
) -> jax.Array:
    """`[B, k]` acceptance, costs `[C]` -> `[B]` index of the choice of the best yield per unit of cost, among the
    choices up to index `widest` (scalar; None: all)."""
    value = expected_yield(acceptance, choices) / costs
    if widest is not None:
        value = jnp.where(jnp.arange(len(choices)) <= widest, value, -jnp.inf)
    return jnp.argmax(value, axis=-1).astype(jnp.int32)


def history_acceptance(state: PolicyState) -> jax.Array:
    """`[B, k]` acceptance observed so far, A_i / R_i."""
    return state.accepted / state.reached


def calibrated_acceptance(state: PolicyState, confidence: jax.Array) -> jax.Array:
    """`[B, k]` the drafter's prediction c_i corrected by this sequence's record: min(1, c_i * A / P)."""
    ratio = state.calibration[:, 0] / jnp.maximum(state.calibration[:, 1], 1e-6)
    return jnp.minimum(confidence * ratio[:, None], 1.0)


def steps_to_probe(state: PolicyState) -> jax.Array:
    """`[B]` plain steps left before each sequence's probe is due. The wait is multiplied by the batch size B (a
    server's slots): a probe widens the whole batch's verification, so a batch probes about as often as one sequence
    alone; B, not the number still active, so that a sequence finishing never brings another's probe forward. And
    by what a probe costs beyond the token it surely yields, T(smallest k > 0) - 1 plain steps, where that is more
    than one: probes then take about the same share of the time on every machine (on a CPU where a drafting step
    costs 2.9 plain steps, the first probe comes after 61 plain steps instead of 32)."""
    extra = jnp.clip(state.costs[1] - 1.0, 1.0, 1024.0)  # bounded: a table pinned for measuring holds 1e6
    return jnp.ceil(state.wait * state.wait.shape[0] * extra).astype(jnp.int32) - state.idle


def probing(state: PolicyState) -> jax.Array:
    """`[B]` whether a sequence has taken as many plain steps in a row as its probe waits for."""
    return steps_to_probe(state) <= 0


def draft_width(
    state: PolicyState, policy: AdaptivePolicy, active: jax.Array, least: jax.Array | None = None
) -> jax.Array:
    """Decision 1, before drafting: scalar index into `choices` of the draft length to draft the next block at,
    the largest any active sequence chose by its history (a probing sequence at least choice 1, each sequence at
    least its `least [B]`, if given); 0: no block."""
    best = best_choice(history_acceptance(state), state.costs, policy.choices)
    best = jnp.where(probing(state), jnp.maximum(best, 1), best)
    if least is not None:
        best = jnp.maximum(best, least)
    return jnp.max(jnp.where(active, best, 0))


def widened(policy: AdaptivePolicy, choice: jax.Array, drafts: jax.Array, n: jax.Array) -> jax.Array:
    """`[B]` the least width (`draft_width`'s `least`) after a step that verified `choices[choice]` = `drafts`
    (scalars) and accepted `n [B]`: for a `narrow` policy, one choice wider for a sequence that accepted every
    draft, else 0. The history knows nothing of the slots past the widths verified, so without this a drafter whose
    blocks are always fully accepted would stay at the width its first estimates chose: a wider block is drafted, and
    decision 2 verifies it as far as the drafter's predictions say it pays. Always 0 for a policy that drafts whole
    blocks: there decision 1 only says whether to draft, by the history alone."""
    if not policy.narrow:
        return jnp.zeros_like(n, jnp.int32)
    full = (drafts > 0) & (n == drafts)
    return jnp.where(full, jnp.minimum(choice + 1, len(policy.choices) - 1), 0).astype(jnp.int32)


def wants_draft(state: PolicyState, policy: AdaptivePolicy, active: jax.Array) -> jax.Array:
    """Scalar: whether any active sequence wants a next block (`draft_width` > 0)."""
    return draft_width(state, policy, active) > 0


def step_choice(
    state: PolicyState,
    policy: AdaptivePolicy,
    confidence: jax.Array,
    active: jax.Array,
    width: jax.Array | int | None = None,
) -> jax.Array:
    """Decision 2, after drafting a block of `choices[width]` slots (None: the drafter's k) with predictions
    `confidence [B, k]`: scalar index into `choices` of the next step's k, at most `width`, the largest any active
    sequence chose (a probing sequence at least choice 1)."""
    best = best_choice(calibrated_acceptance(state, confidence), state.costs, policy.choices, width)
    best = jnp.where(probing(state), jnp.maximum(best, 1), best)
    return jnp.max(jnp.where(active, best, 0))


def observe(
    state: PolicyState,
    policy: AdaptivePolicy,
    confidence: jax.Array,
    drafts: jax.Array,
    n: jax.Array,
    active: jax.Array,
    matched: jax.Array,
) -> PolicyState:
    """Record a verification of `drafts` (scalar, 0 for a plain step) slots predicted `confidence [B, k]`, in
    which `n [B]` drafts were accepted, for the active sequences `[B]`. A block drafted and then not verified
    (decision 2 chose k = 0) is scored at slot 1 by `matched [B]`, whether the plain step's token is its first
    draft: in the history and in the calibration, so that blocks declined for too low a prediction still teach
    the estimates what they would have yielded (counted as rejections, they would stop the drafting of a
    drafter whose predictions are merely too modest, and keep its calibration where it was). A probe after which
    the updated history still wants no block (`best_choice` under the cost table) doubles the sequence's wait for
    the next probe; a verification after which it wants one sets the wait back to `probe_every`."""
    slots = jnp.arange(state.reached.shape[1])
    reached = active[:, None] & (slots < drafts) & (slots <= n[:, None])
    declined = active & state.drafted & (drafts == 0)
    first = declined[:, None] & (slots == 0)
    seen = reached | first
    hit = jnp.where(first, matched[:, None], slots < n[:, None]).astype(jnp.float32)
    decayed = lambda total, value: jnp.where(seen, policy.decay * total + value, total)
    verified = active & (drafts > 0)
    pooled = jnp.stack([jnp.sum(hit * seen, -1), jnp.sum(confidence * seen, -1)], -1)
    calibration = jnp.where(
        (verified | declined)[:, None], policy.decay * state.calibration + pooled, state.calibration
    )
    counted = state._replace(
        reached=decayed(state.reached, 1.0), accepted=decayed(state.accepted, jnp.where(seen, hit, 0.0))
    )
    pays = best_choice(history_acceptance(counted), state.costs, policy.choices) > 0
    failed_probe = verified & probing(state) & ~pays
    wait = jnp.where(failed_probe, jnp.minimum(2 * state.wait, policy.probe_max), state.wait)
    wait = jnp.where(verified & pays, policy.probe_every, wait)
    return counted._replace(
        calibration=calibration,
        idle=jnp.where(active, jnp.where(drafts > 0, 0, state.idle + 1), state.idle),
        wait=wait,
    )


def idled(state: PolicyState, steps: jax.Array) -> PolicyState:
    """`state` after `steps [B]` plain steps whose blocks were not drafted: what as many `observe` calls of such
    steps give (only the plain steps in a row count up)."""
    return state._replace(idle=state.idle + steps)


def remember(state: PolicyState, finished: jax.Array) -> PolicyState:
    """The prior moves `PRIOR_MIX` of the way to the pooled estimates of the sequences that just `finished [B]`
    (unchanged if none did): per slot, their accepted over reached counts; their drafts accepted over predicted."""
    f = finished.astype(jnp.float32)
    pool = lambda x: jnp.sum(f[:, None] * x, 0)  # [B, n] -> [n]
    acceptance = pool(state.accepted) / jnp.maximum(pool(state.reached), 1e-6)
    calibration = pool(state.calibration)
    ratio = calibration[0] / jnp.maximum(calibration[1], 1e-6)
    learned = Prior(acceptance, ratio)
    any_finished = jnp.any(finished)
    moved = lambda new, old: jnp.where(any_finished, old + PRIOR_MIX * (new - old), old)
    return state._replace(prior=jax.tree.map(moved, learned, state.prior))


def pinned_costs(policy: AdaptivePolicy, index: int) -> jax.Array:
    """A cost table under which every step takes choice `index` (for measuring that choice's cost): the
    history decision always drafts (never, for index 0) and the verification always picks it."""
    return jnp.full((len(policy.choices),), 1e6, jnp.float32).at[index].set(1e-6)
