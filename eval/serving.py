"""Serving throughput against concurrency: continuous batching over the paged KV pool, per method, under load.

    python -m eval.serving --target smollm2 --drafter runs/smollm2-hspec/drafter --concurrency 1,2,4,8,16,32 \\
        --requests 64 --out benchmarks/results/serving_smollm2
    python -m eval.serving --target random:tiny --drafter random:hspec --drafter random:dflash --concurrency 1,4 \\
        --requests 8 --max-new-tokens 16 --memory-budget 400KiB --out runs/serving-tiny

For each method (plain decoding, then each `--drafter`, at each `--k`: e.g. `--k auto,7`, auto choosing the draft
length per step, its step costs measured once per machine and concurrency on the contiguous-cache loop of that
batch and cached) and each concurrency c, an engine with c slots
(`hspec_jax.serving`) answers `--requests` requests: the first turns of the evaluation prompts (`--tasks`, spread
over the tasks, repeated if there are fewer), sent by a load generator:

* closed (default): c clients, each sending its next request as soon as its previous one is answered;
* poisson: requests arrive at `--rate` per second (exponential gaps, seeded), whatever the load.

The engine's programs are compiled by one warm-up request before the clock starts. `--target` takes what
`eval.main` takes (smollm2, an HF directory, a .gguf, an Orbax directory, or random:<recipe>: random weights, for
a quick run whose numbers say nothing about real drafters).

The KV pool: with `--memory-budget BYTES` it holds as many pages as the budget pays for, counting for each page the
target's K/V rows and, for DFlash/DSpark, the drafter's own (same rows, same page table): the same bytes for every
method and every concurrency, so a drafter with its own cache gets fewer pages. Without a budget every slot gets
room for its longest request, and nothing is ever preempted.

Reported per method x concurrency (`report.md`, `results.jsonl`, PNG plots):
  throughput       generated tokens / seconds from the first request sent to the last answer
  TTFT             time to first token (sent -> first token available), p50 / p99
  ITL              inter-token latency, p50 / p99: tokens that become available together (a scheduling iteration:
                   `--steps-per-iteration` decoding steps, or an accepted draft block) share the time since the
                   previous ones
  tau              (accepted drafts + steps) / steps over all answers
  KV occupancy     pages in use / pages in the pool, mean and peak over scheduling iterations, target and drafter
                   separately (a DFlash/DSpark page holds both models' rows: equal fractions, different bytes)
  preempted        requests sent back to the queue when the pool ran out (they restart from their prompt)
  refused          requests that can never fit (a prompt over the limit, or more pages than the whole pool)
Under a memory budget also, per method: the largest concurrency sustained (every request answered, none preempted)
and the throughput there.

Over HTTP, `--url` (repeatable) drives servers already running (`python -m hspec_jax.serve`), each one method (its
drafter at its k, or plain), with the same load generator: streamed `/v1/completions` with the prompts as token ids
and the usage in every chunk, so tokens are counted as the engine committed them. Reported per server x concurrency:
throughput, TTFT and ITL (p50 / p99, as above, on this process's clock), tau (from the server's /metrics), refusals
and, for the 429s of a full queue (more clients than slots plus queue), how long each took to arrive (p50 / p99):
those the load's own requests got (they arrive in bursts, as each answered client sends its next request at once,
so they also time this process's and the server's queueing of a burst) and those of a probe, one more client on a
thread of its own that, while such a load runs, asks for one token every `PROBE_INTERVAL` seconds (what a client
arriving at a full server waits; an accepted probe adds a request of one token to the load).
`--in-process` also times, right before each HTTP run, the engine that server runs (its slots, limits, cost
table, per-request sampling) in this process on the same prompts, and the report gives HTTP / in-process throughput
(`--rounds N`: N such pairs, alternating which runs first, and the median ratio):

    python -m hspec_jax.serve --target smollm2 --slots 16 --max-tokens 64 --port 8000 &
    python -m eval.serving --url http://127.0.0.1:8000 --in-process --concurrency 1,16 --requests 64 \\
        --max-new-tokens 64 --out runs/http-serving
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
import sys
import threading
import time
from typing import NamedTuple

import httpx
import jax.numpy as jnp
import numpy as np

from eval.main import Method, load_methods
from eval.report import PLAIN, fmt
from hspec_jax.chat import ChatEncoder
from hspec_jax.cli import (
    DEFAULT_COMPILE_CACHE,
    ArgumentParser,
    byte_size,
    check_output_dir,
    int_list,
    non_negative_float,
    non_negative_int,
    parse_ks,
    portable,
    positive_int,
    run,
    use_compile_cache,
)
from hspec_jax.decoding import Bundle, SamplingConfig
from hspec_jax.errors import InputError
from hspec_jax.machine import machine_facts
from hspec_jax.prompts import load_prompts, parse_tasks
from hspec_jax.serving import Completion, Request, ServingConfig, ServingEngine, engine_costs, page_bytes, pages_for
from hspec_jax.target_spec import Target, load_encoder, load_target_spec

ARRIVALS = ("closed", "poisson")
PLOTS = {
    "serving_throughput.png": "throughput vs concurrency",
    "serving_latency.png": "TTFT and ITL (p50) vs concurrency",
    "serving_kv.png": "peak KV memory in use vs concurrency",
}
MIB = 1024**2


def parse_args(argv: list[str] | None = None):
    parser = ArgumentParser(prog="python -m eval.serving", description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="smollm2", help="smollm2, HF dir, .gguf, Orbax dir, random:<recipe>")
    parser.add_argument("--drafter", action="append", default=[], help="checkpoint dir or random:<kind>; repeatable")
    parser.add_argument("--recipe", default=None, help="recipe for random:<kind> drafters (default: the target's)")
    parser.add_argument(
        "--k", type=parse_ks, default=None, help="draft lengths per drafter, e.g. auto,7 (default: the drafter's k)"
    )
    parser.add_argument("--tasks", default="all", help="all, or a comma-separated list such as math,code")
    parser.add_argument("--concurrency", type=int_list, default=[1, 2, 4, 8], help="slots per engine, e.g. 1,2,4,8")
    parser.add_argument("--requests", type=positive_int, default=32, help="requests per method and concurrency")
    parser.add_argument("--max-new-tokens", type=positive_int, default=64, help="tokens per answer (at most)")
    parser.add_argument("--arrival", choices=ARRIVALS, default="closed", help="closed-loop clients or Poisson")
    parser.add_argument("--rate", type=non_negative_float, default=None, help="requests per second (with poisson)")
    parser.add_argument("--memory-budget", type=byte_size, default=None, help="KV pool bytes, e.g. 64MiB")
    parser.add_argument("--page-size", type=positive_int, default=16, help="rows per KV page")
    parser.add_argument("--prefill-chunk", type=positive_int, default=128, help="prompt tokens per prefill call")
    parser.add_argument("--steps-per-iteration", type=positive_int, default=4, help="decoding steps per scheduling")
    parser.add_argument("--max-prompt-tokens", type=positive_int, default=None, help="default: the longest prompt")
    parser.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument(
        "--compile-cache", default=DEFAULT_COMPILE_CACHE, help="persistent XLA compilation cache directory, '' for none"
    )
    parser.add_argument(
        "--url", action="append", default=[], help="a running server (python -m hspec_jax.serve) to drive; repeatable"
    )
    parser.add_argument(
        "--in-process", action="store_true", help="with --url: also time the same engine in this process, same prompts"
    )
    parser.add_argument(
        "--rounds", type=positive_int, default=1, help="with --in-process: rounds of both, alternating which goes first"
    )
    parser.add_argument("--out", required=True, help="output directory")
    return parser.parse_args(argv)


def check_args(args) -> None:
    check_output_dir(args.out)
    if args.arrival == "poisson" and (args.rate is None or not args.rate > 0):
        raise InputError("--arrival poisson needs --rate > 0 (requests per second)")
    if args.arrival == "closed" and args.rate is not None:
        raise InputError("--rate sets Poisson arrivals: it needs --arrival poisson")
    if len(set(args.drafter)) != len(args.drafter):
        raise InputError("each --drafter may be given once")
    if args.k and not args.drafter:
        raise InputError("--k sets the drafted tokens per step: it needs --drafter")
    if args.url and (args.drafter or args.memory_budget is not None or args.max_prompt_tokens is not None):
        raise InputError(
            "with --url the servers' own settings hold: leave out --drafter, --memory-budget and --max-prompt-tokens"
        )
    if args.in_process and not args.url:
        raise InputError("--in-process puts the engine beside a server: it needs --url")
    if args.rounds > 1 and not args.in_process:
        raise InputError("--rounds alternates the HTTP and the in-process runs: it needs --in-process")
    try:
        parse_tasks(args.tasks)
    except ValueError as e:
        raise InputError(str(e)) from None


def request_prompts(encoder: ChatEncoder, tasks: str, count: int) -> list[list[int]]:
    """Token ids of `count` first turns, spread over the tasks (and repeated when the tasks have fewer)."""
    task_names = parse_tasks(tasks)
    prompts = load_prompts(task_names, math.ceil(count / len(task_names)))
    by_task = [[p for p in prompts if p.task == t] for t in task_names]
    interleaved = [p for group in zip(*by_task, strict=False) for p in group] or prompts
    return [encoder.encode(interleaved[i % len(interleaved)], []) for i in range(count)]


def served(target: Target, method: Method) -> Bundle:
    if method.drafter is None:
        return Bundle(target.params, target.config)
    config, params, vocab = method.drafter
    return Bundle(target.params, target.config, params, config, vocab)


def policy_costs(bundle: Bundle, method: Method, slots: int, prompt: list[int], args):
    """The adaptive policy's cost table at `slots` sequences (None for a fixed k): `engine_costs`."""
    if method.policy is None:
        return None
    sampling = SamplingConfig(temperature=args.temperature)
    return engine_costs(bundle, method.policy, slots, prompt, args.max_new_tokens, sampling, args.seed)


def pool_pages(bundle: Bundle, args, slots: int, max_prompt: int) -> int:
    """Pages of the pool (the null page included): what the budget pays for, or room for every slot's longest
    request."""
    if args.memory_budget is not None:
        return args.memory_budget // sum(page_bytes(bundle.target, bundle.drafter, args.page_size))
    longest = pages_for(max_prompt + args.max_new_tokens + bundle.lookahead, args.page_size)
    return slots * longest + 1


def drive(engine: ServingEngine, prompts: list[list[int]], clients: int, args) -> tuple[list[Completion], float]:
    """Send every prompt to `engine` (closed loop with `clients` clients, or Poisson arrivals) and serve them all
    -> (completions, the clock time the first request was sent)."""
    requests = [Request(f"q{i}", tuple(p), seed=args.seed + i) for i, p in enumerate(prompts)]
    rng = np.random.default_rng(args.seed)
    start = engine.clock()
    if args.arrival == "poisson":
        due = start + np.cumsum(rng.exponential(1.0 / args.rate, len(requests)))
    else:
        due = np.full(len(requests), np.inf)
        due[:clients] = start
    done: list[Completion] = []
    sent = 0
    while len(done) < len(requests):
        now = engine.clock()
        while sent < len(requests) and due[sent] <= now:
            refused = engine.submit(requests[sent])
            sent += 1
            if refused is not None:
                done.append(refused)
                if args.arrival == "closed" and sent < len(requests):
                    due[sent] = min(due[sent], now)
        if engine.busy:
            finished = engine.step()
            done += finished
            if args.arrival == "closed":  # each answer frees its client to send the next request
                for j in range(sent, min(sent + len(finished), len(requests))):
                    due[j] = min(due[j], engine.clock())
        elif sent < len(requests):
            time.sleep(max(0.0, min(due[sent] - engine.clock(), 1.0)))
    return done, start


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def inter_token_latencies(c: Completion) -> list[float]:
    """Per token after the first: the time since the previous tokens arrived, shared by the tokens arriving together."""
    out = []
    for (before, _), (at, n) in zip(c.bursts, c.bursts[1:], strict=False):
        out += [(at - before) / n] * n
    return out


def speed(answered: list[Completion], start: float) -> dict:
    """Tokens, seconds, throughput, TTFT and ITL percentiles of the answered requests (the clock started at
    `start`)."""
    tokens = sum(len(c.tokens) for c in answered)
    elapsed = max((c.finished for c in answered), default=start) - start
    ttft = [c.first_token - c.submitted for c in answered if c.first_token is not None]
    itl = [x for c in answered for x in inter_token_latencies(c)]
    return {
        "tokens": tokens,
        "seconds": elapsed,
        "throughput": tokens / elapsed if elapsed > 0 else 0.0,
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        "itl_p50": percentile(itl, 50),
        "itl_p99": percentile(itl, 99),
    }


def measure(engine: ServingEngine, completions: list[Completion], start: float, bundle: Bundle, args) -> dict:
    """The row of one method x concurrency (see the module docstring)."""
    answered = [c for c in completions if c.refused is None]
    steps = sum(c.steps for c in answered)
    target_page, drafter_page = page_bytes(bundle.target, bundle.drafter, args.page_size)
    usable = engine.allocator.usable
    occupancy = np.asarray(engine.occupancy or [0])
    return {
        "slots": engine.config.slots,
        "pool_pages": usable,
        "requests": len(completions),
        "answered": len(answered),
        "refused": len(completions) - len(answered),
        "preemptions": engine.preemptions,
        **speed(answered, start),
        "tau": (sum(c.accepted for c in answered) + steps) / steps if steps else None,
        "iterations": engine.iterations,
        "target_occupancy_mean": float(occupancy.mean()) / usable,
        "target_occupancy_peak": float(occupancy.max()) / usable,
        "drafter_occupancy_mean": float(occupancy.mean()) / usable if drafter_page else 0.0,
        "drafter_occupancy_peak": float(occupancy.max()) / usable if drafter_page else 0.0,
        "target_kv_bytes_peak": int(occupancy.max()) * target_page,
        "drafter_kv_bytes_peak": int(occupancy.max()) * drafter_page,
        "target_page_bytes": target_page,
        "drafter_page_bytes": drafter_page,
        "request_pages": engine.request_pages(engine.config.max_prompt_tokens),
    }


def serve(
    target: Target,
    method: Method,
    slots: int,
    prompts: list[list[int]],
    args,
    max_prompt: int,
    clients: int | None = None,
    per_request_sampling: bool = False,
    costs=None,
) -> dict:
    """Warm up (compile) then time one method at one concurrency (`clients`, default one per slot) -> its row.
    `costs`: the adaptive policy's cost table to use (default: `policy_costs`)."""
    bundle = served(target, method)
    config = ServingConfig(
        slots=slots,
        num_pages=max(pool_pages(bundle, args, slots, max_prompt), 2),
        page_size=args.page_size,
        max_prompt_tokens=max_prompt,
        max_new_tokens=args.max_new_tokens,
        prefill_chunk=args.prefill_chunk,
        steps_per_iteration=args.steps_per_iteration,
        sampling=SamplingConfig(temperature=args.temperature),
        eos_ids=target.eos_ids,
        pad_id=target.pad_id,
        seed=args.seed,
        policy=method.policy,
        per_request_sampling=per_request_sampling,
    )
    if costs is None:
        costs = policy_costs(bundle, method, slots, min(prompts, key=len), args)
    else:
        costs = np.asarray(costs, np.float32)
    engine = ServingEngine(bundle, config, costs=costs)
    if engine.submit(Request("warm-up", tuple(min(prompts, key=len)))) is None:  # compiles the engine's programs
        while engine.busy:
            engine.step()
    engine.reset_counters()
    completions, start = drive(engine, prompts, clients or slots, args)
    return {"method": method.name, "kind": "plain" if method.drafter is None else method.drafter[0].kind} | measure(
        engine, completions, start, bundle, args
    )


# ---------------------------------------------------------------------------------------------------- over HTTP


def server_info(url: str) -> dict:
    """A running server's settings (`GET /health`)."""
    try:
        response = httpx.get(url.rstrip("/") + "/health", timeout=10)
    except httpx.HTTPError as e:
        raise InputError(f"--url {url}: no server answers ({e})") from None
    if response.status_code != 200:
        raise InputError(f"--url {url}: /health answered {response.status_code}: {response.text[:200]}")
    return response.json()


def server_method(info: dict) -> str:
    """A server's method, named as the in-process ones (`load_methods`)."""
    if info["drafter"] is None:
        return PLAIN
    return f"{info['drafter']} k={info['k']}"


PROBE_INTERVAL = 0.1  # seconds between two requests of the full-queue probe


class Refusal(NamedTuple):
    """A request the server did not answer with tokens: its HTTP status (500 for an error event mid-stream) and the
    seconds from sending it to that answer."""

    status: int
    seconds: float


def scrape(url: str) -> dict[str, float]:
    """The server's Prometheus samples (name with labels -> value)."""
    text = httpx.get(url.rstrip("/") + "/metrics", timeout=10).text
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))}


async def _request(client, url: str, model: str, i: int, prompt: list[int], args) -> Completion | Refusal:
    """One streamed completion of `prompt` (token ids) -> its `Completion` (times on this process's clock; bursts:
    the tokens each chunk brought, from the running usage), or its `Refusal`."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "seed": args.seed + i,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    submitted, bursts, count = time.perf_counter(), [], 0
    async with client.stream("POST", url.rstrip("/") + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return Refusal(response.status_code, time.perf_counter() - submitted)
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                return Refusal(500, time.perf_counter() - submitted)
            n = chunk["usage"]["completion_tokens"]
            if n > count:
                bursts.append((time.perf_counter(), n - count))
                count = n
    first = bursts[0][0] if bursts else None
    request = Request(f"q{i}", tuple(prompt), args.seed + i)
    return Completion(request, np.zeros(count, np.int32), submitted, first, time.perf_counter(), bursts)


async def _drive_http(url: str, model: str, prompts: list[list[int]], clients: int, args):
    """`drive` over HTTP: closed-loop `clients` or Poisson arrivals -> (completions, refusals, start)."""
    import asyncio

    results: list = [None] * len(prompts)
    rng = np.random.default_rng(args.seed)
    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        start = time.perf_counter()
        if args.arrival == "poisson":
            due = start + np.cumsum(rng.exponential(1.0 / args.rate, len(prompts)))

            async def at(i):
                await asyncio.sleep(max(0.0, due[i] - time.perf_counter()))
                results[i] = await _request(client, url, model, i, prompts[i], args)

            await asyncio.gather(*(at(i) for i in range(len(prompts))))
        else:
            todo = iter(range(len(prompts)))

            async def loop():
                for i in todo:  # each client sends its next request as soon as its previous one is answered
                    results[i] = await _request(client, url, model, i, prompts[i], args)

            await asyncio.gather(*(loop() for _ in range(clients)))
    completions = [r for r in results if isinstance(r, Completion)]
    return completions, [r for r in results if not isinstance(r, Completion)], start


class FullQueueProbe:
    """One more client, on a thread of its own, that asks a server for one token (not streamed) every
    `PROBE_INTERVAL` s until `stop`: `answers` holds each answer's `Refusal(status, seconds)`, 200s included."""

    def __init__(self, url: str, model: str, prompt: list[int]):
        self.url, self.answers = url.rstrip("/") + "/v1/completions", []
        self.body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="full-queue probe", daemon=True)

    def __enter__(self) -> FullQueueProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        with httpx.Client(timeout=None) as client:
            while not self._stop.wait(PROBE_INTERVAL):
                sent = time.perf_counter()
                status = client.post(self.url, json=self.body).status_code
                self.answers.append(Refusal(status, time.perf_counter() - sent))


def latencies_429(prefix: str, answers: list[Refusal]) -> dict:
    """{prefix: how many answers were 429s, prefix_p50 / prefix_p99: their seconds}."""
    full = [r.seconds for r in answers if r.status == 429]
    return {prefix: len(full), f"{prefix}_p50": percentile(full, 50), f"{prefix}_p99": percentile(full, 99)}


def measure_http(
    completions: list[Completion],
    refusals: list[Refusal],
    start: float,
    before: dict,
    after: dict,
    probe: list[Refusal] = (),
) -> dict:
    """The row of one server x concurrency: what `measure` reports that a client can see, tau from the server's
    metrics (their change over the run), and how long the 429s (a full queue) took to arrive, p50 / p99: to the
    load's requests (`queue_full*`) and to a `FullQueueProbe`'s (`probe_full*`)."""
    steps = after.get("hspec_spec_steps_total", 0) - before.get("hspec_spec_steps_total", 0)
    accepted = after.get("hspec_spec_accepted_drafts_total", 0) - before.get("hspec_spec_accepted_drafts_total", 0)
    counts = {"requests": len(completions) + len(refusals), "answered": len(completions), "refused": len(refusals)}
    tau = {"tau": (accepted + steps) / steps if steps else None}
    full = latencies_429("queue_full", refusals) | latencies_429("probe_full", list(probe))
    return counts | speed(completions, start) | tau | full


def serve_http(url: str, info: dict, prompts: list[list[int]], clients: int, args) -> dict:
    """Time one running server at one concurrency -> its row (with a `FullQueueProbe` beside the load when the load
    can fill the queue)."""
    import asyncio

    before = scrape(url)
    probe = FullQueueProbe(url, info["model"], prompts[0][:8])
    with probe if clients > info["slots"] + info["max_queue"] else contextlib.nullcontext():
        completions, refusals, start = asyncio.run(_drive_http(url, info["model"], prompts, clients, args))
    row = measure_http(completions, refusals, start, before, scrape(url), probe.answers)
    return {"method": server_method(info), "via": "HTTP", "clients": clients, "slots": info["slots"]} | row


def in_process(target: Target, info: dict, prompts: list[list[int]], clients: int, args) -> dict:
    """The engine a server at `info` runs (its settings and cost table), in this process, on the same prompts at the
    same concurrency. A random drafter's draft vocabulary comes from the prompts here, from the server's warm-up
    prompt there."""
    ks = None if info["drafter"] is None else (info["k"],)
    methods = load_methods(target, [info["drafter"]] if info["drafter"] else [], prompts, ks)
    row = serve(
        target, methods[-1], info["slots"], prompts, args, info["max_prompt_tokens"], clients, True, info["costs"]
    )
    keep = ("requests", "answered", "refused", "tokens", "seconds", "throughput", "tau")
    latencies = {k: row[k] for k in row if k.startswith(("ttft", "itl"))}
    return (
        {"method": server_method(info), "via": "in-process", "clients": clients, "slots": info["slots"]}
        | {k: row[k] for k in keep}
        | latencies
    )


def http_round(url: str, info: dict, target, prompts: list[list[int]], clients: int, args, i: int) -> list[dict]:
    """Round `i` at one server and concurrency: the HTTP run, and with `--in-process` the in-process run first in
    even rounds, second in odd ones -> their rows (the HTTP row with its `vs_in_process` throughput ratio)."""
    order = ("in-process", "HTTP") if args.in_process and i % 2 == 0 else ("HTTP", "in-process")
    rows = []
    for via in order:
        if via == "HTTP":
            rows.append(serve_http(url, info, prompts, clients, args))
        elif args.in_process:
            rows.append(in_process(target, info, prompts, clients, args))
    if args.in_process:
        http, local = sorted(rows, key=lambda r: r["via"])
        http["vs_in_process"] = http["throughput"] / local["throughput"]
    return [row | {"server": url, "round": i} for row in rows]


def report_head(title: str, meta: dict, what: str) -> list[str]:
    """The first lines of a report: title, command, machine, what was served, settings."""
    lines = [f"# {title}", "", f"Command: `{meta['command']}`", ""]
    lines += ["Machine: " + ", ".join(f"{k} {v}" for k, v in meta["machine"].items()), "", what, ""]
    return [*lines, "Settings: " + ", ".join(f"{k} {v}" for k, v in meta["settings"].items()), ""]


def write_http_report(out_dir: str, rows: list[dict], meta: dict) -> str:
    """`report.md` of a run over HTTP (with the in-process rows beside, if any)."""
    ms = lambda x: fmt(x * 1000, 1)
    servers = "Servers: " + "; ".join(f"{u}: {json.dumps(i)}" for u, i in meta["servers"].items())
    lines = [
        *report_head("Serving over HTTP: throughput and latency vs concurrency", meta, servers),
        "| server | round | method | via | clients | slots | answered | tok/s | HTTP / in-process | TTFT p50 / p99 ms "
        "| ITL p50 / p99 ms | tau | refused | 429s to the load: count, p50 / p99 ms | 429s to a probe |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ratios: dict[tuple, list[float]] = {}
    for r in rows:
        full = {
            k: f"{r[k]}, {ms(r[k + '_p50'])} / {ms(r[k + '_p99'])}" if r.get(k) else "-"
            for k in ("queue_full", "probe_full")
        }
        ratio = fmt(r["vs_in_process"]) if "vs_in_process" in r else "-"
        if "vs_in_process" in r:
            ratios.setdefault((r["server"], r["method"], r["clients"]), []).append(r["vs_in_process"])
        lines.append(
            f"| {r['server']} | {r['round']} | {r['method']} | {r['via']} | {r['clients']} | {r['slots']} "
            f"| {r['answered']}/{r['requests']} "
            f"| {fmt(r['throughput'], 1)} | {ratio} | {ms(r['ttft_p50'])} / {ms(r['ttft_p99'])} "
            f"| {ms(r['itl_p50'])} / {ms(r['itl_p99'])} | {fmt(r['tau']) if r['tau'] is not None else '-'} "
            f"| {r['refused']} | {full['queue_full']} | {full['probe_full']} |"
        )
    lines += [
        "",
        "Clients send their next request as soon as the previous one is answered (streamed /v1/completions with "
        "token-id prompts, the usage in every chunk). TTFT: request sent -> first token received; ITL: tokens "
        "arriving in one chunk share the time since the previous chunk. 429s: the answers of a full queue, request "
        "sent -> status received, to the load's requests (in bursts) and to a probe client asking for one token "
        f"every {PROBE_INTERVAL} s while the load can fill the queue. In-process rows run the same engine (slots, "
        "limits, per-request sampling) on the same prompts in this process, right before or after each HTTP run "
        "(alternating by round); HTTP / in-process compares the two runs of one round.",
    ]
    if ratios:
        lines += [
            "",
            "| server | method | clients | HTTP / in-process: median over rounds | rounds |",
            "|---|---|---|---|---|",
        ]
        for (server, method, clients), values in ratios.items():
            each = ", ".join(fmt(v) for v in values)
            lines.append(f"| {server} | {method} | {clients} | {fmt(float(np.median(values)))} | {each} |")
    report = os.path.join(out_dir, "report.md")
    with open(report, "w") as f:
        f.write("\n".join(lines) + "\n")
    return report


def main_http(args, argv: list[str]) -> int:
    """`--url`: drive the running servers (and with `--in-process`, the same engines here) on the same prompts."""
    infos = {url: server_info(url) for url in args.url}
    targets = {info["target"] for info in infos.values()}
    if len(targets) != 1:
        raise InputError(f"the servers serve different targets ({', '.join(sorted(targets))}): prompts differ")
    spec = targets.pop()
    for url, info in infos.items():
        if args.max_new_tokens > info["max_tokens"]:
            raise InputError(
                f"--max-new-tokens {args.max_new_tokens}: the server at {url} gives at most {info['max_tokens']}"
            )
        if args.in_process and args.max_new_tokens != info["max_tokens"]:
            raise InputError(
                f"--in-process runs the server's engine, which stops at {info['max_tokens']} tokens: "
                f"start the server at {url} with --max-tokens {args.max_new_tokens}"
            )
    try:
        target = load_target_spec(spec, None, next(iter(infos.values()))["seed"]) if args.in_process else None
        encoder = target.encoder if target else load_encoder(spec)
        prompts = request_prompts(encoder, args.tasks, args.requests)
    except (ValueError, FileNotFoundError) as e:
        raise InputError(str(e)) from None
    longest = max(len(p) for p in prompts)
    for url, info in infos.items():
        if longest > info["max_prompt_tokens"]:
            raise InputError(
                f"the longest prompt has {longest} tokens: the server at {url} takes at most "
                f"{info['max_prompt_tokens']} (--max-prompt-tokens)"
            )
    os.makedirs(args.out, exist_ok=True)
    use_compile_cache(args.compile_cache)
    rows = []
    with open(os.path.join(args.out, "results.jsonl"), "w") as results:
        for url, info in infos.items():
            if args.in_process:  # the server's engine settings for the engine here
                args.page_size, args.prefill_chunk = info["page_size"], info["prefill_chunk"]
                args.steps_per_iteration = info["steps_per_iteration"]
            for clients in args.concurrency:
                for i in range(args.rounds):
                    pair = http_round(url, info, target, prompts, clients, args, i)
                    for row in pair:
                        rows.append(row)
                        results.write(json.dumps(row) + "\n")
                        results.flush()
                        print(
                            f"{row['method']} via {row['via']} x{clients}: {row['throughput']:.1f} tok/s, "
                            f"{row['answered']}/{row['requests']} answered, TTFT p50 {row['ttft_p50'] * 1000:.1f} "
                            f"ms, ITL p50 {row['itl_p50'] * 1000:.1f} ms",
                            file=sys.stderr,
                        )
    meta = {
        "command": "python -m eval.serving " + shlex.join(argv),
        "machine": machine_facts(jnp.float32, bandwidth=False),
        "servers": infos,
        "settings": {
            "requests": args.requests,
            "tasks": args.tasks,
            "arrival": args.arrival if args.arrival == "closed" else f"poisson {args.rate}/s",
            "max new tokens": args.max_new_tokens,
            "temperature": args.temperature,
        },
    }
    with open(os.path.join(args.out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(f"wrote {write_http_report(args.out, rows, meta)}")
    return 0


def sustained(rows: list[dict], method: str) -> dict | None:
    """The row of the largest concurrency at which `method` answered every request without preempting any."""
    ok = [r for r in rows if r["method"] == method and r["refused"] == 0 and r["preemptions"] == 0]
    return max(ok, key=lambda r: r["slots"], default=None)


def write_report(out_dir: str, rows: list[dict], meta: dict) -> list[str]:
    """`report.md` and the plots (`PLOTS`) from the rows -> their paths."""
    methods = list(dict.fromkeys(r["method"] for r in rows))
    plain = {r["slots"]: r for r in rows if r["method"] == PLAIN}
    ms = lambda x: fmt(x * 1000, 1)
    lines = [
        *report_head("Serving: throughput vs concurrency", meta, f"Target: {meta['target']}"),
        "| method | concurrency | pool pages | answered | tok/s | x plain | TTFT p50 / p99 ms | ITL p50 / p99 ms | tau "
        "| target KV occ. mean / peak | drafter KV occ. mean / peak | peak KV MiB target + drafter | preempted "
        "| refused |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        base = plain.get(r["slots"])
        ratio = r["throughput"] / base["throughput"] if base and base["throughput"] else float("nan")
        lines.append(
            f"| {r['method']} | {r['slots']} | {r['pool_pages']} | {r['answered']}/{r['requests']} "
            f"| {fmt(r['throughput'], 1)} | {fmt(ratio)} | {ms(r['ttft_p50'])} / {ms(r['ttft_p99'])} "
            f"| {ms(r['itl_p50'])} / {ms(r['itl_p99'])} | {fmt(r['tau']) if r['tau'] is not None else '-'} "
            f"| {fmt(r['target_occupancy_mean'])} / {fmt(r['target_occupancy_peak'])} "
            f"| {fmt(r['drafter_occupancy_mean'])} / {fmt(r['drafter_occupancy_peak'])} "
            f"| {fmt(r['target_kv_bytes_peak'] / MIB)} + {fmt(r['drafter_kv_bytes_peak'] / MIB)} "
            f"| {r['preemptions']} | {r['refused']} |"
        )
    lines += [
        "",
        "Occupancy: KV pages in use / pages in the pool (mean and peak over scheduling iterations). A DFlash/DSpark "
        "page holds the drafter's K/V rows beside the target's (one page table), so its fraction equals the "
        "target's while its bytes add to them.",
    ]
    if meta["settings"].get("memory budget") is not None:
        budget = meta["settings"]["memory budget"]
        lines += [
            "",
            f"## Under a KV memory budget of {budget} bytes ({budget / MIB:.1f} MiB)",
            "",
            "| method | KiB per page target + drafter | pool pages | longest requests that fit at once "
            "| max concurrency sustained (measured) | tok/s there |",
            "|---|---|---|---|---|---|",
        ]
        for m in methods:
            first = next(r for r in rows if r["method"] == m)
            fits = first["pool_pages"] // first["request_pages"]
            best = sustained(rows, m)
            lines.append(
                f"| {m} | {fmt(first['target_page_bytes'] / 1024, 1)} + {fmt(first['drafter_page_bytes'] / 1024, 1)} "
                f"| {first['pool_pages']} | {fits} | {best['slots'] if best else 0} "
                f"| {fmt(best['throughput'], 1) if best else '-'} |"
            )
        lines += [
            "",
            "Sustained: every request answered and none preempted at that concurrency (among those run). "
            "'Longest requests that fit': pool pages / pages of a request with the longest prompt and every new token.",
        ]
    report = os.path.join(out_dir, "report.md")
    with open(report, "w") as f:
        f.write("\n".join(lines) + "\n")
    return [report, *plot(out_dir, rows, methods)]


def plot(out_dir: str, rows: list[dict], methods: list[str]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []

    def curve(ax, key, scale=1.0, label_suffix="", style="-"):
        for m in methods:
            mine = sorted((r for r in rows if r["method"] == m), key=lambda r: r["slots"])
            ax.plot(
                [r["slots"] for r in mine], [r[key] * scale for r in mine], style, marker="o", label=m + label_suffix
            )

    def finish(fig, ax, name, ylabel):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (slots)")
        ax.set_ylabel(ylabel)
        ax.set_title(PLOTS[name])
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(out_dir, name)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)

    fig, ax = plt.subplots(figsize=(6, 4))
    curve(ax, "throughput")
    finish(fig, ax, "serving_throughput.png", "generated tokens / s")
    fig, ax = plt.subplots(figsize=(6, 4))
    curve(ax, "ttft_p50", 1000, " TTFT")
    curve(ax, "itl_p50", 1000, " ITL", "--")
    ax.set_yscale("log")
    finish(fig, ax, "serving_latency.png", "ms (p50)")
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        r["kv_mib_peak"] = (r["target_kv_bytes_peak"] + r["drafter_kv_bytes_peak"]) / MIB
    curve(ax, "kv_mib_peak")
    finish(fig, ax, "serving_kv.png", "peak KV in use, MiB (target + drafter)")
    return paths


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    check_args(args)
    if args.url:
        return main_http(args, argv)
    try:
        target = load_target_spec(args.target, args.recipe, args.seed)
        prompts = request_prompts(target.encoder, args.tasks, args.requests)
        methods = load_methods(target, args.drafter, prompts, args.k)
    except (ValueError, FileNotFoundError) as e:  # InputError and CheckpointError are ValueErrors too
        raise InputError(str(e)) from None
    max_prompt = args.max_prompt_tokens or max(len(p) for p in prompts)
    os.makedirs(args.out, exist_ok=True)
    use_compile_cache(args.compile_cache)
    rows = []
    with open(os.path.join(args.out, "results.jsonl"), "w") as results:
        for method in methods:
            for slots in args.concurrency:
                row = serve(target, method, slots, prompts, args, max_prompt)
                rows.append(row)
                results.write(json.dumps(row) + "\n")
                results.flush()
                print(
                    f"{method.name} x{slots}: {row['throughput']:.1f} tok/s, {row['answered']}/{row['requests']} "
                    f"answered, {row['preemptions']} preempted, peak KV occupancy {row['target_occupancy_peak']:.2f}",
                    file=sys.stderr,
                )
    meta = {
        "command": portable("python -m eval.serving " + shlex.join(argv)),
        "target": target.name,
        "machine": machine_facts(target.config.dtype, bandwidth=False),
        "settings": {
            "requests": args.requests,
            "tasks": args.tasks,
            "arrival": args.arrival if args.arrival == "closed" else f"poisson {args.rate}/s",
            "max new tokens": args.max_new_tokens,
            "max prompt tokens": max_prompt,
            "page size": args.page_size,
            "prefill chunk": args.prefill_chunk,
            "steps per iteration": args.steps_per_iteration,
            "temperature": args.temperature,
            "memory budget": args.memory_budget,
        },
    }
    with open(os.path.join(args.out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    for path in write_report(args.out, rows, meta):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
