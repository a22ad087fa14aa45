"""Training runs side by side: `python -m train.compare_runs RUN_DIR... [--last N] [--out FILE] [--plot PNG]`.

In-sample: every logged step's metrics are measured on that step's training batch before the update (rows the
run may have trained on in an earlier epoch). Per draft slot k it prints their mean over the last N logged steps
of the greedy agreement `acc_k` (the drafter's top token is the target's) and the acceptance probability
`overlap_k` (sum over the vocabulary of min(p, q)), each over all blocks, not only those whose earlier slots
were accepted: a drafter whose rates fall faster with k is one that decays at later positions.

Held-out: at every evaluation step (`eval_every`; step 0 is the starting drafter) it prints the same training-path
agreement `heldout_acc_k` and simulated accept length `heldout_sim_accept_len` (1 + sum_k prod_{j<=k} acc_j) on the
run's fixed held-out conversations, never trained on, beside the engine's real tau on held-out prompts and the
tokens trained on by then (step x global batch x sequence length, from the run's recipe.json: rows are packed
full). A gap between in-sample and held-out agreement is memorisation. Where the held-out set names families (the
task-shaped files), a third table gives each family's slot-1 agreement and simulated accept length per evaluation.
`--plot FILE` draws the learning curves: held-out slot-1 agreement and real tau against steps and against tokens
trained on.
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


def tokens_per_step(workdir: str) -> int | None:
    """Tokens in one global training batch (batch size x sequence length) by the run's recipe.json; None without
    one."""
    path = os.path.join(workdir, "recipe.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        recipe = json.load(f)
    return int(recipe["train"]["batch_size"]) * int(recipe["data"]["seq_len"])


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


def trained_tokens(record: dict, per_step: int | None) -> str:
    return f"{record['step'] * per_step / 1e6:.2f}M" if per_step else "-"


def held_out_table(names: list[str], runs: list[list[dict]], per_step: list[int | None]) -> list[str]:
    """Markdown lines: per run and evaluation step, the tokens trained on, the held-out per-slot agreement and
    simulated accept length beside the real tau (none without evaluation steps)."""
    evals = [eval_records(records) for records in runs]
    if not any(evals):
        return []
    slots = max(slot_count(records, f"{HELD_OUT}acc") for records in evals)
    lines = [
        "",
        "Held-out (fixed conversations never trained on): training-path agreement per slot and simulated accept "
        "length; real tau: the engine, greedy, on held-out prompts.",
        "",
        "| run | step | tokens trained on | "
        + "".join(f"held-out acc {k} | " for k in range(1, slots + 1))
        + "held-out sim accept len | real tau |",
        "|---|---|---|" + "---|" * (slots + 2),
    ]
    for name, records, tokens in zip(names, evals, per_step, strict=True):
        for r in records:
            cells = [trained_tokens(r, tokens)] + [cell(r, f"{HELD_OUT}acc_{k}") for k in range(1, slots + 1)]
            cells += [cell(r, f"{HELD_OUT}sim_accept_len"), cell(r, "tau")]
            lines.append(f"| {name} | {r['step']} | " + " | ".join(cells) + " |")
    return lines


FAMILY_ACC = "_acc_1"  # heldout_<family>_acc_1, beside heldout_<family>_sim_accept_len


def families(records: list[dict]) -> list[str]:
    """The held-out families logged in `records`, sorted (keys `heldout_<family>_acc_1`, not `heldout_acc_1`)."""
    keys = {key for r in records for key in r if key.startswith(HELD_OUT) and key.endswith(FAMILY_ACC)}
    return sorted(f for f in (key[len(HELD_OUT) : -len(FAMILY_ACC)] for key in keys) if f)


def family_table(names: list[str], runs: list[list[dict]]) -> list[str]:
    """Markdown lines: per run and evaluation step, each held-out family's slot-1 agreement / simulated accept
    length (none without family metrics)."""
    evals = [eval_records(records) for records in runs]
    fams = sorted({f for records in evals for f in families(records)})
    if not fams:
        return []
    lines = [
        "",
        "Held-out per family: slot-1 agreement / simulated accept length.",
        "",
        "| run | step | " + " | ".join(fams) + " |",
        "|---|---|" + "---|" * len(fams),
    ]
    for name, records in zip(names, evals, strict=True):
        for r in records:
            cells = [
                f"{cell(r, f'{HELD_OUT}{f}{FAMILY_ACC}')} / {cell(r, f'{HELD_OUT}{f}_sim_accept_len')}" for f in fams
            ]
            lines.append(f"| {name} | {r['step']} | " + " | ".join(cells) + " |")
    return lines


def table(names: list[str], runs: list[list[dict]], last: int, per_step: list[int | None]) -> str:
    """The markdown comparison of the runs: the in-sample table, the held-out one, then the per-family one."""
    lines = in_sample_table(names, runs, last) + held_out_table(names, runs, per_step) + family_table(names, runs)
    return "\n".join(lines) + "\n"


def plot_learning_curves(path: str, names: list[str], runs: list[list[dict]], per_step: list[int | None]) -> None:
    """A PNG of 2 x 2 panels: held-out slot-1 agreement (top) and real tau (bottom) against steps (left) and
    against millions of tokens trained on (right; runs without a recipe.json are left out there)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharey="row")
    metrics = ((f"{HELD_OUT}acc_1", "held-out slot-1 agreement"), ("tau", "real tau (held-out prompts, greedy)"))
    for row, (key, label) in enumerate(metrics):
        for name, records, tokens in zip(names, runs, per_step, strict=True):
            points = [(r["step"], r[key]) for r in eval_records(records) if key in r]
            if not points:
                continue
            steps, values = zip(*points, strict=True)
            axes[row][0].plot(steps, values, marker="o", label=name)
            if tokens:
                axes[row][1].plot([s * tokens / 1e6 for s in steps], values, marker="o", label=name)
        axes[row][0].set_ylabel(label)
        for col in (0, 1):
            axes[row][col].grid(alpha=0.3)
    axes[1][0].set_xlabel("training step")
    axes[1][1].set_xlabel("tokens trained on (millions)")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m train.compare_runs", description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="train.main work directories; NAME=DIR names a run")
    parser.add_argument("--last", type=positive_int, default=10, help="logged steps to average the per-slot rates over")
    parser.add_argument("--out", help="also write the table to this markdown file")
    parser.add_argument("--plot", help="also draw the held-out learning curves to this PNG file")
    args = parser.parse_args(argv)
    for flag, path in (("--out", args.out), ("--plot", args.plot)):
        if path and os.path.isdir(path):
            raise InputError(f"{flag} {path} is a directory, not a file")
    names, runs, per_step = [], [], []
    for spec in args.runs:
        name, _, workdir = spec.rpartition("=")
        names.append(name or os.path.basename(os.path.normpath(workdir)))
        runs.append(read_metrics(workdir))
        per_step.append(tokens_per_step(workdir))
    text = table(names, runs, args.last, per_step)
    print(text, end="")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    if args.plot:
        if not any(eval_records(records) for records in runs):
            raise InputError("--plot: no run has an evaluation step (held-out metrics or a real tau) to draw")
        plot_learning_curves(args.plot, names, runs, per_step)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
