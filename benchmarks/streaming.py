"""What streaming costs: decoding in chunks of a few steps (host sync between chunks) vs one uninterrupted loop.

    python -m benchmarks.streaming [--new-tokens 128] [--rounds 5] [--chunks 1,4,8,16]

`eval.generate` runs the jitted decoding loop in chunks of `--chunk` steps (default `DEFAULT_CHUNK`), donating
the caches from one chunk to the next, so that it can print tokens as they come and stop on Ctrl-C within a
chunk. Each chunk boundary costs a dispatch and a host sync (tokens, counts and done flags come back) during
which the device waits. On the embedded SmolLM2, with exactly `--new-tokens` tokens (EOS ignored), for plain
decoding and for draft-and-verify (a random H-Spec drafter, k = 7):

* the boundary cost is measured directly: the median over many calls of a zero-step chunk and its host view
  (the same compiled function; the chunk length is a traced argument);
* the decoding time of one uninterrupted loop (a single chunk of all the steps) is the median over rounds;
* overhead at a chunk size = boundary cost x (chunks - 1) / one-loop time. The chunked runs are also timed
  directly, every round running each chunk size in turn so that load changes hit them alike; on a shared
  machine that direct comparison is within the noise, which is why the derived figure is the one to read.

Writes `benchmarks/results/streaming.md`.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import PROMPTS, median_time, write_report
from hspec_jax.chat import chat_prompt_ids
from hspec_jax.checkpoints import load_target, load_tokenizer
from hspec_jax.decoding import Bundle, SamplingConfig, pad_batch
from hspec_jax.decoding.engine import DEFAULT_CHUNK, compile_autoregressive, compile_speculative, generate_streaming
from hspec_jax.drafters import init_drafter, init_from_target
from hspec_jax.drafters.vocab import build_draft_vocab
from hspec_jax.machine import cpu_model
from hspec_jax.recipes import drafter_from_recipe, load_config


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chunks", default="1,4,8,16")
    parser.add_argument("--boundary-calls", type=int, default=200)
    parser.add_argument("--out", default="benchmarks/results/streaming.md")
    args = parser.parse_args(argv)
    n = args.new_tokens
    chunks = sorted({int(c) for c in args.chunks.split(",")} | {DEFAULT_CHUNK})

    target, params = load_target("smollm2")
    tokenizer = load_tokenizer("smollm2")
    ids = chat_prompt_ids(tokenizer, PROMPTS[0])
    tokens, lengths = pad_batch([ids])
    drafter = drafter_from_recipe(load_config("smollm2"), "hspec", target)
    vocab = build_draft_vocab(np.asarray(ids), target.vocab_size, drafter.vocab_size, always=target.eos_token_ids)
    dparams = init_from_target(init_drafter(drafter, jax.random.key(0)), drafter, params, vocab)
    kw = dict(max_new_tokens=n, sampling=SamplingConfig(), eos_ids=(), pad_id=0, seed=0)
    capacity = len(ids) + n + drafter.num_drafts + 1
    engines = {
        "plain": compile_autoregressive(params, target, tokens, lengths, capacity, **kw),
        "spec": compile_speculative(Bundle(params, target, dparams, drafter, vocab), tokens, lengths, capacity, **kw),
    }
    sizes = [n, *chunks]
    times = {(mode, size): [] for mode in engines for size in sizes}
    steps, boundary = {}, {}
    for _ in range(args.rounds):
        for (mode, size), samples in times.items():
            result = generate_streaming(engines[mode], size)
            assert int(result.num_tokens[0]) == n
            samples.append(result.decode_seconds)
            steps[mode] = int(result.stats.steps[0]) if result.stats is not None else n - 1
    zero = jnp.int32(0)
    for mode, engine in engines.items():
        carry = jax.block_until_ready(engine.start())

        def boundary_call(engine=engine):
            nonlocal carry
            carry = engine.step(carry, zero)
            engine.view(carry)

        boundary_call()
        boundary[mode] = median_time(boundary_call, repeats=args.boundary_calls)
    rows, default_overhead = [], {}
    for mode in engines:
        whole = statistics.median(times[mode, n])
        rows.append(f"| {mode} | one loop | 1 | {whole * 1e3:.0f} | - | - |")
        for chunk in chunks:
            t = statistics.median(times[mode, chunk])
            count = -(-steps[mode] // chunk)
            derived = boundary[mode] * (count - 1) / whole
            rows.append(f"| {mode} | {chunk} | {count} | {t * 1e3:.0f} | {t / whole - 1:+.1%} | {derived:+.2%} |")
            if chunk == DEFAULT_CHUNK:
                default_overhead[mode] = derived
        print("\n".join(rows[-len(chunks) - 1 :]), flush=True)
    lines = [
        "# Streaming: decoding in chunks vs one loop (SmolLM2-135M-Instruct, fp32, CPU)",
        "",
        f"Command: `python -m benchmarks.streaming --new-tokens {n} --rounds {args.rounds} --chunks {args.chunks} "
        f"--boundary-calls {args.boundary_calls}`  ",
        f"Machine: {cpu_model()} ({platform.machine()}, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.1f} at the end); jax {jax.__version__}. "
        "Shared machine: the rounds interleave all engines; medians over rounds.  ",
        f"Batch 1, greedy, {n} new tokens (EOS ignored); `spec` is draft-and-verify with a random H-Spec drafter "
        f"(k = {drafter.num_drafts}, tau ~ 1, so about one step per token). Decoding time only (prefill excluded). "
        f"Cost of one chunk boundary (median of {args.boundary_calls} zero-step chunks + host view): plain "
        f"{boundary['plain'] * 1e3:.2f} ms, speculative {boundary['spec'] * 1e3:.2f} ms. `overhead` = that cost x "
        "(chunks - 1) / the one-loop decoding time; `direct` compares the timed runs themselves (medians over "
        "rounds, within the machine's noise).",
        "",
        "| loop | steps per chunk | chunks | decode ms | direct | overhead |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        f"At the default of {DEFAULT_CHUNK} steps per chunk: **plain {default_overhead['plain']:+.2%}, speculative "
        f"{default_overhead['spec']:+.2%}** (goal: under 3%).",
    ]
    write_report(args.out, lines)


if __name__ == "__main__":
    main()
