"""Compare training runs by what they logged: `python -m train.compare_runs RUN_DIR... [--last N] [--out FILE]`.

In-sample: every logged step's metrics are measured on that step's training batch before the update (rows the
run may have trained on in an earlier epoch). Per draft slot k it prints their mean over the last N logged steps
of the greedy agreement `acc_k` (the drafter's top token is the target's) and the acceptance probability
`overlap_k` (sum over the vocabulary of min(p, q)), each over all blocks, not only those whose earlier slots
were accepted: a drafter whose rates fall faster with k is one that decays at later positions.

Held-out: at every evaluation step (`eval_every`) it prints the same training-path agreement `heldout_acc_k` and
simulated accept length `heldout_sim_accept_len` (1 + sum_k prod_{j<=k} acc_j) on the run's fixed held-out
conversations, never trained on, beside the engine's real tau on held-out prompts. A gap between in-sample and
held-out agreement is memorisation.
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


HELD_OUT = "heldout_"  # the prefix of the held-out metrics train.main logs at evaluation steps


def eval_records(records: list[dict]) -> list[dict]:
    """The records of the evaluation steps: those with held-out metrics or a real tau."""
    return [r for r in records if "tau" in r or f"{HELD_OUT}acc_1" in r]


def slot_count(records: list[dict], prefix: str) -> int:
    """The largest k of the `prefix_k` keys over `records` (0 with none)."""
    ks = [int(key[len(prefix) + 1 :]) for r in records for key in r if key.startswith(f"{prefix}_")]
    return max(ks, default=0)


def cell(record: dict, key: str) -> str:
    return f"{record[key]:.3f}" if key in record else "-"


def in_sample_table(names: list[str], runs: list[list[dict]], last: int) -> list[str]:
    """Markdown lines: per run, the in-sample per-slot means over its last `last` logged steps."""
    slots = max(len(slot_means(records, "acc", last)) for records in runs)
    lines = [
        f"In-sample per-slot rates (each step's training batch): mean over each run's last {last} logged steps.",
        "",
        "| run | last step | metric | " + " | ".join(str(k) for k in range(1, slots + 1)) + " |",
        "|---|---|---|" + "---|" * slots,
    ]
    for name, records in zip(names, runs, strict=True):
        for prefix in ("acc", "overlap"):
            values = slot_means(records, prefix, last)
            cells = [f"{v:.3f}" for v in values] + ["-"] * (slots - len(values))
            lines.append(f"| {name} | {records[-1]['step']} | {prefix} (in-sample) | " + " | ".join(cells) + " |")
    return lines


def held_out_table(names: list[str], runs: list[list[dict]]) -> list[str]:
    """Markdown lines: per run and evaluation step, the held-out per-slot agreement and simulated accept length
    beside the real tau (none without evaluation steps)."""
    evals = [eval_records(records) for records in runs]
    if not any(evals):
        return []
    slots = max(slot_count(records, f"{HELD_OUT}acc") for records in evals)
    lines = [
        "",
        "Held-out (fixed conversations never trained on): training-path agreement per slot and simulated accept "
        "length; real tau: the engine, greedy, on held-out prompts.",
        "",
        "| run | step | "
        + "".join(f"held-out acc {k} | " for k in range(1, slots + 1))
        + "held-out sim accept len | real tau |",
        "|---|---|" + "---|" * (slots + 2),
    ]
    for name, records in zip(names, evals, strict=True):
        for r in records:
            cells = [cell(r, f"{HELD_OUT}acc_{k}") for k in range(1, slots + 1)]
            cells += [cell(r, f"{HELD_OUT}sim_accept_len"), cell(r, "tau")]
            lines.append(f"| {name} | {r['step']} | " + " | ".join(cells) + " |")
    return lines


def table(names: list[str], runs: list[list[dict]], last: int) -> str:
    """The markdown comparison of the runs: the in-sample table, then the held-out one."""
    return "\n".join(in_sample_table(names, runs, last) + held_out_table(names, runs)) + "\n"


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
