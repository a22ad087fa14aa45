"""Compare training runs by what they logged: `python -m train.compare_runs RUN_DIR... [--last N] [--out FILE]`.

Every logged step's metrics are measured on that step's batch before the update: within the first epoch, rows
the run has not trained on, so their mean over the last N logged steps is an out-of-sample estimate with
thousands of drafted blocks behind it. Per draft slot k it prints the greedy agreement `acc_k` (the drafter's
top token is the target's) and the acceptance probability `overlap_k` (sum over the vocabulary of min(p, q)),
each over all blocks, not only those whose earlier slots were accepted: a drafter whose rates fall faster with
k is one that decays at later positions. It also prints the held-out real tau at every step where
the run measured it (`eval_every`).
"""

from __future__ import annotations

import json
import os
import sys

from hspec_jax.cli import ArgumentParser, positive_int, run
from hspec_jax.errors import InputError


def read_metrics(workdir: str) -> list[dict]:
    """The records of `workdir/metrics.jsonl`, in step order (a last line cut by a kill skipped); an `InputError`
    naming the file (and line) when there are none or one is not a step's record."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise InputError(f"{path} does not exist: is {workdir!r} a train.main work directory?")
    with open(path) as f:
        text = f.read()
    lines = text.splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if number == len(lines) and not text.endswith("\n"):
                continue  # a line cut short by a kill
            raise InputError(f"{path}:{number}: not a JSON record ({e.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise InputError(f"{path}:{number}: not a logged step (no integer 'step')")
        records.append(record)
    if not records:
        raise InputError(f"{path} has no records")
    return sorted(records, key=lambda r: r["step"])


def slot_means(records: list[dict], prefix: str, last: int) -> list[float]:
    """Mean of `prefix_1..prefix_K` over the last `last` records that have them: `[K]`."""
    rows = [r for r in records if f"{prefix}_1" in r and "loss" in r][-last:]
    if not rows:
        return []
    count = max(int(key.rsplit("_", 1)[1]) for key in rows[-1] if key.startswith(f"{prefix}_"))
    return [sum(r[f"{prefix}_{k}"] for r in rows) / len(rows) for k in range(1, count + 1)]


def real_taus(records: list[dict]) -> dict[int, float]:
    """{step: held-out real tau} for the steps where the run measured it."""
    return {r["step"]: r["tau"] for r in records if "tau" in r}


def table(names: list[str], runs: list[list[dict]], last: int) -> str:
    """The markdown comparison of the runs (one row per run and metric)."""
    steps = sorted({s for records in runs for s in real_taus(records)})
    slots = max(len(slot_means(records, "acc", last)) for records in runs)
    lines = [
        f"Per-slot rates: mean over each run's last {last} logged steps. Real tau: held-out prompts, greedy.",
        "",
        "| run | last step | metric | " + " | ".join(str(k) for k in range(1, slots + 1)) + " |",
        "|---|---|---|" + "---|" * slots,
    ]
    for name, records in zip(names, runs, strict=True):
        for prefix in ("acc", "overlap"):
            values = slot_means(records, prefix, last)
            cells = [f"{v:.3f}" for v in values] + ["-"] * (slots - len(values))
            lines.append(f"| {name} | {records[-1]['step']} | {prefix} | " + " | ".join(cells) + " |")
    if steps:
        lines += ["", "| run | " + " | ".join(f"real tau @{s}" for s in steps) + " |", "|---|" + "---|" * len(steps)]
        for name, records in zip(names, runs, strict=True):
            taus = real_taus(records)
            lines.append(f"| {name} | " + " | ".join(f"{taus[s]:.3f}" if s in taus else "-" for s in steps) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m train.compare_runs", description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="train.main work directories; NAME=DIR names a run")
    parser.add_argument("--last", type=positive_int, default=10, help="logged steps to average the per-slot rates over")
    parser.add_argument("--out", help="also write the table to this markdown file")
    args = parser.parse_args(argv)
    if args.out and os.path.isdir(args.out):
        raise InputError(f"--out {args.out} is a directory, not a file")
    names, runs = [], []
    for spec in args.runs:
        name, _, workdir = spec.rpartition("=")
        names.append(name or os.path.basename(os.path.normpath(workdir)))
        runs.append(read_metrics(workdir))
    text = table(names, runs, args.last)
    print(text, end="")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
