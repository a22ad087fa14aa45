"""What the sampling filters cost per step on SmolLM2's vocabulary: the top-k threshold by XLA's TopK against
`sampling.kth_largest` (the same value), and the whole sampled distribution (`sampling.probabilities`) at
temperature 1 alone, with top-k, and with top-p (`sampling.top_p_cutoff`, against sorting the vocabulary as the
definition does), at 1 row (a plain decoding step) and 8 rows (a verification of 7 drafts plus the bonus).

    python -m benchmarks.sampling_filters [--vocab 49152] [--top-k 50] [--repeats 20]

Median of `--repeats` jitted calls on random logits. Writes `benchmarks/results/sampling_filters.md`.
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp

from benchmarks.common import median_time, write_report
from hspec_jax.decoding.sampling import SamplingConfig, kth_largest, probabilities, top_p_cutoff
from hspec_jax.machine import cpu_model

ROWS = (1, 8)


def call_time(fn, x, repeats: int) -> float:
    jitted = jax.jit(fn)
    jitted(x).block_until_ready()
    return median_time(lambda: jitted(x).block_until_ready(), repeats)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/results/sampling_filters.md")
    args = parser.parse_args(argv)
    k, cpu = args.top_k, cpu_model()
    cases = {
        f"top-{k} threshold, XLA TopK": lambda x: jax.lax.top_k(x, k)[0][..., -1:],
        f"top-{k} threshold, `kth_largest`": lambda x: kth_largest(x, k),
        "distribution, temperature 1": lambda x: probabilities(x, SamplingConfig(1.0)),
        f"distribution, temperature 1 + top-{k}": lambda x: probabilities(x, SamplingConfig(1.0, top_k=k)),
        "top-p 0.9 cutoff, sorting the vocabulary": lambda x: jnp.sort(x, axis=-1),
        "top-p 0.9 cutoff, `top_p_cutoff`": lambda x: top_p_cutoff(x, 0.9),
        "distribution, temperature 1 + top-p 0.9": lambda x: probabilities(x, SamplingConfig(1.0, top_p=0.9)),
    }
    logits = {m: jax.random.normal(jax.random.key(m), (m, args.vocab)) * 3 for m in ROWS}
    times = {name: {m: call_time(fn, logits[m], args.repeats) for m in ROWS} for name, fn in cases.items()}
    lines = [
        "# The sampling filters on a SmolLM2-sized vocabulary",
        "",
        f"Machine: {cpu}, {os.cpu_count()} CPUs; jax {jax.__version__} ({jax.default_backend()}).  ",
        f"Command: `python -m benchmarks.sampling_filters --vocab {args.vocab} --top-k {k} --repeats {args.repeats}`  ",
        f"Random fp32 logits [rows, {args.vocab}]; median of {args.repeats} jitted calls.",
        "",
        "| computation | " + " | ".join(f"{m} row{'s' * (m > 1)} ms" for m in ROWS) + " |",
        "|---|" + "---|" * len(ROWS),
    ]
    for name, by_rows in times.items():
        lines.append(f"| {name} | " + " | ".join(f"{by_rows[m] * 1e3:.2f}" for m in ROWS) + " |")
        print(name, "  ".join(f"{m} rows: {by_rows[m] * 1e3:.2f} ms" for m in ROWS))
    old, new = times[f"top-{k} threshold, XLA TopK"][8], times[f"top-{k} threshold, `kth_largest`"][8]
    sort, cut = times["top-p 0.9 cutoff, sorting the vocabulary"][8], times["top-p 0.9 cutoff, `top_p_cutoff`"][8]
    lines += [
        "",
        f"At 8 rows `kth_largest` finds the top-{k} threshold **{old / new:.0f}x** faster than XLA's TopK, and "
        f"`top_p_cutoff` the top-p cutoff **{sort / cut:.1f}x** faster than the sort alone costs ({cpu}).",
    ]
    write_report(args.out, lines)


if __name__ == "__main__":
    main()
