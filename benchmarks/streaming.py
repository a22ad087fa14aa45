"""What streaming costs: decoding in chunks of a few steps (host sync between chunks) vs one uninterrupted loop.

    python -m benchmarks.streaming [--new-tokens 128] [--rounds 5] [--chunks 1,2,4,8,16]

`eval.generate` runs the jitted decoding loop in chunks of `--chunk` steps (default `DEFAULT_CHUNK`), donating
the caches from one chunk to the next, so that it can print tokens as they come and stop on Ctrl-C within a
chunk. Each chunk ends with a host sync (the tokens, counts and done flags come back). This measures the
decoding time at each chunk size against the same loop run as a single chunk, for plain decoding and for
draft-and-verify (a random H-Spec drafter, k = 7), on the embedded SmolLM2 with exactly `--new-tokens` tokens
(EOS ignored). All engines are compiled first; then every round runs each engine once, in turn, so that load
changes on the shared machine hit all of them alike; the table gives the median over rounds. The per-chunk cost
is also derived from the chunk-size-1 run, which has the most chunks. Writes `benchmarks/results/streaming.md`.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics

import jax
import numpy as np

from benchmarks.common import PROMPTS, cpu_model, write_report
from eval.generate import DEFAULT_CHUNK, compile_autoregressive, compile_speculative, generate_streaming
from hspec_jax.checkpoints import load_target, load_tokenizer
from hspec_jax.decoding import SamplingConfig, chat_prompt_ids, pad_batch
from hspec_jax.drafters import init_drafter, init_from_target
from hspec_jax.drafters.vocab import build_draft_vocab
from hspec_jax.recipes import drafter_from_recipe, load_config


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chunks", default="1,2,4,8,16")
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
    capacity = len(ids) + n + drafter.block_size
    engines = {}
    for chunk in [*chunks, n]:
        engines["plain", chunk] = compile_autoregressive(params, target, tokens, lengths, capacity, chunk=chunk, **kw)
        engines["spec", chunk] = compile_speculative(
            params, target, dparams, drafter, vocab, tokens, lengths, capacity, chunk=chunk, **kw
        )
    times = {key: [] for key in engines}
    steps = {}
    for _ in range(args.rounds):
        for key, engine in engines.items():
            result = generate_streaming(engine)
            assert int(result.num_tokens[0]) == n
            times[key].append(result.decode_seconds)
            steps[key[0]] = int(result.stats.steps[0]) if result.stats is not None else n - 1
    rows, default_overhead = [], {}
    for mode in ("plain", "spec"):
        whole = statistics.median(times[mode, n])
        per_chunk = (statistics.median(times[mode, 1]) - whole) / (steps[mode] - 1)
        rows.append(f"| {mode} | one loop | 1 | {whole * 1e3:.0f} | - | - |")
        for chunk in chunks:
            t = statistics.median(times[mode, chunk])
            count = -(-steps[mode] // chunk)
            derived = per_chunk * (count - 1) / whole
            rows.append(f"| {mode} | {chunk} | {count} | {t * 1e3:.0f} | {t / whole - 1:+.1%} | {derived:+.1%} |")
            if chunk == DEFAULT_CHUNK:
                default_overhead[mode] = (t / whole - 1, derived)
        print("\n".join(rows[-len(chunks) - 1 :]), flush=True)
    lines = [
        "# Streaming: decoding in chunks vs one loop (SmolLM2-135M-Instruct, fp32, CPU)",
        "",
        f"Command: `python -m benchmarks.streaming --new-tokens {n} --rounds {args.rounds} --chunks {args.chunks}`  ",
        f"Machine: {cpu_model()} ({platform.machine()}, {os.cpu_count()} CPUs); jax {jax.__version__}. "
        "Shared machine: the rounds interleave all engines; medians over rounds.  ",
        f"Batch 1, greedy, {n} new tokens (EOS ignored); `spec` is draft-and-verify with a random H-Spec drafter "
        f"(k = {drafter.num_drafts}, tau ~ 1, so about one step per token). Decoding time only (prefill excluded). "
        "`measured` compares the chunked run with the one-loop run directly; `from per-chunk cost` multiplies the "
        "cost of one chunk boundary, derived from the chunk-size-1 run, by the number of boundaries (less noisy "
        "for large chunks).",
        "",
        "| loop | steps per chunk | chunks | decode ms | overhead, measured | overhead, from per-chunk cost |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        f"At the default of {DEFAULT_CHUNK} steps per chunk: plain {default_overhead['plain'][0]:+.1%} measured "
        f"({default_overhead['plain'][1]:+.1%} derived), speculative {default_overhead['spec'][0]:+.1%} measured "
        f"({default_overhead['spec'][1]:+.1%} derived); goal under 3%.",
    ]
    write_report(args.out, lines)


if __name__ == "__main__":
    main()
