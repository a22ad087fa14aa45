"""Serving: the paged pool's allocator and accessors, and continuous batching that is lossless under greedy
decoding (every request's answer equals decoding it alone) for plain decoding and the drafter families, with
requests arriving while others decode, long prompts prefilled in chunks, and preemption when the pool runs out."""

import argparse
import dataclasses
import importlib
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from peaked import peaked

from eval import serving as eval_serving
from hspec_jax.cli import run
from hspec_jax.decoding import Bundle, generate, pad_batch
from hspec_jax.decoding import costs as cost_model
from hspec_jax.decoding.policy import AdaptivePolicy
from hspec_jax.drafters import init_drafter, init_from_target
from hspec_jax.drafters.vocab import build_draft_vocab
from hspec_jax.models import init_cache, init_params
from hspec_jax.models.layers import for_backend
from hspec_jax.recipes import drafter_from_recipe, target_config
from hspec_jax.serving import (
    NULL_PAGE,
    PageAllocator,
    Request,
    ServingConfig,
    ServingEngine,
    page_bytes,
    paged_cache,
)

RECIPE = importlib.import_module("configs.tiny").get_config()
TARGET = target_config(RECIPE)
EOS = 37  # a stop id some of the greedy answers below reach (the others run to MAX_NEW)
MAX_NEW = 20


def test_allocator_never_leaks_or_shares_pages():
    rng = np.random.default_rng(0)
    alloc = PageAllocator(num_pages=17, slots=4, max_pages=6, page_size=4)
    refused = 0
    for _ in range(2000):
        slot = int(rng.integers(4))
        if rng.random() < 0.3:
            alloc.release(slot)
        else:
            before = (list(alloc.held[slot]), list(alloc.free))
            rows = int(rng.integers(1, 30))
            if not alloc.grow(slot, rows):
                refused += 1
                assert (alloc.held[slot], alloc.free) == before  # all or nothing
            else:
                assert len(alloc.held[slot]) * 4 >= rows
        alloc.check()
        assert alloc.used == sum(len(p) for p in alloc.held) <= alloc.usable == 16
    assert refused > 0  # exhaustion (pool or table) was exercised
    for slot in range(4):
        alloc.release(slot)
    alloc.check()
    assert alloc.used == 0 and NULL_PAGE not in alloc.free


def test_paged_cache_reads_what_the_dense_cache_reads():
    """Rows written through the page table read back (dense view) exactly as from the dense cache."""
    pages, page = 9, 4
    cache = paged_cache(TARGET, 2, pages, page, max_pages=4)
    alloc = PageAllocator(pages, 2, 4, page)
    alloc.grow(1, 10)  # slot 1 first, so slot 0's pages are not the lowest ids
    alloc.grow(0, 14)
    cache = cache.replace(page_table=jnp.asarray(alloc.table))
    dense = init_cache(TARGET, 2, 16)
    write = jax.jit(lambda c, k, v, starts: c.write(3, k, v, starts))
    rng = np.random.default_rng(1)
    for starts, t in (((0, 0), 6), ((6, 6), 5)):
        k = jnp.asarray(rng.normal(size=(2, t, TARGET.num_kv_heads, TARGET.head_dim)), jnp.float32)
        v = k * 2.0
        starts = jnp.asarray(starts, jnp.int32)
        cache, dense = write(cache, k, v, starts), write(dense, k, v, starts)
    for paged_rows, dense_rows in zip(cache.layer(3), dense.layer(3), strict=True):
        np.testing.assert_array_equal(np.asarray(paged_rows[0, :11]), np.asarray(dense_rows[0, :11]))
        np.testing.assert_array_equal(np.asarray(paged_rows[1, :10]), np.asarray(dense_rows[1, :10]))
    assert float(jnp.abs(cache.k[3][np.asarray(alloc.free)]).sum()) == 0  # nothing written into unallocated pages


def test_a_page_costs_the_rows_of_every_layer_that_keeps_kv():
    row = 2 * TARGET.num_kv_heads * TARGET.head_dim * 4  # K and V of one layer, fp32
    assert page_bytes(TARGET, None, 16) == (16 * TARGET.num_layers * row, 0)
    for kind, drafter_layers in (("hspec", 0), ("dflash_target_kv", 0), ("dflash", 5), ("dspark", 5)):
        config = drafter_from_recipe(RECIPE, kind, TARGET)
        assert page_bytes(TARGET, config, 16) == (16 * TARGET.num_layers * row, 16 * drafter_layers * row), kind


@pytest.fixture(scope="module")
def target_params():
    params = init_params(TARGET, jax.random.key(0))
    return peaked(params, 4.0)  # peaked: greedy far from ties


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    return [tuple(int(x) for x in rng.integers(4, TARGET.vocab_size, n)) for n in (5, 23, 9, 14, 3, 19)]


@pytest.fixture(scope="module")
def alone(target_params, prompts):
    """Plain greedy decoding of each request alone (one padded width and capacity: one compilation)."""
    answers = []
    for prompt in prompts:
        tokens, lengths = pad_batch([list(prompt)], length=32)
        out = generate(
            target_params,
            TARGET,
            jnp.asarray(tokens),
            jnp.asarray(lengths),
            max_new_tokens=MAX_NEW,
            eos_ids=(EOS,),
            cache_capacity=64,
        )
        answers.append(np.asarray(out.tokens[0, : int(out.num_tokens[0])]))
    return answers


def served_bundle(kind, target_params, prompts):
    if kind == "plain":
        return Bundle(target_params, TARGET)
    config = drafter_from_recipe(RECIPE, kind, TARGET)
    vocab = build_draft_vocab(np.concatenate(prompts), TARGET.vocab_size, config.vocab_size, always=(EOS,))
    params = init_from_target(init_drafter(config, jax.random.key(1)), config, target_params, vocab)
    return Bundle(target_params, TARGET, params, config, vocab)


def small_pool_config(bundle: Bundle, prompts, policy=None) -> ServingConfig:
    """Two slots, prompts longer than a prefill chunk, a pool for one full request and a bit (two must preempt)."""
    page = 4
    one_request = -(-(max(map(len, prompts)) + MAX_NEW + bundle.lookahead) // page)
    return ServingConfig(
        slots=2,
        num_pages=one_request + 5,
        page_size=page,
        max_prompt_tokens=24,
        max_new_tokens=MAX_NEW,
        prefill_chunk=8,
        steps_per_iteration=2,
        eos_ids=(EOS,),
        policy=policy,
    )


# Cheap drafting at first (T(k) / T(0) from 1.0 for the shortest draft to 1.2 for the longest), so that an adaptive
# engine mixes draft lengths before it falls back to plain steps.
adaptive_costs = lambda policy: np.array([1.0, *np.linspace(1.0, 1.2, len(policy.choices) - 1)], np.float32)


@pytest.mark.parametrize(
    "kind,adaptive", [("plain", False), ("hspec", False), ("dflash", False), ("hspec", True), ("dflash", True)]
)
def test_continuous_batching_is_lossless(kind, adaptive, target_params, prompts, alone):
    """Two slots, six requests arriving over time, prompts longer than a prefill chunk, and a pool too small for
    two full requests (preemption): every answer equals plain decoding of the request alone, with a fixed k or
    the adaptive draft length."""
    bundle = served_bundle(kind, target_params, prompts)
    policy = AdaptivePolicy.for_drafts(bundle.drafter.num_drafts) if adaptive else None
    costs = adaptive_costs(policy) if adaptive else None
    engine = ServingEngine(bundle, small_pool_config(bundle, prompts, policy), costs=costs)
    assert engine.submit(Request("too-long", (5,) * 25)).refused.startswith("prompt of 25 tokens exceeds")
    done = {}
    arrivals = {0: [0, 1], 2: [2], 3: [3], 6: [4, 5]}  # iteration -> requests submitted then
    iteration = 0
    while engine.busy or iteration <= max(arrivals):
        for i in arrivals.get(iteration, []):
            assert engine.submit(Request(f"r{i}", prompts[i])) is None
        for c in engine.step():
            done[c.request.id] = c
        engine.allocator.check()
        iteration += 1
    assert engine.allocator.used == 0 and engine.running == 0
    assert engine.preemptions > 0
    assert max(engine.occupancy) <= engine.allocator.usable
    assert max(map(len, alone)) == MAX_NEW > min(map(len, alone))  # answers stop at the limit and at EOS
    for i in range(len(prompts)):
        c = done[f"r{i}"]
        np.testing.assert_array_equal(c.tokens, alone[i], err_msg=f"request r{i}")
        assert c.first_token is not None and c.submitted <= c.first_token <= c.finished
        assert sum(n for _, n in c.bursts) == len(c.tokens)
        if bundle.drafter is not None:
            assert c.steps >= 1 and 0 <= c.accepted <= c.steps * bundle.drafter.num_drafts
    if adaptive:
        chosen = np.asarray(engine.state.stats.chosen).sum(0)
        assert chosen[0] > 0 and chosen[1:].sum() > 0, chosen  # plain steps and drafted ones
        # Later requests start from what the finished ones learnt of this random drafter, not from trusting it.
        assert float(engine.state.policy.prior.acceptance[0]) < 0.3


@pytest.mark.parametrize("kind", ["plain", "hspec", "dflash"])
def test_dense_layout_is_lossless_and_never_preempts(kind, target_params, prompts, alone):
    """The dense layout (one contiguous cache row per slot, the data engine's): six requests on two slots, long
    prompts in chunks: every answer equals decoding it alone, nothing is preempted, and a page count is refused.
    The engine runs the params as every decoding driver places them (`Placement`: fused projections on CPU, the
    layers stacked where the decoder scans them, one tree per layer where it does not)."""
    bundle = served_bundle(kind, target_params, prompts)
    config = dataclasses.replace(small_pool_config(bundle, prompts), num_pages=None, layout="dense")
    engine = ServingEngine(bundle, config)
    for placed, given in (
        (engine.bundle.target_params, bundle.target_params),
        (engine.bundle.drafter_params, bundle.drafter_params),
    ):
        assert jax.tree.structure(placed) == jax.tree.structure(for_backend(given) if given is not None else None)
    assert engine.cache.k[0].shape[:2] == (2, engine.max_pages * config.page_size)
    for i, prompt in enumerate(prompts):
        assert engine.submit(Request(f"r{i}", prompt)) is None
    done = {}
    while engine.busy:
        done.update((c.request.id, c) for c in engine.step())
    assert engine.preemptions == 0 and engine.running == 0
    for i in range(len(prompts)):
        np.testing.assert_array_equal(done[f"r{i}"].tokens, alone[i], err_msg=f"request r{i}")
    with pytest.raises(ValueError, match="dense layout holds every slot at its longest"):
        ServingEngine(bundle, dataclasses.replace(config, num_pages=config.slots * engine.max_pages))
    with pytest.raises(ValueError, match="layout must be one of paged, dense"):
        dataclasses.replace(config, layout="ring")


@pytest.mark.parametrize("arrival", ["closed", "poisson"])
def test_load_generator_sends_every_request(arrival, target_params, prompts, alone):
    """`eval.serving.drive`: closed-loop clients (one per slot) or Poisson arrivals; every request is answered, as
    if alone (the engine of the lossless test: already compiled)."""
    bundle = served_bundle("plain", target_params, prompts)
    engine = ServingEngine(bundle, small_pool_config(bundle, prompts))
    args = argparse.Namespace(arrival=arrival, rate=200.0, seed=0)
    completions, start = eval_serving.drive(engine, [list(p) for p in prompts], 2, args)
    by_id = {c.request.id: c for c in completions}
    assert sorted(by_id) == [f"q{i}" for i in range(len(prompts))] and engine.running == 0
    for i in range(len(prompts)):
        np.testing.assert_array_equal(by_id[f"q{i}"].tokens, alone[i])
        assert start <= by_id[f"q{i}"].submitted
    if arrival == "closed":  # the third request waits for the first answer
        assert min(c.finished for c in completions) <= sorted(c.submitted for c in completions)[2]


def test_eval_serving_on_the_tiny_random_target(tmp_path):
    """A short sweep: plain decoding and H-Spec, two slots, under a KV budget; the report and its plots. Auto's
    step costs come from the cost cache, here a fixed table for the policy's choices at two slots (measuring them
    on the loop is tests/test_adaptive.py's and tests/test_eval.py's)."""
    out = tmp_path / "serving"
    argv = ["--target", "random:tiny", "--drafter", "random:hspec", "--k", "auto,7", "--tasks", "qa"]
    argv += ["--requests", "3", "--concurrency", "2", "--max-new-tokens", "8", "--memory-budget", "200KiB"]
    argv += ["--compile-cache", ""]
    asked = []

    def cached_costs(shape, choices, measure):
        asked.append((shape["batch"], choices))
        return np.linspace(1.0, 2.0, len(choices), dtype=np.float32)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cost_model, "step_costs", cached_costs)
        assert eval_serving.main([*argv, "--out", str(out)]) == 0
    assert asked == [(2, (0, 3))]  # on CPU `auto` cuts the drafter's 7 drafts to 3 (policy.LONGEST_DRAFT)
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    methods = ["plain", "random:hspec k=auto", "random:hspec k=7"]
    assert [(r["method"], r["slots"]) for r in rows] == [(m, 2) for m in methods]
    for r in rows:
        assert r["answered"] == 3 and 3 <= r["tokens"] <= 24 and r["throughput"] > 0
        assert 0 < r["target_occupancy_peak"] <= 1 and r["drafter_occupancy_peak"] == 0  # neither keeps drafter KV
        assert r["ttft_p50"] > 0 and r["itl_p50"] > 0
    assert rows[0]["tau"] is None and all(1 <= r["tau"] <= 8 for r in rows[1:])
    text = (out / "report.md").read_text()
    assert "| random:hspec k=auto | 2 |" in text and "Under a KV memory budget of 204800 bytes" in text
    assert all((out / name).stat().st_size > 0 for name in eval_serving.PLOTS)


def test_eval_serving_rejects_bad_arguments(tmp_path, capsys):
    assert run(eval_serving.main, ["--arrival", "poisson", "--out", str(tmp_path)]) == 1
    assert "needs --rate" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        eval_serving.main(["--memory-budget", "lots", "--out", str(tmp_path)])
    assert "expected bytes" in capsys.readouterr().err


def test_cancel_frees_the_slot_and_pages_at_once(target_params, prompts, alone):
    """A running request cancelled between iterations gives back its slot and pages before the next one (and the
    tokens it had); a queued one leaves the queue; the others still get their answers, handed over token by token
    (`on_tokens`) exactly as their completions hold them."""
    bundle = served_bundle("plain", target_params, prompts)
    config = dataclasses.replace(small_pool_config(bundle, prompts), num_pages=None)
    handed: dict[str, list[int]] = {}
    engine = ServingEngine(bundle, config, on_tokens=lambda r, t: handed.setdefault(r.id, []).extend(t.tolist()))
    for i in (0, 1, 2, 3):
        assert engine.submit(Request(f"r{i}", prompts[i])) is None
    engine.step()
    engine.step()
    running = {s.request.id for s in engine.slots if s is not None}
    assert running == {"r0", "r1"} and [r.id for r, _, _ in engine.queue] == ["r2", "r3"]
    held = len(engine.allocator.held[[s.request.id for s in engine.slots].index("r0")])
    used = engine.allocator.used
    cancelled = engine.cancel("r0")
    assert cancelled.cancelled and cancelled.request.id == "r0" and engine.running == 1
    assert held > 0 and engine.allocator.used == used - held
    engine.allocator.check()
    np.testing.assert_array_equal(cancelled.tokens, alone[0][: len(cancelled.tokens)])
    assert 1 <= len(cancelled.tokens) == len(handed["r0"]) and handed["r0"] == cancelled.tokens.tolist()
    queued = engine.cancel("r3")
    assert queued.cancelled and len(queued.tokens) == 0 and [r.id for r, _, _ in engine.queue] == ["r2"]
    assert engine.cancel("r0") is None and engine.cancel("never") is None
    engine.step()  # the free slot takes the next request at once
    assert {s.request.id for s in engine.slots if s is not None} == {"r1", "r2"}
    done = {}
    while engine.busy:
        done.update((c.request.id, c) for c in engine.step())
    assert sorted(done) == ["r1", "r2"] and engine.allocator.used == 0
    for i in (1, 2):
        np.testing.assert_array_equal(done[f"r{i}"].tokens, alone[i])
        assert handed[f"r{i}"] == alone[i].tolist()


@pytest.mark.parametrize("kind", ["plain", "hspec"])
def test_per_request_sampling_keeps_greedy_requests_greedy(kind, target_params, prompts, alone):
    """One engine, each request at its own temperature and top-p: the greedy ones (temperature 0, or a nucleus so
    small that only the argmax is left) get exactly their greedy answers beside requests that sample; those that
    sample do not. An engine without per-request sampling refuses a request that asks for its own."""
    bundle = served_bundle(kind, target_params, prompts)
    config = dataclasses.replace(small_pool_config(bundle, prompts), num_pages=None, per_request_sampling=True)
    engine = ServingEngine(bundle, config)
    settings = {"r0": (0.0, None), "r1": (1.5, None), "r2": (1.0, 1e-6), "r3": (0.0, 0.5), "r4": (1.5, 0.9)}
    for i, (temperature, top_p) in enumerate(settings.values()):
        assert engine.submit(Request(f"r{i}", prompts[i], seed=i, temperature=temperature, top_p=top_p)) is None
    done, seen = {}, {}
    while engine.busy:
        done.update((c.request.id, c.tokens) for c in engine.step())
        for slot, s in enumerate(engine.slots):  # every slot samples with its own request's settings
            if s is not None:
                row = (engine.rows.temperature[slot], engine.rows.top_p[slot])
                seen[s.request.id] = tuple(round(float(x), 6) for x in row)
    assert seen == {k: (t, 1.0 if p is None else p) for k, (t, p) in settings.items()}
    for i in (0, 2, 3):
        np.testing.assert_array_equal(done[f"r{i}"], alone[i], err_msg=f"r{i} {settings[f'r{i}']}")
    assert not all(np.array_equal(done[f"r{i}"], alone[i]) for i in (1, 4))
    fixed = ServingEngine(bundle, dataclasses.replace(config, per_request_sampling=False))
    assert "per_request_sampling is off" in fixed.submit(Request("x", prompts[0], temperature=0.7)).refused
    assert fixed.submit(Request("y", prompts[0], temperature=0.0, top_p=1.0)) is None  # the engine's own setting
    assert "top_p must be in (0, 1]" in engine.refusal(Request("z", prompts[0], top_p=0.0))
