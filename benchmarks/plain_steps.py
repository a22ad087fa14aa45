"""What a plain step under `--k auto` costs against a plain decoding step, in several fresh processes.

    python -m benchmarks.plain_steps [--processes 6] [--capacity 256 --capacity 2048] [--rounds 7]
        [--drafter random:hspec] [--out benchmarks/results/plain_steps.md]

Each process loads the embedded SmolLM2 target and compiles plain decoding and a `--k auto` engine whose cost table
is pinned to plain steps (`policy.pinned_costs`: every step verifies one token, the drafter never runs), then times
64-token generations (batch 1, greedy, a random prompt of 40 tokens at capacity 256, of 900 from capacity 1024 on)
of both in `--rounds` rounds, the order reversed every other round, the first round untimed. auto / plain is the
ratio of the two medians in that process; the spread of that ratio over processes is the noise a single
comparison carries on this machine (the absolute speed of one and the same program moves between processes too).
Every auto output is checked against plain decoding's."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from benchmarks.common import write_report
from hspec_jax.machine import cpu_model

NEW_TOKENS = 64


def prompt_length(capacity: int) -> int:
    return 40 if capacity < 1024 else 900


def time_in_this_process(target: str, drafter: str, capacity: int, rounds: int) -> dict:
    """Medians of `rounds - 1` timed generations of plain decoding and of pinned-plain `auto` -> ms per token."""
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
    ids = [[int(t) for t in np.random.default_rng(0).integers(1, config.vocab_size, prompt_length(capacity))]]
    tokens, lengths = (jnp.asarray(x) for x in pad_batch(ids, 0))
    drafter_cfg = drafter_config(drafter, config, spec.recipe)
    drafter_params, vocab = load_drafter(drafter, drafter_cfg, params, ids)
    policy = AdaptivePolicy.for_drafts(drafter_cfg.num_drafts)
    kw = dict(max_new_tokens=NEW_TOKENS, sampling=SamplingConfig(), eos_ids=(), pad_id=0, seed=0)
    engines = {
        "plain": compile_autoregressive(params, config, tokens, lengths, capacity, **kw),
        "auto": compile_speculative(
            Bundle(params, config, drafter_params, drafter_cfg, vocab),
            tokens,
            lengths,
            capacity,
            **kw,
            policy=policy,
            costs=np.asarray(pinned_costs(policy, 0)),
        ),
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
    plain_tokens, auto_view = outputs["plain"][0], outputs["auto"]
    steps = int(np.asarray(auto_view[3].steps).sum())
    plain_share = float(np.asarray(auto_view[3].chosen)[:, 0].sum()) / max(steps, 1)
    per_token = {name: 1000 * statistics.median(s) / (NEW_TOKENS - 1) for name, s in seconds.items()}
    return {
        "plain_ms": per_token["plain"],
        "auto_ms": per_token["auto"],
        "identical": bool(np.array_equal(plain_tokens, auto_view[0])),
        "plain_share": plain_share,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--drafter", default="random:hspec")
    parser.add_argument("--capacity", type=int, action="append", help="cache rows (repeatable; default 256, 2048)")
    parser.add_argument("--processes", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default="benchmarks/results/plain_steps.md")
    parser.add_argument("--in-process", action="store_true", help="time one capacity here and print JSON")
    args = parser.parse_args(argv)
    capacities = args.capacity or [256, 2048]
    if args.in_process:
        print(json.dumps(time_in_this_process(args.target, args.drafter, capacities[0], args.rounds)))
        return
    rows = {c: [] for c in capacities}
    for p in range(args.processes):
        for capacity in capacities:
            cmd = [sys.executable, "-m", "benchmarks.plain_steps", "--in-process", "--target", args.target]
            cmd += ["--drafter", args.drafter, "--capacity", str(capacity), "--rounds", str(args.rounds)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
            result = json.loads(done.stdout.strip().splitlines()[-1])
            rows[capacity].append(result)
            ratio = result["auto_ms"] / result["plain_ms"]
            print(
                f"process {p + 1} capacity {capacity}: plain {result['plain_ms']:.2f} ms/token, auto (plain steps) "
                f"{result['auto_ms']:.2f}, auto/plain {ratio:.3f}",
                flush=True,
            )
    command = (
        f"python -m benchmarks.plain_steps --processes {args.processes} --rounds {args.rounds} --drafter {args.drafter}"
    )
    command += "".join(f" --capacity {c}" for c in capacities)
    lines = [
        "# A plain step under `--k auto` against a plain decoding step",
        "",
        f"CPU: {cpu_model()}, {os.cpu_count()} cores. Command: `{command}`. {args.target}, batch 1, greedy,"
        f" {NEW_TOKENS} new tokens; `auto` with its cost table pinned to plain steps (drafter {args.drafter} never"
        f" runs); per process the medians of {args.rounds - 1} timed generations of each, alternating.",
        "",
        "| capacity | prompt | process | plain ms/token | auto ms/token | auto / plain | plain steps | identical |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for capacity, results in rows.items():
        for p, r in enumerate(results, start=1):
            lines.append(
                f"| {capacity} | {prompt_length(capacity)} | {p} | {r['plain_ms']:.2f} | {r['auto_ms']:.2f} | "
                f"{r['auto_ms'] / r['plain_ms']:.3f} | {r['plain_share']:.2f} | {r['identical']} |"
            )
    lines += ["", "| capacity | auto / plain, mean | median | lowest | highest | plain ms/token, lowest - highest |"]
    lines.append("|---|---|---|---|---|---|")
    for capacity, results in rows.items():
        ratios = [r["auto_ms"] / r["plain_ms"] for r in results]
        plain = [r["plain_ms"] for r in results]
        lines.append(
            f"| {capacity} | {statistics.mean(ratios):.3f} | {statistics.median(ratios):.3f} | {min(ratios):.3f} | "
            f"{max(ratios):.3f} | {min(plain):.2f} - {max(plain):.2f} |"
        )
    write_report(args.out, lines)


if __name__ == "__main__":
    main()
