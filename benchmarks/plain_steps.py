"""What a plain step under `--k auto` costs against a plain decoding step, and what the policy's drafting adds,
in several fresh processes.

    python -m benchmarks.plain_steps [--processes 6] [--capacity 256 --capacity 2048] [--rounds 7]
        [--drafter random:hspec] [--prompt "..."] [--out benchmarks/results/plain_steps.md]

Each process loads the embedded SmolLM2 target and compiles plain decoding and three `--k auto` engines: one whose
cost table is pinned to plain steps (`policy.pinned_costs`: every step verifies one token, the drafter never runs),
and two with their own table (measured at first use on this machine, or read from the user cache) that draft where
the policy wants: `own` hands what each generation learnt of the drafter on to the next (as `eval.generate` does
between its runs and a server between requests), `first` starts every generation from the policy's first prior (as
the first answer of a process does). It times 64-token generations (batch 1, greedy; a random prompt of 40 tokens at
capacity 256, of 900 from capacity 1024 on, or `--prompt` in the target's chat template) of the four in `--rounds`
rounds, the order reversed every other round, the first round untimed. pinned / plain is the ratio of the medians in
that process: its spread over processes is the noise a single comparison carries on this machine (the absolute speed
of one and the same program moves between processes too). own / pinned is what the drafting itself costs or gains,
with the blocks the drafter drafted and the steps that verified drafts (a drafted block not verified was declined);
first / own is what an answer pays for starting before the policy has learnt the drafter. Every auto output is
checked against plain decoding's."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

from benchmarks.common import write_report
from hspec_jax.machine import cpu_model

NEW_TOKENS = 64


def prompt_length(capacity: int) -> int:
    return 40 if capacity < 1024 else 900


def time_in_this_process(target: str, drafter: str, capacity: int, rounds: int, prompt: str | None = None) -> dict:
    """Medians of `rounds - 1` timed generations of plain decoding, of pinned-plain `auto` and of `auto` with its own
    cost table -> ms per token, with the last generation's counts of the latter."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from hspec_jax.decoding import Bundle, SamplingConfig, pad_batch
    from hspec_jax.decoding.engine import compile_autoregressive, compile_speculative
    from hspec_jax.decoding.policy import AdaptivePolicy, pinned_costs
    from hspec_jax.drafter_spec import drafter_config, load_drafter
    from hspec_jax.target_spec import load_target_spec

    spec = load_target_spec(target, None, 0)
    config, params = spec.config, spec.params
    if prompt is None:
        ids = [[int(t) for t in np.random.default_rng(0).integers(1, config.vocab_size, prompt_length(capacity))]]
    else:
        ids = [spec.encoder.encode_chat([{"role": "user", "content": prompt}])]
    tokens, lengths = (jnp.asarray(x) for x in pad_batch(ids, 0))
    drafter_cfg = drafter_config(drafter, config, spec.recipe)
    drafter_params, vocab = load_drafter(drafter, drafter_cfg, params, ids)
    drafter_cfg, policy = AdaptivePolicy.auto_drafting(drafter_cfg)
    kw = dict(max_new_tokens=NEW_TOKENS, sampling=SamplingConfig(), eos_ids=(), pad_id=0, seed=0)
    bundle = Bundle(params, config, drafter_params, drafter_cfg, vocab)
    engines = {
        "plain": compile_autoregressive(params, config, tokens, lengths, capacity, **kw),
        "pinned": compile_speculative(
            bundle, tokens, lengths, capacity, **kw, policy=policy, costs=np.asarray(pinned_costs(policy, 0))
        ),
        "own": compile_speculative(bundle, tokens, lengths, capacity, **kw, policy=policy),
        "first": compile_speculative(bundle, tokens, lengths, capacity, **kw, policy=policy),
    }
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    outputs = {}
    for r in range(rounds):
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        for name in order:
            engine = engines[name]
            carry = jax.block_until_ready(engine.start())
            start = time.perf_counter()
            carry = jax.block_until_ready(engine.step(carry, NEW_TOKENS))
            if r:
                seconds[name].append(time.perf_counter() - start)
            outputs[name] = engine.view(carry)
            if name != "first":
                engine.finish(carry)  # the next generation starts from what this one learnt, as in eval.generate
    plain_tokens, pinned_view, own_stats, first_stats = (
        outputs["plain"][0],
        outputs["pinned"],
        *(outputs[name][3] for name in ("own", "first")),
    )
    steps = int(np.asarray(pinned_view[3].steps).sum())
    plain_share = float(np.asarray(pinned_view[3].chosen)[:, 0].sum()) / max(steps, 1)
    per_token = {name: 1000 * statistics.median(s) / (NEW_TOKENS - 1) for name, s in seconds.items()}
    return {
        "plain_ms": per_token["plain"],
        "pinned_ms": per_token["pinned"],
        "own_ms": per_token["own"],
        "first_ms": per_token["first"],
        "identical": all(np.array_equal(plain_tokens, outputs[name][0]) for name in ("pinned", "own", "first")),
        "plain_share": plain_share,
        "prompt_tokens": len(ids[0]),
        "drafted": int(np.asarray(own_stats.drafted).sum()),
        "verified": int(np.asarray(own_stats.chosen)[:, 1:].sum()),
        "tau": own_stats.tau(),
        "first_drafted": int(np.asarray(first_stats.drafted).sum()),
        "first_verified": int(np.asarray(first_stats.chosen)[:, 1:].sum()),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--drafter", default="random:hspec")
    parser.add_argument("--capacity", type=int, action="append", help="cache rows (repeatable; default 256, 2048)")
    parser.add_argument("--processes", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--prompt", help="a chat prompt instead of random token ids")
    parser.add_argument("--out", default="benchmarks/results/plain_steps.md")
    parser.add_argument("--in-process", action="store_true", help="time one capacity here and print JSON")
    args = parser.parse_args(argv)
    capacities = args.capacity or [256, 2048]
    if args.in_process:
        print(json.dumps(time_in_this_process(args.target, args.drafter, capacities[0], args.rounds, args.prompt)))
        return
    rows = {c: [] for c in capacities}
    for p in range(args.processes):
        for capacity in capacities:
            cmd = [sys.executable, "-m", "benchmarks.plain_steps", "--in-process", "--target", args.target]
            cmd += ["--drafter", args.drafter, "--capacity", str(capacity), "--rounds", str(args.rounds)]
            cmd += [] if args.prompt is None else ["--prompt", args.prompt]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
            result = json.loads(done.stdout.strip().splitlines()[-1])
            rows[capacity].append(result)
            print(
                f"process {p + 1} capacity {capacity}: plain {result['plain_ms']:.2f} ms/token, auto (plain steps) "
                f"{result['pinned_ms']:.2f} ({result['pinned_ms'] / result['plain_ms']:.3f}x), auto (own table) "
                f"{result['own_ms']:.2f} ({result['own_ms'] / result['plain_ms']:.3f}x; drafted {result['drafted']}, "
                f"verified {result['verified']}, tau {result['tau']:.2f}), auto (first prior) {result['first_ms']:.2f} "
                f"({result['first_ms'] / result['plain_ms']:.3f}x; drafted {result['first_drafted']}, verified "
                f"{result['first_verified']})",
                flush=True,
            )
    command = (
        f"python -m benchmarks.plain_steps --processes {args.processes} --rounds {args.rounds} --drafter {args.drafter}"
    )
    command += "".join(f" --capacity {c}" for c in capacities)
    command += "" if args.prompt is None else f" --prompt {shlex.quote(args.prompt)}"
    prompt = "random prompts" if args.prompt is None else "the prompt in the chat template"
    lines = [
        "# A plain step under `--k auto` against a plain decoding step, and what drafting adds",
        "",
        f"CPU: {cpu_model()}, {os.cpu_count()} cores. Command: `{command}`. {args.target}, batch 1, greedy,"
        f" {NEW_TOKENS} new tokens, {prompt}; `pinned`: `auto` with its cost table pinned to plain steps (drafter"
        f" {args.drafter} never runs); `own`: `auto` with its own cost table, drafting where the policy wants, each"
        " generation starting from what the last one learnt; `first`: the same, every generation from the policy's"
        f" first prior; per process the medians of {args.rounds - 1} timed generations of each, alternating; drafted"
        " / verified: blocks the drafter drafted and steps that verified drafts in the last generation.",
        "",
        "| capacity | prompt tokens | process | plain ms/token | pinned ms/token | pinned / plain | plain steps "
        "| own ms/token | own / plain | own / pinned | drafted | verified | tau | first / plain | first: drafted "
        "/ verified | identical |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for capacity, results in rows.items():
        for p, r in enumerate(results, start=1):
            lines.append(
                f"| {capacity} | {r['prompt_tokens']} | {p} | {r['plain_ms']:.2f} | {r['pinned_ms']:.2f} | "
                f"{r['pinned_ms'] / r['plain_ms']:.3f} | {r['plain_share']:.2f} | {r['own_ms']:.2f} | "
                f"{r['own_ms'] / r['plain_ms']:.3f} | {r['own_ms'] / r['pinned_ms']:.3f} | {r['drafted']} | "
                f"{r['verified']} | {r['tau']:.2f} | {r['first_ms'] / r['plain_ms']:.3f} | {r['first_drafted']} / "
                f"{r['first_verified']} | {r['identical']} |"
            )
    lines += ["", "| capacity | ratio | mean | median | lowest | highest |", "|---|---|---|---|---|---|"]
    for capacity, results in rows.items():
        for name, value in (
            ("pinned / plain", lambda r: r["pinned_ms"] / r["plain_ms"]),
            ("own / plain", lambda r: r["own_ms"] / r["plain_ms"]),
            ("first / plain", lambda r: r["first_ms"] / r["plain_ms"]),
            ("plain ms/token", lambda r: r["plain_ms"]),
        ):
            values = [value(r) for r in results]
            lines.append(
                f"| {capacity} | {name} | {statistics.mean(values):.3f} | {statistics.median(values):.3f} | "
                f"{min(values):.3f} | {max(values):.3f} |"
            )
    write_report(args.out, lines)


if __name__ == "__main__":
    main()
