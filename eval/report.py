"""From the rows of an evaluation run (`results.jsonl`) to `report.md` and its plots.

    python -m eval.report DIR    # rewrite DIR/report.md and DIR/*.png from DIR/results.jsonl and DIR/meta.json

A row is one prompt x method x turn: `task`, `prompt_id`, `turn`, `method`, `unit` (the prompts timed together:
the prompt itself at batch size 1), `call` (one timed generation; a batch shares it), `call_seconds` and
`call_prefill_seconds` (wall time of that generation and of its prefill; under `--repeats`, the median prefill
plus the median decode time), `call_steps` (decode-loop iterations:
target forwards after the prefill), `tokens` (new tokens of this row), and for speculative methods `steps`,
`accepted`, `reached_at`/`accepted_at`/`predicted_at` (per draft index; predicted: the sum of the drafter's
predicted acceptance when reached), `k_steps` (steps per number of drafts verified, 0 = plain steps), `drafted`
(blocks the drafter drafted, verified or declined) and `identical` (same tokens as plain decoding).

Definitions (pooled over the rows of a task, or of all tasks):
  tau                = (accepted + steps) / steps, the mean tokens emitted per draft-and-verify step
  acceptance i       = accepted_at[i] / reached_at[i], draft i accepted given drafts 1..i-1 were
  tau up to i        = 1 + sum_{j<=i} accepted_at[j] / steps, tau had the block stopped after draft i
  tokens/s           = tokens / seconds, end to end (prefill included)
  speedup            = decode tokens/s of the method / that of plain decoding (inter-token latency, prefill
                       excluded, as the paper reports), wall clock, same run
  predicted speedup  = tau * T_plain / T_step, T_plain = plain decode seconds per forward, T_step = seconds per
                       draft-and-verify step (both measured in this run: the latency model)
  k share            = share of a method's steps that verified k drafts (k=auto: the adaptive policy's choices)
  calibration i      = predicted_at[i] / reached_at[i] (mean predicted acceptance of draft i: the confidence head's
                       sigmoid, or the top draft probability without one) beside acceptance i
Relative gains between drafters get paired bootstrap 95% intervals over units (`eval.bootstrap`).
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from dataclasses import dataclass, field

import numpy as np

from eval.bootstrap import paired_bootstrap
from hspec_jax.cli import ArgumentParser
from hspec_jax.prompts import TASKS

PLAIN = "plain"
PLOTS = {
    "tau_by_task.png": "tau per task",
    "acceptance_by_position.png": "conditional acceptance by draft index",
    "speedup_by_task.png": "speedup over plain decoding per task",
    "tau_by_block_position.png": "tau had the block stopped after draft i",
}


@dataclass
class Totals:
    """Sums over a set of rows of one method; per-call quantities are counted once per call."""

    rows: int = 0
    tokens: int = 0
    decode_tokens: int = 0  # tokens after the first (the first comes out of the prefill)
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    call_steps: int = 0
    steps: int = 0
    accepted: int = 0
    reached_at: np.ndarray = field(default_factory=lambda: np.zeros(0))
    accepted_at: np.ndarray = field(default_factory=lambda: np.zeros(0))
    predicted_at: np.ndarray = field(default_factory=lambda: np.zeros(0))
    k_steps: np.ndarray = field(default_factory=lambda: np.zeros(0))
    drafted: int | None = None  # None: rows written before `drafted` was recorded
    identical: int = 0
    compared: int = 0

    @property
    def decode_seconds(self) -> float:
        return self.seconds - self.prefill_seconds

    @property
    def tau(self) -> float:
        return (self.accepted + self.steps) / self.steps if self.steps else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else float("nan")

    @property
    def seconds_per_step(self) -> float:
        return self.decode_seconds / self.call_steps if self.call_steps else float("nan")

    def acceptance_by_position(self) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return self.accepted_at / self.reached_at

    def predicted_by_position(self) -> np.ndarray:
        """Mean predicted acceptance of draft i over the steps that reached it (nan where never reached)."""
        if not len(self.predicted_at):
            return np.full(len(self.reached_at), np.nan)
        with np.errstate(invalid="ignore", divide="ignore"):
            return self.predicted_at / self.reached_at

    def k_shares(self) -> np.ndarray:
        """Share of steps that verified k = 0, 1, ... drafts."""
        total = self.k_steps.sum()
        return self.k_steps / total if total else self.k_steps

    def tau_by_block_position(self) -> np.ndarray:
        return 1.0 + np.cumsum(self.accepted_at) / self.steps if self.steps else np.full(len(self.accepted_at), np.nan)


def totals(rows: list[dict]) -> Totals:
    t = Totals()
    calls = {}
    for r in rows:
        t.rows += 1
        t.tokens += r["tokens"]
        t.decode_tokens += max(r["tokens"] - 1, 0)
        calls[r["call"]] = (r["call_seconds"], r["call_prefill_seconds"], r["call_steps"])
        if r.get("steps") is not None:
            t.steps += r["steps"]
            t.accepted += r["accepted"]
            if not len(t.reached_at):
                t.reached_at, t.accepted_at = np.zeros(len(r["reached_at"])), np.zeros(len(r["accepted_at"]))
            t.reached_at = t.reached_at + np.asarray(r["reached_at"])
            t.accepted_at = t.accepted_at + np.asarray(r["accepted_at"])
            if "predicted_at" in r:
                t.predicted_at = _add(t.predicted_at, r["predicted_at"])
                t.k_steps = _add(t.k_steps, r["k_steps"])
            if "drafted" in r:
                t.drafted = (t.drafted or 0) + r["drafted"]
        if r.get("identical") is not None:
            t.compared += 1
            t.identical += bool(r["identical"])
    t.seconds = sum(c[0] for c in calls.values())
    t.prefill_seconds = sum(c[1] for c in calls.values())
    t.call_steps = sum(c[2] for c in calls.values())
    return t


def _add(total: np.ndarray, values: list) -> np.ndarray:
    values = np.asarray(values, np.float64)
    return values if not len(total) else total + values


def group(rows: list[dict], *keys: str) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        out.setdefault(tuple(r[k] for k in keys), []).append(r)
    return out


def speedups(method: Totals, plain: Totals) -> tuple[float, float, float]:
    """(measured decode speedup, end-to-end speedup, latency-model prediction) of a method over plain decoding."""
    return (
        method.decode_tokens_per_s / plain.decode_tokens_per_s,
        method.tokens_per_s / plain.tokens_per_s,
        method.tau * plain.seconds_per_step / method.seconds_per_step,
    )


def unit_arrays(rows: list[dict], method: str, units: list) -> dict[str, np.ndarray]:
    """Per-unit numerators/denominators of tau and decode throughput for one method, in `units` order."""
    per_unit = group([r for r in rows if r["method"] == method], "unit")
    sums = [totals(per_unit[(u,)]) for u in units]
    return {
        "emitted": np.array([s.accepted + s.steps for s in sums], np.float64),
        "steps": np.array([s.steps for s in sums], np.float64),
        "tokens": np.array([s.decode_tokens for s in sums], np.float64),
        "seconds": np.array([s.decode_seconds for s in sums], np.float64),
    }


def bootstrap_rows(rows: list[dict], drafters: list[str], tasks: list[str], resamples: int, seed: int) -> list[str]:
    """Markdown table rows: tau and speedup gains of each drafter over each other, per task and overall."""
    lines = []
    for scope in [*tasks, "all"]:
        scoped = rows if scope == "all" else [r for r in rows if r["task"] == scope]
        units = sorted({r["unit"] for r in scoped})
        arrays = {m: unit_arrays(scoped, m, units) for m in drafters}
        for a, b in itertools.combinations(drafters, 2):
            x, y = arrays[a], arrays[b]
            tau = paired_bootstrap(x["emitted"], x["steps"], y["emitted"], y["steps"], resamples=resamples, seed=seed)
            spd = paired_bootstrap(x["tokens"], x["seconds"], y["tokens"], y["seconds"], resamples=resamples, seed=seed)
            lines.append(f"| {scope} | {a} vs {b} | {len(units)} | {fmt_gain(tau)} | {fmt_gain(spd)} |")
    return lines


def speedup_interval(rows: list[dict], method: str, meta: dict) -> str:
    """`method`'s decode speedup over plain decoding on `rows`' units, with its paired bootstrap 95% interval,
    e.g. `0.97x [0.91, 1.02]`."""
    units = sorted({r["unit"] for r in rows})
    x, p = unit_arrays(rows, method, units), unit_arrays(rows, PLAIN, units)
    gain = paired_bootstrap(
        x["tokens"], x["seconds"], p["tokens"], p["seconds"], resamples=meta["bootstrap_resamples"], seed=meta["seed"]
    )
    return f"{fmt(1 + gain.point)}x [{fmt(1 + gain.low)}, {fmt(1 + gain.high)}]"


def fmt_gain(gain) -> str:
    return f"{gain.point * 100:+.1f}% [{gain.low * 100:+.1f}, {gain.high * 100:+.1f}]"


def fmt(x: float, digits: int = 2) -> str:
    return "n/a" if x is None or not np.isfinite(x) else f"{x:.{digits}f}"


def write_report(out_dir: str, rows: list[dict], meta: dict) -> list[str]:
    """Write `report.md` and the PNG plots into `out_dir`; returns their paths. `meta` holds `command`, `machine`
    (dict), `settings` (dict), `target`, `methods` (list of dicts with `name`, `kind`, `k`, `kv_bytes_per_token`,
    `kv_bytes_peak`; plain decoding first), `bootstrap_resamples` and `seed`."""
    methods = [m["name"] for m in meta["methods"]]
    drafters = [m for m in methods if m != PLAIN]
    tasks = [t for t in TASKS if any(r["task"] == t for r in rows)]
    by = {key: totals(rs) for key, rs in group(rows, "method", "task").items()}
    overall = {m: totals([r for r in rows if r["method"] == m]) for m in methods}
    plain = overall[PLAIN]
    machine = meta["machine"]
    greedy = meta["settings"]["temperature"] == 0
    lines = [
        f"# Speculative decoding evaluation: {meta['target']}",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Machine: {machine['cpu']}, {machine['cores']} cores; backend {machine['backend']} ({machine['devices']}); "
        f"jax {machine['jax']}; dtype {machine['dtype']}; measured read bandwidth "
        f"{machine.get('read_bandwidth_gbs', 'n/a')} GB/s. Absolute times (tokens/s, ms) are this machine's, "
        "measured while it may have been shared; ratios come from one run, all methods interleaved prompt by prompt.",
        "",
        "Settings: " + ", ".join(f"{k} {v}" for k, v in meta["settings"].items()) + ".",
        "",
        "## All tasks",
        "",
        "| method | k | tau | tokens/s | speedup | predicted (tau x T_plain / T_step) | end-to-end speedup "
        f"| ms per step | drafter KV bytes/token | drafter KV peak | {'lossless' if greedy else 'same as plain'} |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in meta["methods"]:
        t = overall[m["name"]]
        if m["name"] == PLAIN:
            cells = ["-", "1.00", fmt(t.tokens_per_s, 1), "1.00x", "-", "1.00x", fmt(t.seconds_per_step * 1e3), "-"]
            cells += ["-", "-"]
        else:
            measured, e2e, predicted = speedups(t, plain)
            same = f"{t.identical}/{t.compared}"
            cells = [str(m["k"]), fmt(t.tau), fmt(t.tokens_per_s, 1), f"{fmt(measured)}x", f"{fmt(predicted)}x"]
            cells += [f"{fmt(e2e)}x", fmt(t.seconds_per_step * 1e3), f"{m['kv_bytes_per_token']:,}"]
            cells += [f"{m['kv_bytes_peak']:,}", same]
        lines.append(f"| {m['name']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Plain decoding: {plain.rows} generations, {plain.tokens} tokens, "
        f"{fmt(plain.seconds_per_step * 1e3)} ms per forward (T_plain). Drafter KV peak: bytes of the drafter's own "
        "cache allocated for the largest batch x capacity of the run (H-Spec reads the target's cache: 0).",
        "",
        "## Per task",
        "",
        "| task | prompts | plain tokens/s | "
        + " | ".join(f"{m}: tau / slot-1 / speedup [95% CI] / predicted" for m in drafters)
        + " |",
        "|---|---|---|" + "---|" * len(drafters),
    ]
    for task in tasks:
        p = by[(PLAIN, task)]
        task_rows = [r for r in rows if r["task"] == task]
        cells = []
        for m in drafters:
            t = by[(m, task)]
            _, _, predicted = speedups(t, p)
            slot_1 = fmt(t.acceptance_by_position()[0]) if len(t.reached_at) else "n/a"
            interval = speedup_interval(task_rows, m, meta)
            cells.append(f"{fmt(t.tau)} / {slot_1} / {interval} / {fmt(predicted)}x")
        prompts = len({r["prompt_id"] for r in task_rows})
        lines.append(f"| {task} | {prompts} | {fmt(p.tokens_per_s, 1)} | " + " | ".join(cells) + " |")
    k_max = max((len(overall[m].reached_at) for m in drafters), default=0)
    lines += [
        "",
        "slot-1: the share of verified first drafts the target accepted (draft index 1 of the table below). "
        "speedup: decode throughput over plain decoding's on the task's prompts, with a paired bootstrap interval "
        f"over its prompts ({meta['bootstrap_resamples']} resamples). It covers how the prompts of this run differ, "
        "not how the same run differs on another process or day (for identical work, a few percent on a 2-core "
        "machine: benchmarks/results/plain_steps.md).",
        "",
        "## Conditional acceptance by draft index (all tasks; per task below)",
        "",
        "| method | task | " + " | ".join(str(i + 1) for i in range(k_max)) + " |",
        "|---|---|" + "---|" * k_max,
    ]
    for m in drafters:
        for task in ["all", *tasks]:
            t = overall[m] if task == "all" else by[(m, task)]
            rates = [fmt(x) for x in t.acceptance_by_position()] + [""] * (k_max - len(t.reached_at))
            lines.append(f"| {m} | {task} | " + " | ".join(rates) + " |")
    lines += draft_length_lines(meta["methods"], tasks, by, overall)
    calibrated = [m["name"] for m in meta["methods"] if m.get("confidence_head")]
    lines += calibration_lines(calibrated, overall, k_max)
    if len(drafters) >= 2:
        lines += [
            "",
            f"## Paired bootstrap: relative gains between drafters ({meta['bootstrap_resamples']} resamples, 95% CI)",
            "",
            "Units (prompts at batch size 1) are resampled jointly for both drafters. Speedup gain = ratio of decode "
            "throughputs.",
            "",
            "| task | drafters | units | tau gain [95% CI] | speedup gain [95% CI] |",
            "|---|---|---|---|---|",
            *bootstrap_rows(rows, drafters, tasks, meta["bootstrap_resamples"], meta["seed"]),
        ]
    plots = dict(PLOTS) if not calibrated else {**PLOTS, CALIBRATION_PLOT: CALIBRATION_TITLE}
    lines += ["", "## Plots", ""] + [f"![{title}]({name})" for name, title in plots.items()]
    os.makedirs(out_dir, exist_ok=True)
    report = os.path.join(out_dir, "report.md")
    with open(report, "w") as f:
        f.write("\n".join(lines) + "\n")
    paths = plot(out_dir, drafters, tasks, by, overall)
    if calibrated:
        paths.append(plot_calibration(out_dir, calibrated, overall))
    return [report, *paths]


def draft_length_lines(methods: list[dict], tasks: list[str], by: dict, overall: dict) -> list[str]:
    """Markdown: share of steps per draft length, per task, for the k=auto methods (none: no lines)."""
    adaptive = [m for m in methods if m["k"] == "auto"]
    if not adaptive:
        return []
    k_max = max(m["k_max"] for m in adaptive)
    lines = [
        "",
        "## Draft length chosen per step (k=auto; k = 0 is a plain step)",
        "",
        "drafted: the blocks the drafter drafted; declined: those the policy then did not verify (each cost the",
        "drafter's time and yielded nothing).",
        "",
        "| method | task | mean k | " + " | ".join(f"k={k}" for k in range(k_max + 1)) + " | drafted | declined |",
        "|---|---|---|" + "---|" * (k_max + 3),
    ]
    for m in adaptive:
        for task in ["all", *tasks]:
            t = overall[m["name"]] if task == "all" else by[(m["name"], task)]
            shares = t.k_shares()
            mean = float(np.dot(shares, np.arange(len(shares)))) if len(shares) else float("nan")
            cells = [fmt(x) for x in shares] + [""] * (k_max + 1 - len(shares))
            verified = round(float(t.k_steps[1:].sum())) if len(t.k_steps) else 0
            drafted = ["-", "-"] if t.drafted is None else [str(t.drafted), str(t.drafted - verified)]
            lines.append(f"| {m['name']} | {task} | {fmt(mean)} | " + " | ".join(cells + drafted) + " |")
    return lines


CALIBRATION_PLOT = "calibration.png"
CALIBRATION_TITLE = "confidence calibration: predicted vs observed acceptance per draft index"


def calibration_lines(methods: list[str], overall: dict, k_max: int) -> list[str]:
    """Markdown: predicted vs observed conditional acceptance per draft index, for drafters with a confidence
    head (none: no lines)."""
    if not methods:
        return []
    lines = [
        "",
        "## Confidence head calibration (all tasks): predicted / observed acceptance by draft index",
        "",
        "| method | " + " | ".join(str(i + 1) for i in range(k_max)) + " |",
        "|---|" + "---|" * k_max,
    ]
    for m in methods:
        t = overall[m]
        pairs = zip(t.predicted_by_position(), t.acceptance_by_position(), strict=True)
        cells = [f"{fmt(p)} / {fmt(o)}" for p, o in pairs] + [""] * (k_max - len(t.reached_at))
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return lines


def plot_calibration(out_dir: str, methods: list[str], overall: dict) -> str:
    """Reliability plot: per draft index, the mean predicted acceptance (x) against the observed one (y)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 5))
    ax.plot([0, 1], [0, 1], color="gray", linewidth=0.8, label="perfect calibration")
    for m in methods:
        t = overall[m]
        predicted, observed = t.predicted_by_position(), t.acceptance_by_position()
        ax.plot(predicted, observed, marker="o", label=m)
        for i, (x, y) in enumerate(zip(predicted, observed, strict=True)):
            if np.isfinite(x) and np.isfinite(y):
                ax.annotate(str(i + 1), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("predicted acceptance (mean over steps reaching draft i)")
    ax.set_ylabel("observed acceptance")
    ax.set_title("confidence calibration (all tasks)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(out_dir, CALIBRATION_PLOT)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot(out_dir: str, drafters: list[str], tasks: list[str], by: dict, overall: dict) -> list[str]:
    """The four PNG plots (see `PLOTS`); returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    x = np.arange(len(tasks) + 1)
    width = 0.8 / max(len(drafters), 1)
    labels = [*tasks, "all"]

    def bars(name, value, ylabel, reference):
        fig, ax = plt.subplots(figsize=(10, 4))
        for i, m in enumerate(drafters):
            values = [value(by[(m, t)], by[(PLAIN, t)]) for t in tasks] + [value(overall[m], overall[PLAIN])]
            ax.bar(x + (i - (len(drafters) - 1) / 2) * width, values, width, label=m)
        ax.axhline(reference, color="gray", linewidth=0.8)
        ax.set_xticks(x, labels, rotation=20)
        ax.set_ylabel(ylabel)
        ax.set_title(PLOTS[name])
        ax.legend()
        save(fig, name)

    def lines(name, curve, ylabel):
        fig, ax = plt.subplots(figsize=(6, 4))
        longest = 1
        for m in drafters:
            values = curve(overall[m])
            longest = max(longest, len(values))
            ax.plot(np.arange(1, len(values) + 1), values, marker="o", label=f"{m} ({overall[m].steps} steps)")
        ax.set_xticks(np.arange(1, longest + 1))  # draft indices are whole numbers
        ax.set_ylim(bottom=0)
        ax.set_xlabel("draft index i in the block")
        ax.set_ylabel(ylabel)
        ax.set_title(PLOTS[name] + " (all tasks)")
        ax.legend()
        save(fig, name)

    def save(fig, name):
        fig.tight_layout()
        path = os.path.join(out_dir, name)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)

    bars("tau_by_task.png", lambda t, _: t.tau, "tau (tokens per step)", 1.0)
    lines("acceptance_by_position.png", Totals.acceptance_by_position, "P(draft i accepted | drafts < i accepted)")
    bars("speedup_by_task.png", lambda t, p: speedups(t, p)[0], "decode speedup over plain (x)", 1.0)
    lines("tau_by_block_position.png", Totals.tau_by_block_position, "tau with the block cut after draft i")
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m eval.report", description=__doc__.split("\n")[0])
    parser.add_argument("dir", help="an evaluation directory: its report.md and plots are rewritten")
    out_dir = parser.parse_args(sys.argv[1:] if argv is None else argv).dir
    try:
        with open(os.path.join(out_dir, "results.jsonl")) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        with open(os.path.join(out_dir, "meta.json")) as f:
            meta = json.load(f)
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for path in write_report(out_dir, rows, meta):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
