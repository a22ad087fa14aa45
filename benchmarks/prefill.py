"""Prefill speed on long prompts, embedded SmolLM2-135M: hspec-jax vs transformers, same run.

    python -m benchmarks.prefill [--lengths 1024,4096,8192] [--repeats 2] [--dense-up-to 4096]

For each length, a prompt of exactly that many tokens (chat text repeated) is prefilled into an empty cache
with room for 64 more tokens; logits at the last position only, as generation needs. hspec-jax runs
`decoding.autoregressive.prefill` compiled ahead of time: prompts longer than `LONG_INPUT` go through the
blocked attention (online softmax over key blocks, no [T, S] scores). For reference, the dense attention it
replaced ([T, S] scores for the whole prompt) is timed too, up to `--dense-up-to` tokens (its scores alone
take 9 x T^2 x 4 bytes per layer). transformers runs one forward with `use_cache=True, logits_to_keep=1`
after a warm-up. Best of `--repeats`, fp32 on CPU. Writes `benchmarks/results/prefill.md`.
"""

from __future__ import annotations

import argparse
import os
import platform

import jax
import jax.numpy as jnp
import numpy as np
import torch

from benchmarks.common import PROMPTS, median_time, write_report
from benchmarks.decode import hf_model
from hspec_jax.checkpoints import load_target, load_tokenizer
from hspec_jax.decoding.autoregressive import prefill
from hspec_jax.machine import cpu_model
from hspec_jax.models import decoder, init_cache


def prompt_of(tokenizer, length: int) -> np.ndarray:
    """`[1, length]` token ids: the benchmark prompts repeated as plain text, cut to `length`."""
    ids = tokenizer(" ".join(PROMPTS))["input_ids"]
    return np.asarray((ids * (length // len(ids) + 1))[:length], np.int32)[None]


def time_ours(params, config, tokens: np.ndarray, repeats: int) -> float:
    """Best wall time of a compiled prefill over `tokens` into a fresh cache (cache creation not timed)."""
    tokens = jnp.asarray(tokens)
    lengths = jnp.asarray([tokens.shape[1]], jnp.int32)
    capacity = tokens.shape[1] + 64
    rng = jax.random.key(0)
    compiled = prefill.lower(params, config, tokens, lengths, init_cache(config, 1, capacity), rng).compile()
    times = []
    for _ in range(repeats):
        cache = jax.block_until_ready(init_cache(config, 1, capacity))
        times.append(median_time(lambda c=cache: jax.block_until_ready(compiled(params, tokens, lengths, c, rng)), 1))
    return min(times)


def time_theirs(model, tokens: np.ndarray, repeats: int) -> float:
    ids = torch.tensor(tokens, dtype=torch.long)
    with torch.no_grad():
        model(ids[:, :64], use_cache=True, logits_to_keep=1)  # warm-up
        return min(median_time(lambda: model(ids, use_cache=True, logits_to_keep=1), 1) for _ in range(repeats))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="1024,4096,8192")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dense-up-to", type=int, default=4096)
    parser.add_argument("--out", default="benchmarks/results/prefill.md")
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]

    config, params = load_target("smollm2")
    tokenizer = load_tokenizer("smollm2")
    model = hf_model()
    rows, ratios = [], []
    for length in lengths:
        tokens = prompt_of(tokenizer, length)
        ours = time_ours(params, config, tokens, args.repeats)
        theirs = time_theirs(model, tokens, args.repeats)
        dense = "-"
        if length <= args.dense_up_to:
            long_input, decoder.LONG_INPUT = decoder.LONG_INPUT, length  # this length takes the dense path
            jax.clear_caches()  # retrace with the dense path
            try:
                dense = f"{time_ours(params, config, tokens, args.repeats):.2f}"
            finally:
                decoder.LONG_INPUT = long_input
                jax.clear_caches()
        ratios.append(ours / theirs)
        rows.append(f"| {length} | {ours:.2f} | {theirs:.2f} | {ours / theirs:.2f}x | {length / ours:.0f} | {dense} |")
        print(rows[-1], flush=True)
    lines = [
        "# Prefill of long prompts: hspec-jax vs transformers (SmolLM2-135M-Instruct, fp32, CPU)",
        "",
        f"Command: `python -m benchmarks.prefill --lengths {args.lengths} --repeats {args.repeats} "
        f"--dense-up-to {args.dense_up_to}`  ",
        f"Machine: {cpu_model()} ({platform.machine()}, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.1f} at the end); jax {jax.__version__}, "
        f"torch {torch.__version__}. Shared machine: compare within this table, not with other days.  ",
        "Batch 1, one prompt of exactly the given length, logits at the last position only, best of the repeats. "
        "hspec-jax: blocked attention (query blocks x key blocks, online softmax); `dense` is the attention it "
        "replaced, which builds [T, S] scores for the whole prompt (not run beyond --dense-up-to).",
        "",
        "| prompt tokens | hspec-jax s | transformers s | hspec-jax / transformers | hspec-jax tok/s | dense s |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        f"Worst ratio: **{max(ratios):.2f}x** transformers' time (goal: at most 1.5x).",
    ]
    write_report(args.out, lines)


if __name__ == "__main__":
    main()
