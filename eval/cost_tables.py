"""Do first-use cost tables agree with a long quiet measurement? Each first use is a whole `eval.generate` process
with an empty user cache, as a user meets it.

    python -m eval.cost_tables [--repeats 5] [--reference-rounds 30] [--drafter smollm2-hspec]

Runs `eval.generate --target smollm2 --drafter ... --k auto --max-new-tokens 8 --repeats 0` `--repeats` times, each
with a fresh `XDG_CACHE_HOME` (so each measures its table at first use, `hspec_jax/decoding/costs.py`) and one
shared XLA compilation cache (so compiling is not what is measured), then once more with `--reference-rounds`
interleaved rounds instead of `costs.ROUNDS`: the reference. Prints and writes `benchmarks/results/cost_tables.md`:
each table, its largest deviation from the reference over the choices, and how many are within 10%.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

TABLE = re.compile(r"step costs T\(k\)/T\(0\) k=(\S+)")
PROMPT = "Explain in two sentences why the sky is blue."


def child(rounds: int, argv: list[str]) -> int:
    """`eval.generate` with `rounds` interleaved rounds per cost measurement."""
    from hspec_jax.decoding import costs

    costs.ROUNDS = rounds
    import eval.generate

    return eval.generate.main(argv)


def measure(args, rounds: int, compile_cache: str) -> dict[int, float]:
    """One whole process measuring its table at first use -> {k: T(k)/T(0)}."""
    with tempfile.TemporaryDirectory(prefix="hspec-costs-") as home:
        env = {**os.environ, "XDG_CACHE_HOME": home, "HF_HUB_OFFLINE": "1"}
        cmd = [sys.executable, "-m", "eval.cost_tables", "--child-rounds", str(rounds), "--"]
        cmd += ["--target", "smollm2", "--drafter", args.drafter, "--k", "auto", "--prompt", PROMPT]
        cmd += ["--max-new-tokens", "8", "--repeats", "0", "--compile-cache", compile_cache]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    found = TABLE.search(done.stdout)
    if found is None:
        raise RuntimeError(f"no cost table in the output:\n{done.stdout}\n{done.stderr}")
    return {int(k): float(v) for k, v in (item.split(":") for item in found.group(1).split(","))}


def main(argv=None) -> int:
    if argv is None and sys.argv[1:2] == ["--child-rounds"]:
        return child(int(sys.argv[2]), sys.argv[4:])
    parser = argparse.ArgumentParser(prog="python -m eval.cost_tables", description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--reference-rounds", type=int, default=30)
    parser.add_argument("--drafter", default="smollm2-hspec")
    parser.add_argument("--out", default="benchmarks/results/cost_tables.md")
    args = parser.parse_args(argv)
    from eval.startup import show_and_write
    from hspec_jax.decoding.costs import ROUNDS
    from hspec_jax.machine import cpu_model

    compile_cache = tempfile.mkdtemp(prefix="hspec-costs-xla-")
    measure(args, ROUNDS, compile_cache)  # fills the compilation cache; its table is not counted
    tables = [measure(args, ROUNDS, compile_cache) for _ in range(args.repeats)]
    reference = measure(args, args.reference_rounds, compile_cache)
    choices = sorted(reference)
    deviation = lambda table: max(abs(table[k] / reference[k] - 1) for k in choices)
    within = sum(deviation(t) <= 0.10 for t in tables)
    lines = [
        "# Cost tables at first use against a long interleaved measurement",
        "",
        f"CPU: {cpu_model()}, {os.cpu_count()} cores. Command: `python -m eval.cost_tables --repeats "
        f"{args.repeats} --reference-rounds {args.reference_rounds}`. Each row is a whole `eval.generate --target "
        f"smollm2 --drafter {args.drafter} --k auto` process with an empty user cache measuring its table in "
        f"{ROUNDS} interleaved rounds; the reference measured {args.reference_rounds} rounds the same way.",
        "",
        "| table | " + " | ".join(f"T({k})/T(0)" for k in choices) + " | largest deviation |",
        "|---|" + "---|" * (len(choices) + 1),
        "| reference | " + " | ".join(f"{reference[k]:.2f}" for k in choices) + " | - |",
    ]
    for i, table in enumerate(tables, 1):
        cells = " | ".join(f"{table[k]:.2f}" for k in choices)
        lines.append(f"| first use {i} | {cells} | {deviation(table):.1%} |")
    lines += ["", f"Within 10% of the reference: **{within} of {len(tables)}**."]
    show_and_write(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
