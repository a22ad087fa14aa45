"""The adaptive draft length (`decoding/policy.py`): the policy's arithmetic, lossless outputs whatever it chooses,
a fall-back to plain steps for a useless drafter, and drafter state kept exact across plain steps."""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_speculative import (
    EOS,
    RECIPE,
    TARGET,
    assert_follows,
    bigram_target,
    exact_joint,
    oracle_drafter,
    random_drafter,
)
from test_speculative import (
    prompts as prompts,
)
from test_speculative import (
    target_params as target_params,
)

from hspec_jax.decoding import Bundle, SamplingConfig, generate, pad_batch
from hspec_jax.decoding import costs as cost_model
from hspec_jax.decoding.policy import (
    PRIOR_MIX,
    AdaptivePolicy,
    Prior,
    best_choice,
    draft_width,
    drafting,
    expected_yield,
    first_prior,
    history_acceptance,
    init_policy,
    observe,
    pinned_costs,
    probing,
    remember,
    step_choice,
    steps_to_probe,
    wants_draft,
    widened,
)
from hspec_jax.decoding.speculative import (
    PENDING_ROWS,
    measure_costs,
    spec_decode,
    spec_decode_chunk,
    spec_prefill,
    speculative_generate,
)
from hspec_jax.drafters.dflash import drafter_context
from hspec_jax.models import init_cache
from hspec_jax.models.layers import for_backend, pack_linear_layers
from hspec_jax.recipes import drafter_from_recipe

POLICY = AdaptivePolicy(choices=(0, 1, 2, 4, 7))
CPU_LIKE = jnp.array([1.0, 1.3, 1.45, 1.7, 2.2])  # T(k) / T(0) for k = 0, 1, 2, 4, 7, as on a 2-core CPU
FREE = jnp.array([1.0, 1.0, 1.0, 1.0, 1.0])  # an accelerator at small batch: drafting costs nothing
# The engine compiles one verification per choice; the engine tests below give it three (a plain step, a short and
# the full draft), which take every path of the loop at two thirds of the compilation of the default five.
ENGINE = AdaptivePolicy(choices=(0, 2, 7))
NARROW = dataclasses.replace(ENGINE, narrow=True)  # drafting each block only as far as decision 1 chose
ENGINE_ROWS = jnp.array([POLICY.choices.index(c) for c in ENGINE.choices])  # the same costs for those choices
ENGINE_CPU_LIKE, ENGINE_FREE = CPU_LIKE[ENGINE_ROWS], FREE[ENGINE_ROWS]


def test_choices_and_expected_yield():
    assert AdaptivePolicy.for_drafts(7, "gpu").choices == AdaptivePolicy.for_drafts(7, "tpu").choices == POLICY.choices
    assert AdaptivePolicy.for_drafts(3, "gpu").choices == (0, 1, 2, 3)
    assert AdaptivePolicy.for_drafts(7, "cpu").choices == (0, 3, 7)
    assert AdaptivePolicy.for_drafts(3, "cpu").choices == (0, 3)
    assert AdaptivePolicy.for_drafts(7).choices == (0, 3, 7)  # this suite runs on CPU


def test_auto_cuts_the_drafter_to_the_longest_draft_of_its_platform():
    """On CPU `auto` verifies at most 3 drafts, so the drafter drafts 3 (a cut H-Spec block proposes the same first
    tokens); accelerators keep the drafter's k, and a drafter of fewer drafts is left as it is."""
    drafter = drafter_from_recipe(RECIPE, "hspec", TARGET)
    assert drafter.num_drafts == 7
    cut, policy = AdaptivePolicy.auto_drafting(drafter, "cpu")
    assert cut.num_drafts == 3 and policy.choices == (0, 3) and cut == drafter.with_drafts(3)
    kept, policy = AdaptivePolicy.auto_drafting(drafter, "gpu", probe_every=16)
    assert kept is drafter and policy.choices == (0, 1, 2, 4, 7) and policy.probe_every == 16
    short = drafter.with_drafts(2)
    assert AdaptivePolicy.auto_drafting(short, "cpu") == (short, AdaptivePolicy(choices=(0, 2)))
    assert AdaptivePolicy.auto_drafting(drafter)[0].num_drafts == 3  # this suite runs on CPU
    # As the tools take `--k`: auto is that cut with its policy, a number that draft length, None the drafter's own.
    assert drafting(drafter, "auto") == AdaptivePolicy.auto_drafting(drafter)
    assert drafting(drafter, 2) == (drafter.with_drafts(2), None) and drafting(drafter, None) == (drafter, None)
    a = jnp.array([[0.5, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0]])
    np.testing.assert_allclose(expected_yield(a, POLICY.choices), [[1.0, 1.5, 1.75, 2.25, 3.0]])
    assert int(best_choice(a, CPU_LIKE, POLICY.choices)[0]) == 4  # 3.0 / 2.2 beats 1.5 / 1.3 and 1 / 1
    assert int(best_choice(a * 0.2, CPU_LIKE, POLICY.choices)[0]) == 0  # 1.1 / 1.3 < 1: a plain step
    with pytest.raises(ValueError, match="increase from 0"):
        AdaptivePolicy(choices=(1, 2))
    with pytest.raises(ValueError, match="one per choice"):
        init_policy(POLICY, 1, jnp.ones(3))


def test_an_overconfident_drafter_falls_back_then_probes():
    """Predicts 0.9 everywhere, never accepted: within a dozen steps no sequence drafts, until a probe is due."""
    state = init_policy(POLICY, 2, CPU_LIKE)
    active = jnp.array([True, True])
    confident = jnp.full((2, 7), 0.9)
    assert bool(wants_draft(state, POLICY, active))  # the prior trusts the drafter at first
    assert int(step_choice(state, POLICY, confident, active)) == 4
    steps = 0
    while bool(wants_draft(state, POLICY, active)) or int(step_choice(state, POLICY, confident, active)):
        state = observe(state, POLICY, confident, jnp.int32(7), jnp.zeros(2, jnp.int32), active, jnp.zeros_like(active))
        steps += 1
    assert steps <= 12
    state = state._replace(drafted=~active)  # plain steps from now on: the drafter is not called
    plain = lambda state: observe(
        state, POLICY, confident, jnp.int32(0), jnp.zeros(2, jnp.int32), active, jnp.zeros_like(active)
    )
    for _ in range(2 * POLICY.probe_every - 1):  # a batch of two: each waits twice as long
        state = plain(state)
    assert not bool(wants_draft(state, POLICY, active))
    assert not bool(wants_draft(state, POLICY, active.at[1].set(False)))  # also once the second has finished
    state = plain(state)
    assert bool(wants_draft(state, POLICY, active))
    assert int(step_choice(state, POLICY, confident, active)) == 1  # a probe: the smallest k
    # A probe that is accepted lifts the estimates again.
    state = state._replace(drafted=active)
    for _ in range(3):
        state = observe(state, POLICY, confident, jnp.int32(1), jnp.ones(2, jnp.int32), active, jnp.zeros_like(active))
    assert int(best_choice(state.accepted / state.reached, CPU_LIKE, POLICY.choices)[0]) > 0


def test_drafts_that_are_never_verified_stop_the_drafting():
    """A drafter whose blocks always look hopeless (decision 2 takes k = 0): its drafting buys nothing, so the
    history turns it off within a few steps (no drafter call on plain steps), until a probe is due."""
    state = init_policy(POLICY, 1, CPU_LIKE)
    active, hopeless = jnp.array([True]), jnp.full((1, 7), 0.01)

    def plain_step(state, drafted):  # k = 0, after a block drafted (or not) whose first draft was wrong
        none = jnp.zeros(1, jnp.int32)
        return observe(state._replace(drafted=drafted), POLICY, hopeless, jnp.int32(0), none, active, ~active)

    steps = 0
    while bool(wants_draft(state, POLICY, active)):
        assert int(step_choice(state, POLICY, hopeless, active)) == 0
        state = plain_step(state, active)
        steps += 1
    assert 1 <= steps <= 12
    plain = plain_step(state, ~active)
    np.testing.assert_array_equal(plain.reached, state.reached)  # a plain step without a draft: nothing learnt


def test_declined_blocks_whose_first_draft_was_right_keep_the_drafting_and_raise_the_calibration():
    """A drafter too modest about its blocks (predicts 0.1, so decision 2 declines them) whose first draft is the
    target's next token every time: the declined blocks count as hits, so the history keeps drafting and the
    calibration ratio climbs until its blocks are verified again. The same blocks scored as misses stop it."""
    state = init_policy(POLICY, 1, CPU_LIKE)
    active, modest, none = jnp.array([True]), jnp.full((1, 7), 0.1), jnp.zeros(1, jnp.int32)

    def declined(state, matched):
        assert int(step_choice(state, POLICY, modest, active)) == 0
        return observe(state._replace(drafted=active), POLICY, modest, jnp.int32(0), none, active, matched)

    missed = state
    for _ in range(6):
        missed = declined(missed, ~active)
    assert not bool(wants_draft(missed, POLICY, active))
    steps = 0
    while int(step_choice(state, POLICY, modest, active)) == 0:
        assert bool(wants_draft(state, POLICY, active))
        state = declined(state, active)
        steps += 1
    assert 1 <= steps <= 16
    assert float(history_acceptance(state)[0, 0]) > POLICY.prior


def test_failed_probes_wait_longer_and_a_paying_draft_resets_the_wait():
    """A drafter known to be useless (a prior of zero acceptance): plain steps from the start; each probe after
    which drafting still does not pay doubles the wait for the next, up to `probe_max`, also one with a draft
    accepted; probes accepted until drafting pays set it back."""
    state = init_policy(POLICY, 1, CPU_LIKE, Prior(jnp.zeros(7), jnp.float32(0.0)))
    active, confident, none = jnp.array([True]), jnp.full((1, 7), 0.9), jnp.zeros(1, jnp.int32)
    state = state._replace(drafted=~active)

    def wait_for_probe(state):
        plain = 0
        while not bool(wants_draft(state, POLICY, active)):
            state = observe(state, POLICY, confident, jnp.int32(0), none, active, jnp.zeros_like(active))
            plain += 1
        assert int(step_choice(state, POLICY, confident, active)) == 1  # a probe: the smallest k
        return state._replace(drafted=active), plain

    waits = []
    for _ in range(5):
        state, plain = wait_for_probe(state)
        waits.append(plain)
        state = observe(state, POLICY, confident, jnp.int32(1), none, active, jnp.zeros_like(active))._replace(
            drafted=~active
        )
    assert waits == [32, 64, 128, 256, 256]
    one = jnp.ones(1, jnp.int32)
    probe_due = dict(wait=jnp.full(1, 64, jnp.int32), idle=jnp.full(1, 64, jnp.int32))
    state = observe(state._replace(**probe_due), POLICY, confident, jnp.int32(1), one, active, jnp.zeros_like(active))
    assert not bool(wants_draft(state, POLICY, active))  # one hit after five misses: slot 1 at ~0.3, not worth it
    assert int(state.wait[0]) == 128
    for _ in range(3):  # hits until the history says drafting pays
        state = observe(
            state._replace(idle=state.wait), POLICY, confident, jnp.int32(1), one, active, jnp.zeros_like(active)
        )
    assert bool(wants_draft(state, POLICY, active))
    assert int(state.wait[0]) == POLICY.probe_every
    with pytest.raises(ValueError, match="probe_every <= probe_max"):
        AdaptivePolicy(probe_every=64, probe_max=32)


def test_probes_wait_longer_where_a_probe_costs_more_than_two_plain_steps():
    """The wait for a probe scales with what a probe costs beyond its one sure token, T(smallest k) - 1 plain steps,
    where that exceeds one; a batch of B waits B times as long; a table pinned for measuring stays in range."""
    policy = AdaptivePolicy(choices=(0, 4, 7))
    prior = Prior(jnp.zeros(7), jnp.float32(0.0))
    for costs, batch, expected in [((1.0, 2.9, 3.0), 1, 61), ((1.0, 1.8, 2.0), 1, 32), ((1.0, 2.9, 3.0), 2, 122)]:
        state = init_policy(policy, batch, jnp.array(costs), prior)
        np.testing.assert_array_equal(steps_to_probe(state), expected)
        state = state._replace(idle=jnp.full(batch, expected - 1, jnp.int32))
        assert not bool(probing(state).any())
        assert bool(probing(state._replace(idle=state.idle + 1)).all())
    pinned = init_policy(policy, 4, pinned_costs(policy, 0), prior)
    pinned = pinned._replace(wait=jnp.full(4, policy.probe_max, jnp.int32))
    assert int(steps_to_probe(pinned)[0]) == policy.probe_max * 4 * 1024


def test_a_new_sequence_starts_from_what_finished_ones_learnt():
    """Two sequences, one whose drafts are never accepted and one whose are always: the prior moves towards the
    pooled estimates of whichever finished (a quarter of the way per finish), and a sequence started from it trusts
    the drafter accordingly."""
    state = init_policy(POLICY, 2, CPU_LIKE)
    active, confident = jnp.array([True, True]), jnp.full((2, 7), 0.9)
    for _ in range(12):
        state = observe(state, POLICY, confident, jnp.int32(7), jnp.array([0, 7]), active, jnp.zeros_like(active))
    kept = remember(state, jnp.array([False, False])).prior
    for mine, first in zip(kept, first_prior(POLICY), strict=True):
        np.testing.assert_array_equal(np.asarray(mine), np.asarray(first))

    def finishing(which, times):  # `times` sequences like `which` finish one after another
        prior = state.prior
        for _ in range(times):
            prior = remember(state._replace(prior=prior), jnp.array(which)).prior
        return prior

    # One finish moves the prior a quarter of the way (`PRIOR_MIX`) to the finished sequence's estimates.
    pooled = state.accepted[0] / state.reached[0]
    start = first_prior(POLICY).acceptance
    once = finishing([True, False], 1).acceptance
    np.testing.assert_allclose(once, start + PRIOR_MIX * (pooled - start), rtol=1e-6)
    assert once[0] - pooled[0] > 0.5 * (start[0] - pooled[0])  # less than half the way: one text does not decide
    useless = finishing([True, False], 16)
    assert float(useless.acceptance[0]) < 0.15 and float(useless.ratio) < 0.3
    good = finishing([False, True], 16)
    assert float(good.acceptance.min()) > 0.7 and float(good.ratio) > 1.0
    one = jnp.array([True])
    after_useless = init_policy(POLICY, 1, CPU_LIKE, useless)
    assert not bool(wants_draft(after_useless, POLICY, one))
    assert int(step_choice(after_useless, POLICY, confident[:1], one)) == 0
    after_good = init_policy(POLICY, 1, CPU_LIKE, good)
    assert int(step_choice(after_good, POLICY, confident[:1], one)) == 4  # k = 7
    # A new sequence's first probe comes after `probe_every` plain steps, however long the finished ones waited.
    waited = remember(state._replace(wait=jnp.array([128, 64], jnp.int32)), jnp.array([True, True])).prior
    np.testing.assert_array_equal(np.asarray(init_policy(POLICY, 2, CPU_LIKE, waited).wait), [32, 32])
    with pytest.raises(ValueError, match="one per draft"):
        init_policy(POLICY, 1, CPU_LIKE, Prior(jnp.zeros(3), jnp.float32(1.0)))


def test_batch_takes_the_largest_choice_of_active_sequences():
    state = init_policy(POLICY, 3, CPU_LIKE)
    confidence = jnp.stack([jnp.full(7, 0.05), jnp.full(7, 0.4), jnp.full(7, 0.99)])
    active = jnp.array([True, True, True])
    assert int(step_choice(state, POLICY, confidence, active)) == 4  # k = 7, the third sequence's
    assert int(step_choice(state, POLICY, confidence, active.at[2].set(False))) in (1, 2)
    assert int(step_choice(state, POLICY, confidence, jnp.array([True, False, False]))) == 0


def test_a_block_is_drafted_as_wide_as_the_history_wants_and_wider_after_every_draft_was_accepted():
    state = init_policy(POLICY, 2, CPU_LIKE)  # the prior: slot acceptance 0.5, under which k = 2 pays best
    active = jnp.array([True, True])
    width = int(draft_width(state, POLICY, active))
    assert POLICY.choices[width] == 2
    confident = jnp.full((2, 7), 0.99)
    assert int(step_choice(state, POLICY, confident, active)) == 4  # a block of 7 so confident would verify all 7
    assert int(step_choice(state, POLICY, confident, active, width)) == width  # a block of 2 verifies at most 2
    assert int(step_choice(state, POLICY, jnp.full((2, 7), 0.05), active, width)) == 0  # or declines it
    # After a step that verified k = 2, a narrow policy drafts the next block of the sequence that accepted both one
    # choice wider.
    narrow = dataclasses.replace(POLICY, narrow=True)
    least = widened(narrow, jnp.int32(width), jnp.int32(2), jnp.array([2, 1]))
    assert least.tolist() == [width + 1, 0]
    assert int(draft_width(state, POLICY, active, least)) == width + 1
    assert int(draft_width(state, POLICY, active.at[0].set(False), least)) == width
    assert widened(narrow, jnp.int32(4), jnp.int32(7), jnp.array([7, 7])).tolist() == [4, 4]  # none wider than k
    assert widened(narrow, jnp.int32(0), jnp.int32(0), jnp.array([0, 0])).tolist() == [0, 0]  # a plain step
    # A policy drafting whole blocks (the default) is not widened: a full acceptance does not make it draft.
    assert widened(POLICY, jnp.int32(width), jnp.int32(2), jnp.array([2, 1])).tolist() == [0, 0]


def generate_auto(target, params, config, vocab, prompts, costs, policy=ENGINE, **kw):
    tokens, lengths = pad_batch(prompts)
    return speculative_generate(
        Bundle(target, TARGET, params, config, vocab),
        jnp.asarray(tokens),
        jnp.asarray(lengths),
        policy=policy,
        costs=costs,
        **kw,
    )


# The policy's code paths differ by whether the drafter keeps its own cache (DFlash: plain steps inject their rows)
# and has a Markov + confidence head (DSpark), and by whether blocks are drafted narrow (DFlash's injection with a cut
# block); the other kinds are variants of these three inside their families, and every kind is checked lossless at a
# fixed k in tests/test_speculative.py.
@pytest.mark.parametrize("kind,policy", [("hspec", ENGINE), ("dflash", ENGINE), ("dspark", ENGINE), ("dflash", NARROW)])
def test_auto_is_lossless_and_a_random_drafter_decodes_plainly(kind, policy, target_params, prompts):
    tokens, lengths = pad_batch(prompts)
    config, params, vocab = random_drafter(kind, target_params, np.concatenate(prompts))
    ar = generate(target_params, TARGET, jnp.asarray(tokens), jnp.asarray(lengths), max_new_tokens=60, eos_ids=(EOS,))
    kw = dict(max_new_tokens=60, eos_ids=(EOS,), policy=policy)
    for costs in (ENGINE_FREE, ENGINE_CPU_LIKE):
        spec = generate_auto(target_params, params, config, vocab, prompts, costs, **kw)
        np.testing.assert_array_equal(np.asarray(spec.num_tokens), np.asarray(ar.num_tokens))
        np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(ar.tokens))
    chosen = np.asarray(spec.stats.chosen).sum(0)
    assert chosen[0] >= 0.8 * chosen.sum(), chosen  # under CPU-like costs: mostly plain steps
    # Every verified block was drafted, and no step drafted twice.
    verified, drafted = np.asarray(spec.stats.chosen)[:, 1:].sum(1), np.asarray(spec.stats.drafted)
    assert np.all(verified <= drafted) and np.all(drafted <= np.asarray(spec.stats.steps)), (verified, drafted)
    # The next generation starts from what this one learnt: it trusts the drafter less than the first did.
    assert float(spec.prior.acceptance[0]) < ENGINE.prior
    programs = spec_prefill._cache_size()
    again = generate_auto(target_params, params, config, vocab, prompts, ENGINE_CPU_LIKE, prior=spec.prior, **kw)
    assert spec_prefill._cache_size() == programs  # a learnt prior runs the program the first one compiled
    np.testing.assert_array_equal(np.asarray(again.tokens), np.asarray(ar.tokens))
    drafted = lambda gen: int(np.asarray(gen.stats.chosen)[:, 1:].sum())
    # Fewer drafting steps, unless the first generation drafted no more than one probe per sequence anyway.
    first, second = drafted(spec), drafted(again)
    assert second < first or second == first <= len(prompts), (second, first)


@pytest.mark.parametrize("kind,narrow", [("hspec", False), ("dspark", False), ("hspec", True)])
def test_auto_drafts_far_with_a_good_drafter(kind, narrow, target_params, prompts):
    """Whether each block is drafted as far as decision 1 chose (then one choice wider after a block accepted whole)
    or to the drafter's k (then verified as far as its predictions say it pays)."""
    target = bigram_target(target_params, 0.01)
    config, params, vocab = oracle_drafter(kind, target)
    tokens, lengths = pad_batch(prompts)
    ar = generate(target, TARGET, jnp.asarray(tokens), jnp.asarray(lengths), max_new_tokens=40)
    policy = dataclasses.replace(ENGINE, narrow=narrow)
    spec = generate_auto(target, params, config, vocab, prompts, ENGINE_CPU_LIKE, max_new_tokens=40, policy=policy)
    np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(ar.tokens))
    assert spec.stats.tau() > 3.0
    assert int(np.asarray(spec.stats.chosen)[:, -1].sum()) > 0  # k = 7 chosen


@pytest.mark.parametrize("costs", [pinned_costs(ENGINE, 0), ENGINE_CPU_LIKE])
def test_auto_sampled_outputs_follow_the_target_distribution(costs, target_params):
    """Plain steps only, then the policy's own mix of draft lengths: the joint of 3 tokens is the target's."""
    target = bigram_target(target_params, 0.03)
    config, params, vocab = oracle_drafter("hspec", target, noise=0.5)
    sampling = SamplingConfig(temperature=1.0, top_k=3)
    prompt, n, length = [7, 19, 33, 41, 5], 6000, 3
    spec = generate_auto(
        target,
        params,
        config,
        vocab,
        [prompt] * n,
        costs,
        max_new_tokens=length,
        sampling=sampling,
        rng=jax.random.key(13),
    )
    assert_follows(np.asarray(spec.tokens), exact_joint(target, prompt, sampling, length))


def prefill_at_width_48(bundle, capacity=64, **kw):
    """`spec_prefill` of one prompt into fresh caches of `capacity` rows, padded to width 48 (one compiled program
    for every prompt), under the cost table `costs` (default ENGINE_CPU_LIKE)."""

    def prefill(tokens, costs=ENGINE_CPU_LIKE):
        caches = (init_cache(TARGET, 1, capacity), drafter_context(bundle.drafter, 1, capacity))
        padded, lengths = pad_batch([tokens], length=48)
        return spec_prefill(bundle, jnp.asarray(padded), jnp.asarray(lengths), *caches, jax.random.key(0), costs, **kw)

    return prefill


def test_h_spec_drafts_no_first_block_when_the_prior_wants_none(target_params, prompts):
    """Prefill drafts the first block when the prior trusts the drafter; started from a prior that learnt it is
    useless, H-Spec skips that drafter call (the first step is a plain one, ready for the inner plain loop)."""
    config, params, vocab = random_drafter("hspec", target_params, np.concatenate(prompts))
    bundle = Bundle(target_params, TARGET, params, config, vocab)
    kw = dict(max_new_tokens=32, policy=ENGINE)
    trusting = prefill_at_width_48(bundle, **kw)(prompts[1])[0]
    assert bool(trusting.policy.drafted[0])
    useless = Prior(jnp.zeros(7), jnp.float32(0.0))
    skipped = prefill_at_width_48(bundle, prior=useless, **kw)(prompts[1])[0]
    assert not bool(skipped.policy.drafted[0]) and int(skipped.choice) == 0
    assert int(trusting.stats.drafted[0]) == 1 and int(skipped.stats.drafted[0]) == 0
    assert not np.asarray(skipped.confidence).any()


@pytest.mark.parametrize("kind", ["hspec", "dflash"])
def test_a_block_is_drafted_only_as_far_as_it_may_be_verified(kind, target_params, prompts):
    """Under the CPU-like costs the prior's estimates choose k = 2 of (0, 2, 7): a `narrow` policy's first block is
    the drafter's block cut to 2 drafts (for the bidirectional DFlash, unlike the first 2 slots of a block of 7),
    its other slots empty, and at most k = 2 is verified; otherwise all 7 are drafted."""
    config, params, vocab = random_drafter(kind, target_params, np.concatenate(prompts))
    bundle = Bundle(target_params, TARGET, params, config, vocab)
    state = prefill_at_width_48(bundle, max_new_tokens=32, policy=NARROW)(prompts[1])[0]
    assert bool(state.policy.drafted[0]) and int(state.choice) <= 1
    assert not np.asarray(state.draft)[:, 2:].any() and not np.asarray(state.confidence)[:, 2:].any()
    narrow = Bundle(target_params, TARGET, params, config.with_drafts(2), vocab)
    fixed = prefill_at_width_48(narrow, max_new_tokens=32)(prompts[1])[0]  # a fixed k = 2, no policy
    np.testing.assert_array_equal(np.asarray(state.draft)[:, :2], np.asarray(fixed.draft))
    np.testing.assert_allclose(np.asarray(state.confidence)[:, :2], np.asarray(fixed.confidence), rtol=1e-5)
    wide = prefill_at_width_48(bundle, max_new_tokens=32, policy=ENGINE)
    assert np.asarray(wide(prompts[1])[0].confidence).all()


def test_blocks_are_drafted_whole_unless_the_policy_is_narrow():
    for platform in ("cpu", "gpu", "tpu"):
        policy = AdaptivePolicy.for_drafts(7, platform)
        assert not policy.narrow and policy.draft_widths == (len(policy.choices) - 1,)
        assert int(policy.drafted(jnp.int32(1))) == len(policy.choices) - 1 and int(policy.drafted(jnp.int32(0))) == 0
    narrow = AdaptivePolicy.for_drafts(7, "cpu", narrow=True)
    assert narrow.choices == (0, 3, 7) and narrow.draft_widths == (1, 2) and int(narrow.drafted(jnp.int32(1))) == 1


def assert_same_drafter_rows(context, fresh_context, committed):
    for mine, theirs in zip(jax.tree.leaves(context), jax.tree.leaves(fresh_context), strict=True):
        np.testing.assert_allclose(np.asarray(mine)[:, :committed], np.asarray(theirs)[:, :committed], atol=1e-4)


@pytest.mark.parametrize("kind", ["hspec", "dflash"])
def test_drafter_state_after_plain_steps_is_what_a_fresh_prefill_gives(kind, target_params, prompts):
    """Plain steps skip the drafter, yet the next draft (and DFlash's own cache rows) equal those of a prefill
    of the whole committed text: H-Spec's seed is the last committed row; DFlash keeps plain steps' rows pending,
    injects them once `PENDING_ROWS` wait and the rest with the next drafting step's."""
    config, params, vocab = random_drafter(kind, target_params, np.concatenate(prompts))
    prompt, plain_steps = prompts[1], PENDING_ROWS + 2
    kw = dict(max_new_tokens=32, policy=ENGINE)
    bundle = Bundle(target_params, TARGET, params, config, vocab)
    prefill = prefill_at_width_48(bundle, **kw)
    state, cache, context = prefill(prompt)
    state = state._replace(choice=jnp.int32(0), policy=state.policy._replace(costs=pinned_costs(ENGINE, 0)))
    state, cache, context = spec_decode_chunk(bundle, state, cache, context, plain_steps, **kw)
    assert int(state.num[0]) == plain_steps + 1
    # One more plain step, after which the policy drafts (a free cost table for k = 7).
    state = state._replace(policy=state.policy._replace(costs=pinned_costs(ENGINE, 2)))
    state, cache, context = spec_decode_chunk(bundle, state, cache, context, 1, **kw)
    emitted = [int(t) for t in np.asarray(state.tokens[0, : int(state.num[0])])]
    fresh, fresh_cache, fresh_context = prefill(prompt + emitted[:-1], pinned_costs(ENGINE, 2))  # drafts all 7 too
    assert int(fresh.anchor[0]) == emitted[-1] == int(state.anchor[0])
    np.testing.assert_array_equal(np.asarray(state.draft), np.asarray(fresh.draft))
    np.testing.assert_allclose(np.asarray(state.seed), np.asarray(fresh.seed), atol=1e-4)
    committed = int(cache.lengths[0])
    assert committed == int(fresh_cache.lengths[0])
    assert_same_drafter_rows(context, fresh_context, committed)


def test_a_decode_of_plain_steps_hands_back_every_committed_dflash_row(target_params, prompts):
    """DFlash under a policy that never drafts: the rows still pending when the loop ends are injected before
    `spec_decode` returns, so its drafter cache equals that of a prefill of the whole text."""
    config, params, vocab = random_drafter("dflash", target_params, np.concatenate(prompts))
    prompt, kw = prompts[1], dict(max_new_tokens=32, policy=ENGINE)
    bundle = Bundle(target_params, TARGET, params, config, vocab)
    prefill = prefill_at_width_48(bundle, **kw)
    state, cache, context = prefill(prompt, pinned_costs(ENGINE, 0))
    gen = spec_decode(bundle, state._replace(choice=jnp.int32(0)), cache, context, **kw)
    emitted = [int(t) for t in np.asarray(gen.tokens[0, : int(gen.num_tokens[0])])]
    assert len(emitted) == 32 and int(gen.stats.chosen[0, 0]) == 31  # all plain: 31 steps after the first token
    assert 31 % PENDING_ROWS  # some rows are still pending at the end
    _, fresh_cache, fresh_context = prefill(prompt + emitted[:-1])
    assert int(gen.cache.lengths[0]) == int(fresh_cache.lengths[0]) == len(prompt) + 31
    assert_same_drafter_rows(gen.context, fresh_context, len(prompt) + 31)


def test_costs_are_measured_once_per_machine_and_shape(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(cost_model, "ROUNDS", 3)
    calls = []

    def measure(index):
        calls.append(index)
        return [0.01, 0.013, 0.012][index]

    shape = {"target": "t", "batch": 1}
    first = cost_model.step_costs(shape, (0, 1, 3), measure)
    np.testing.assert_allclose(first, [1.0, 1.3, 1.3], rtol=1e-6)  # never cheaper for a longer draft
    again = cost_model.step_costs(shape, (0, 1, 3), measure)
    np.testing.assert_allclose(again, first)
    assert calls == [0, 1, 2, 1, 2, 0, 2, 0, 1]  # interleaved rounds, the order rotated
    assert len(list((tmp_path / "hspec_jax" / "costs").glob("*.json"))) == 1
    cost_model.step_costs({**shape, "batch": 2}, (0, 1, 3), measure)
    assert len(calls) == 18
    monkeypatch.setattr(cost_model, "ROUNDS", 5)  # what eval.cost_tables does for its reference
    cost_model.step_costs({**shape, "batch": 3}, (0, 1, 3), measure)
    assert len(calls) == 18 + 15


def test_costs_are_measured_in_one_running_generation(tmp_path, monkeypatch):
    """Every reading swaps its pinned table into the live loop state (with a fresh idle count, so a plain reading
    never probes) and takes one untimed step to change width first: one prefill serves every reading until the
    generation ends, and then a fresh one starts (also when the untimed step ends it: a timed run of a finished
    generation times nothing, and read a plain step at 1 ms)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    policy = AdaptivePolicy.for_drafts(7, "cpu")
    steps, readings = cost_model.MEASURED_STEPS, len(policy.choices) * (cost_model.ROUNDS + 1)  # + 1 warm-up each

    def measure(ends_after: int):
        runs, prefills = [], []

        def prefill(costs):
            prefills.append(int(jnp.argmin(costs)))
            return State(jnp.int32(0), jnp.zeros(1, bool), init_policy(policy, 1, costs)), "cache"

        def chunk(carry, n):
            state, cache = carry
            assert cache == "cache" and int(state.policy.idle[0]) + n < policy.probe_every  # no probe
            assert n != steps or not bool(state.done.all())  # never a timed run of a finished generation
            runs.append((int(jnp.argmin(state.policy.costs)), n))
            step, idle = state.step + n, state.policy.idle + n  # as if every step were plain
            state = state._replace(step=step, done=jnp.full(1, int(step) >= ends_after))
            return state._replace(policy=state.policy._replace(idle=idle)), cache

        measure_costs(prefill, chunk, policy, {"test": ends_after})
        return runs, prefills

    runs, prefills = measure(10_000)
    assert prefills == [0]  # round 0 starts at choice 0
    timed = [choice for choice, n in runs if n == steps]
    assert len(timed) == readings and [timed.count(c) for c in range(3)] == [cost_model.ROUNDS + 1] * 3
    assert [n for _, n in runs] == [steps] + [1, steps] * (readings - 1)  # the width changes before each reading
    assert all(a == b for (a, _), (b, _) in zip(runs[1::2], runs[2::2], strict=True))  # ... to the pinned one
    runs, prefills = measure(2 * steps + 1)  # ends with every second reading: a fresh prefill before the next one
    assert len(prefills) == (readings + 1) // 2 and len(runs) == readings + (readings - len(prefills))
    runs, prefills = measure(steps + 1)  # the untimed step ends it: a fresh prefill, then the timed run
    assert len(prefills) == readings and [n for _, n in runs] == [steps] + [1, steps] * (readings - 1)


class State(NamedTuple):
    step: jax.Array
    done: jax.Array
    policy: object


def test_costs_are_the_median_of_each_rounds_ratios():
    """Each round's readings are taken relative to that round's plain step, and each choice keeps the median over
    rounds: a slow spell of the machine (round 2 runs at 1.5x) cancels in its ratios, and a burst of noise that
    hits one reading (round 3's choice 2) is one ratio the median drops."""
    readings = iter([1.0, 2.0, 3.0, 3.0, 4.5, 1.5, 6.0, 1.0, 2.0])  # round r starts at choice r, as rotated
    rounds = cost_model.interleaved(3, lambda i: next(readings), 3)
    assert rounds == [[1.0, 2.0, 3.0], [1.5, 3.0, 4.5], [1.0, 2.0, 6.0]]
    np.testing.assert_allclose(cost_model.relative(rounds), [1.0, 2.0, 3.0])
    # The minimum of each choice would have said [1.0, 2.0, 3.0] too, but a fast reading of one choice alone moves it:
    np.testing.assert_allclose(cost_model.relative([[1.0, 2.0, 3.0], [1.0, 1.4, 3.0], [1.0, 2.0, 3.0]]), [1, 2, 3])


def test_one_table_serves_every_cache_size_of_a_bucket():
    shape = lambda capacity: cost_model.engine_shape("t", "d", "s", 1, capacity, ())
    assert shape(80) == shape(100) == shape(128) != shape(129)


def test_params_packed_for_the_cpu_kernel_have_their_own_table(target_params):
    """Packed linear layers run at other speeds than XLA's dots: a table measured on one never serves the other."""
    shape = lambda params: cost_model.engine_shape("t", "d", "s", 1, 128, params)
    unpacked, packed = (
        for_backend(target_params, pack=False),
        pack_linear_layers(for_backend(target_params, pack=False)),
    )
    assert shape(unpacked) == shape(jax.tree.map(lambda x: x + 1, unpacked)) != shape(packed)


def test_speculative_generate_measures_costs_when_not_given(tmp_path, monkeypatch, target_params, prompts):
    """Without a cost table the adaptive engine measures one, records it, and stays lossless (the settings of
    the H-Spec lossless test above, so its compiled programs are reused)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    config, params, vocab = random_drafter("hspec", target_params, np.concatenate(prompts))
    kw = dict(max_new_tokens=60, eos_ids=(EOS,))
    spec = generate_auto(target_params, params, config, vocab, prompts, None, **kw)
    (record,) = (tmp_path / "hspec_jax" / "costs").glob("*.json")
    assert '"costs"' in record.read_text()
    ar = generate(target_params, TARGET, *(jnp.asarray(x) for x in pad_batch(prompts)), **kw)
    np.testing.assert_array_equal(np.asarray(spec.tokens), np.asarray(ar.tokens))
