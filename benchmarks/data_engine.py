"""Data-generation throughput on SmolLM2: static batches (the data tools' earlier way) vs the continuous-batching
data engine of `train.regenerate`, same prompts, same run.

    python -m benchmarks.data_engine [--prompts 64] [--max-new-tokens 256] [--slots 8,16,32] [--static-batch 16]

The prompts are first user turns of ShareGPT (shuffled with seed 1, chat template applied, at most 512 tokens),
answered greedily up to `--max-new-tokens` tokens. "static" pads `--static-batch` prompts into one batch (sorted
by length within windows, as the earlier `train.regenerate` did) and decodes until the batch's longest answer
ends; "continuous" is `train.regenerate`'s engine (`ServingEngine`, dense layout) at each slot count. Every
method is warmed up on other prompts first (compilation excluded). Throughput counts the answers' tokens (EOS
included) per second of wall time. Writes `benchmarks/results/data_engine.md`.
"""

from __future__ import annotations

import argparse
import platform
import time
import types

import jax
import numpy as np

from benchmarks.common import write_report
from hspec_jax.chat import encode, render
from hspec_jax.decoding import SamplingConfig
from hspec_jax.decoding.engine import stop_ids
from hspec_jax.machine import cpu_model
from train.chat import user_texts
from train.data import load_mixture
from train.generation import BatchGenerator
from train.regenerate import build_engine
from train.targets import load_target_and_tokenizer

MAX_PROMPT = 512


def sharegpt_prompts(tokenizer, count: int) -> list[list[int]]:
    """`count` chat-formatted first user turns of ShareGPT of at most MAX_PROMPT tokens (seed-1 shuffle)."""
    conversations = [c for s in load_mixture("sharegpt", exclude_texts=()) for c in s.conversations]
    prompts = []
    for i in np.random.default_rng(1).permutation(len(conversations)):
        text = user_texts(conversations[i].messages)[0]
        ids = encode(tokenizer, render(tokenizer, [{"role": "user", "content": text}], add_generation_prompt=True))
        if len(ids) <= MAX_PROMPT:
            prompts.append(ids)
        if len(prompts) == count:
            return prompts
    raise ValueError(f"only {len(prompts)} usable prompts")


def run_static(generator: BatchGenerator, prompts, window: int = 16) -> tuple[list[list[int]], float]:
    """Answers (with EOS) and seconds, batches formed within length-sorted windows as the earlier tool did."""
    order = []
    span = generator.batch_size * window
    for start in range(0, len(prompts), span):
        order += sorted(range(start, min(start + span, len(prompts))), key=lambda i: len(prompts[i]))
    answers = [None] * len(prompts)
    begin = time.perf_counter()
    for at in range(0, len(order), generator.batch_size):
        batch = order[at : at + generator.batch_size]
        for i, (ids, stopped) in zip(batch, generator([prompts[i] for i in batch], jax.random.key(0)), strict=True):
            answers[i] = ids + ([-1] if stopped else [])  # -1 stands for the stop token in the count
    return answers, time.perf_counter() - begin


def run_continuous(engine, prompts) -> tuple[list[list[int]], float]:
    """Answers (with EOS) and seconds of every prompt submitted at once to the serving engine."""
    from hspec_jax.serving import Request

    begin = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.submit(Request(str(i), tuple(p)))
    answers = {}
    while engine.busy:
        answers.update((int(c.request.id), c.tokens.tolist()) for c in engine.step())
    return [answers[i] for i in range(len(prompts))], time.perf_counter() - begin


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--slots", default="8,16,32")
    parser.add_argument("--static-batch", type=int, default=16)
    parser.add_argument("--out", default="benchmarks/results/data_engine.md")
    args = parser.parse_args(argv)
    slot_counts = [int(s) for s in args.slots.split(",")]
    config, params, tokenizer = load_target_and_tokenizer("smollm2")
    pool = sharegpt_prompts(tokenizer, args.prompts + max([*slot_counts, args.static_batch]) * 2)
    prompts, warm = pool[: args.prompts], pool[args.prompts :]
    eos = tuple(stop_ids(config, tokenizer))
    rows = []

    generator = BatchGenerator(config, params, tokenizer, args.static_batch, args.max_new_tokens, SamplingConfig())
    widths = {}
    for p in warm + prompts:  # one warm batch per prompt-width bucket the timed run will meet
        widths.setdefault(max(16, 1 << (len(p) - 1).bit_length()), p)
    for p in widths.values():
        generator([p], jax.random.key(0))
    answers, seconds = run_static(generator, prompts)
    reference = answers
    rows.append((f"static batches of {args.static_batch}", answers, seconds))
    print(f"static: {sum(map(len, answers))} tokens in {seconds:.1f} s", flush=True)

    for slots in slot_counts:
        settings = types.SimpleNamespace(
            batch_size=slots,
            max_prompt_tokens=MAX_PROMPT,
            max_new_tokens=args.max_new_tokens,
            prefill_chunk=128,
            steps_per_iteration=16,
            temperature=0.0,
            seed=0,
        )
        engine = build_engine(config, params, tokenizer, settings)
        run_continuous(engine, warm[:slots])
        answers, seconds = run_continuous(engine, prompts)
        answers = [[*a[:-1], -1] if a and a[-1] in eos else a for a in answers]
        rows.append((f"continuous, {slots} slots", answers, seconds))
        print(f"continuous {slots}: {sum(map(len, answers))} tokens in {seconds:.1f} s", flush=True)

    base = sum(map(len, rows[0][1])) / rows[0][2]
    lines = [
        "# Data-generation throughput: static batches vs continuous batching (SmolLM2-135M, greedy, CPU)",
        "",
        f"Command: `python -m benchmarks.data_engine --prompts {args.prompts} --max-new-tokens "
        f"{args.max_new_tokens} --slots {args.slots} --static-batch {args.static_batch}`  ",
        f"Machine: {cpu_model()}, {platform.machine()}; jax {jax.__version__}; fp32.  ",
        f"{args.prompts} ShareGPT first turns (<= {MAX_PROMPT} tokens, seed-1 shuffle), answers up to "
        f"{args.max_new_tokens} tokens; compilation excluded (warmed up on other prompts).",
        "",
        "| method | answer tokens | seconds | tokens/s | vs static | answers identical to static |",
        "|---|---|---|---|---|---|",
    ]
    for name, answers, seconds in rows:
        same = sum(a == r for a, r in zip(answers, reference, strict=True))
        tokens = sum(map(len, answers))
        lines.append(
            f"| {name} | {tokens} | {seconds:.1f} | {tokens / seconds:.1f} | {tokens / seconds / base:.2f}x | "
            f"{same}/{len(answers)} |"
        )
    print("\n".join(lines))
    write_report(args.out, lines)


if __name__ == "__main__":
    main()
