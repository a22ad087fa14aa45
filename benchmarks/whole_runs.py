"""Plain decoding against a drafter, each run a whole `eval.generate` process, as a user meets them.

    python -m benchmarks.whole_runs [--drafter smollm2-hspec] [--k auto] [--rounds 3] [--new-tokens 64]
        [--prompt "..." ... | --task TASK [--num-prompts 3]] [--demo-runs 3] [--out benchmarks/results/whole_runs.md]

Two measurements, both on the embedded SmolLM2 target, greedy, batch 1:

* per prompt, `--rounds` rounds in which a plain process (`eval.generate` without a drafter) and a drafter
  process (`--drafter ... --k ...`) run one after the other, the order alternating between rounds; each process
  prints the median decode rate of `--repeats` warm runs after its streamed one. A prompt's ratio is the median
  over rounds of drafter / plain decode tokens/s from the same round;
* `--demo-runs` runs of exactly what `make demo` runs (`eval.generate --compare`: plain, then draft-and-verify, in
  one process) and the speedup each printed.

Each process uses the user's caches as they are (compiled programs, the cost table of `--k auto`): run once
before to measure warm starts, or with a fresh `XDG_CACHE_HOME` to include first use. Writes a table with the
CPU model beside it; nothing else should run on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import statistics
import subprocess
import sys
import time

from benchmarks.common import PROMPTS, write_report
from hspec_jax.machine import cpu_model
from hspec_jax.prompts import TASKS, load_prompts

DEMO_PROMPT = "Explain in two sentences why the sky is blue."  # the Makefile's DEMO_PROMPT
DECODE = re.compile(r"^decode: (\d+) tokens in ([\d.]+) s \(([\d.]+) tok/s\)", re.M)
SPEEDUP = re.compile(r"^speedup: ([\d.]+)x", re.M)
SPEC = re.compile(r"^spec: tau=([\d.]+) .*?(?:chosen (\S+))?(?: step costs T\(k\)/T\(0\) k=(\S+))?$", re.M)


def generate_command(prompt: str, new_tokens: int, repeats: int, drafter: str | None, k: str, compare=False):
    """The `eval.generate` command line of one run."""
    command = [sys.executable, "-m", "eval.generate", "--target", "smollm2", "--prompt", prompt]
    command += ["--max-new-tokens", str(new_tokens), "--repeats", str(repeats)]
    if drafter is not None:
        command += ["--drafter", drafter, "--k", k]
    return command + (["--compare"] if compare else [])


def run(command: list[str]) -> tuple[str, float]:
    """(stdout, wall seconds) of one process; its failure stops the benchmark with the process's error."""
    began = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    wall = time.perf_counter() - began
    if done.returncode != 0:
        raise SystemExit(f"{shlex.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout, wall


def decode_rate(stdout: str) -> float:
    """The timed decode tokens/s an `eval.generate` process printed (its last `decode:` line)."""
    return float(DECODE.findall(stdout)[-1][2])


def spec_summary(stdout: str) -> str:
    """tau, the draft lengths chosen and the cost table, as the drafter process printed them."""
    match = SPEC.search(stdout)
    if match is None:
        return ""
    tau, chosen, costs = match.groups()
    return f"tau {tau}" + (f", chosen {chosen}" if chosen else "") + (f", T(k)/T(0) {costs}" if costs else "")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.whole_runs", description=__doc__.split("\n")[0])
    parser.add_argument("--drafter", default="smollm2-hspec")
    parser.add_argument("--k", default="auto", help="the drafter process's --k (auto or a draft length)")
    parser.add_argument("--prompt", action="append", default=None, help="repeatable (default: make demo's + 4)")
    parser.add_argument("--task", choices=TASKS, help="instead of --prompt: first turns of a task's prompts")
    parser.add_argument("--num-prompts", type=int, default=3, help="with --task: how many (spread as eval.main does)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="warm runs timed in each process")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--demo-runs", type=int, default=3, help="runs of make demo's command (0: none)")
    parser.add_argument("--out", default="benchmarks/results/whole_runs.md")
    args = parser.parse_args(argv)
    if args.task and args.prompt:
        parser.error("--task and --prompt exclude each other")
    if args.task:
        prompts = [prompt.turns[0] for prompt in load_prompts(args.task, args.num_prompts)]
    else:
        prompts = args.prompt or [DEMO_PROMPT, *PROMPTS]
    machine = f"{cpu_model()}, {os.cpu_count()} cores"
    print(f"CPU: {machine}", flush=True)

    rows, ratios = [], []
    for p, prompt in enumerate(prompts):
        plain_rates, spec_rates, round_ratios, walls, summary = [], [], [], {"plain": [], "drafter": []}, ""
        for r in range(args.rounds):
            order = ("plain", "drafter") if (p + r) % 2 == 0 else ("drafter", "plain")
            rate = {}
            for method in order:
                drafter = args.drafter if method == "drafter" else None
                stdout, wall = run(generate_command(prompt, args.new_tokens, args.repeats, drafter, args.k))
                rate[method] = decode_rate(stdout)
                walls[method].append(wall)
                summary = spec_summary(stdout) if method == "drafter" else summary
            plain_rates.append(rate["plain"])
            spec_rates.append(rate["drafter"])
            round_ratios.append(rate["drafter"] / rate["plain"])
            print(
                f"[{machine}] prompt {p} round {r}: plain {rate['plain']:.1f} tok/s, drafter "
                f"{rate['drafter']:.1f} tok/s = {round_ratios[-1]:.3f}x ({summary})",
                flush=True,
            )
        ratio = statistics.median(round_ratios)
        ratios.append(ratio)
        rows.append(
            f"| {prompt[:48]} | {statistics.median(plain_rates):.1f} | {statistics.median(spec_rates):.1f} | "
            f"**{ratio:.3f}x** | {min(round_ratios):.3f}-{max(round_ratios):.3f} | "
            f"{statistics.median(walls['plain']):.1f} / {statistics.median(walls['drafter']):.1f} | {summary} |"
        )

    demo = []
    for r in range(args.demo_runs):
        stdout, wall = run(generate_command(DEMO_PROMPT, 64, 3, args.drafter, args.k, compare=True))
        demo.append((float(SPEEDUP.search(stdout).group(1)), wall, spec_summary(stdout)))
        print(f"[{machine}] make demo run {r}: speedup {demo[-1][0]:.2f}x in {wall:.1f} s ({demo[-1][2]})", flush=True)

    command = f"python -m benchmarks.whole_runs --drafter {args.drafter} --k {args.k} --rounds {args.rounds} "
    command += f"--repeats {args.repeats} --new-tokens {args.new_tokens} --demo-runs {args.demo_runs}"
    command += "".join(f" --prompt {shlex.quote(p)}" for p in args.prompt or ())
    command += f" --task {args.task} --num-prompts {args.num_prompts}" if args.task else ""
    lines = [
        "# Whole processes: plain decoding against a drafter, as a user runs them",
        "",
        f"CPU: {machine}. Command: `{command}`. Target: the embedded SmolLM2-135M, greedy, batch 1, "
        f"{args.new_tokens} new tokens, chat template; drafter `{args.drafter}` at `--k {args.k}`. Each cell: "
        f"`eval.generate` processes, one per method and round, alternating which runs first; decode tokens/s of "
        f"the median of {args.repeats} warm runs in each process. Ratio: median over {args.rounds} rounds of the "
        f"drafter's rate over the plain rate of the same round.",
        "",
        "| prompt | plain tok/s | drafter tok/s | ratio | range | process wall s (plain / drafter) | drafter |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"Median over prompts: **{statistics.median(ratios):.3f}x**; lowest prompt {min(ratios):.3f}x.",
    ]
    if demo:
        speedups = [s for s, _, _ in demo]
        lines += [
            "",
            f"`make demo`'s command (`eval.generate --compare --k {args.k} --repeats 3`, 64 tokens), {len(demo)} "
            f"runs: speedups {', '.join(f'{s:.2f}x' for s in speedups)}; median **{statistics.median(speedups):.2f}x**"
            f" ({'; '.join(summary for _, _, summary in demo[:1])}).",
        ]
    print("\n".join(lines))
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
