"""Draft-vocabulary coverage: which share of the target's own greedy tokens on the evaluation prompts a draft
vocabulary of each size holds (a token outside it is a sure rejection), per task.

    python -m benchmarks.vocab_coverage [--data SPEC] [--sizes 8192,16384,32768,49152] [--num-prompts 5] \\
        [--max-new-tokens 128] [--drafter smollm2-hspec]

The vocabularies are built the way `train.main` builds them: the top tokens by count among the supervised
(assistant) tokens of `--data` (default: the target-written SmolLM2 training files in `data/`), EOS always kept.
The target (SmolLM2) answers the first turn of `--num-prompts` prompts per evaluation task greedily, up to
`--max-new-tokens` tokens (stop token included). `--drafter` adds the vocabulary a trained drafter ships with.
Beside each size: the drafter step time T_D (k = 7, batch 1, 256 cached rows; `benchmarks/drafter_forward.py`)
of the `--recipe` drafter with that many draft tokens (its lm_head grows with the vocabulary), median of
`--repeats`. Writes `benchmarks/results/vocab_coverage.md`.
"""

from __future__ import annotations

import argparse
import collections
import os

import jax
import numpy as np

from benchmarks.common import write_report
from benchmarks.drafter_forward import time_step
from hspec_jax.chat import ChatEncoder
from hspec_jax.checkpoints.drafter_io import read_drafter_meta
from hspec_jax.decoding import SamplingConfig
from hspec_jax.drafters.vocab import draft_vocab_from_counts
from hspec_jax.machine import cpu_model
from hspec_jax.prompts import TASKS, load_prompts
from hspec_jax.recipes import load_config
from train.data import load_mixture
from train.generation import BatchGenerator
from train.pipeline import supervised_token_counts
from train.targets import load_target_and_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_DATA = ",".join(
    f"{name}={os.path.join(ROOT, 'data', f'smollm2_{name}.jsonl')}" for name in ("sharegpt_v2", "magpie")
)


def greedy_answers(generator: BatchGenerator, encoder: ChatEncoder, prompts) -> dict[str, list[list[int]]]:
    """task -> the target's greedy answer ids (stop token included) to the first turn of each prompt."""
    answers = collections.defaultdict(list)
    stop = generator.config.eos_token_ids[0]
    for at in range(0, len(prompts), generator.batch_size):
        batch = prompts[at : at + generator.batch_size]
        outs = generator([encoder.encode(p, []) for p in batch], jax.random.key(0))
        for prompt, (ids, stopped) in zip(batch, outs, strict=True):
            answers[prompt.task].append(ids + [stop] * stopped)
    return answers


def coverage(answers: dict[str, list[list[int]]], t2d: np.ndarray) -> dict[str, float]:
    """task (and "all") -> share of the answers' tokens inside the vocabulary whose membership mask is `t2d`."""
    shares = {task: float(np.mean(t2d[np.concatenate(ids)])) for task, ids in answers.items()}
    shares["all"] = float(np.mean(t2d[np.concatenate([np.concatenate(ids) for ids in answers.values()])]))
    return shares


def drafter_step_ms(recipe: str, size: int, repeats: int) -> float:
    """T_D in ms of the `recipe`'s H-Spec drafter with a draft vocabulary of `size` tokens."""
    config = load_config(recipe)
    config.drafter.draft_vocab_size = size
    return 1e3 * time_step(config, "hspec", 1, 256, repeats)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default=DEFAULT_DATA, help="source spec of the data the vocabularies come from")
    parser.add_argument("--sizes", default="8192,16384,32768,49152")
    parser.add_argument("--num-prompts", type=int, default=5, help="per evaluation task")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--drafter", default="smollm2-hspec", help="a drafter whose vocabulary is measured too")
    parser.add_argument("--recipe", default="smollm2", help="the drafter recipe whose step time is measured")
    parser.add_argument("--repeats", type=int, default=20, help="timed drafter steps per vocabulary size")
    parser.add_argument("--out", default="benchmarks/results/vocab_coverage.md")
    args = parser.parse_args(argv)
    config, params, tokenizer = load_target_and_tokenizer("smollm2")
    counts = supervised_token_counts(load_mixture(args.data), tokenizer, config.vocab_size)
    vocabularies, step_ms = {}, {}
    for size in (int(s) for s in args.sizes.split(",")):
        vocab = draft_vocab_from_counts(counts, size, always=config.eos_token_ids)
        vocabularies[f"top {size} of the data"] = np.asarray(vocab.t2d)
        step_ms[f"top {size} of the data"] = drafter_step_ms(args.recipe, size, args.repeats)
    if args.drafter:
        vocab = read_drafter_meta(args.drafter, config)[1]
        vocabularies[f"{args.drafter} ({int(np.asarray(vocab.t2d).sum())})"] = np.asarray(vocab.t2d)
    generator = BatchGenerator(config, params, tokenizer, args.batch_size, args.max_new_tokens, SamplingConfig())
    answers = greedy_answers(generator, ChatEncoder(tokenizer), load_prompts("all", args.num_prompts))
    tasks = [t for t in TASKS if t in answers]
    tokens = {t: sum(map(len, answers[t])) for t in tasks}
    lines = [
        "# Draft-vocabulary coverage of SmolLM2's greedy answers on the evaluation prompts",
        "",
        f"Command: `python -m benchmarks.vocab_coverage --sizes {args.sizes} --num-prompts {args.num_prompts} "
        f"--max-new-tokens {args.max_new_tokens}{f' --drafter {args.drafter}' if args.drafter else ''}`"
        + ("" if args.data == DEFAULT_DATA else f" `--data {args.data}`")
        + "  ",
        f"CPU: {cpu_model()}. Vocabularies from {int(counts.sum())} supervised tokens of the data "
        f"({int((counts > 0).sum())} distinct); "
        f"answers: the first turn of {args.num_prompts} prompts per task, greedy, up to {args.max_new_tokens} "
        "tokens (stop token included). A token outside the draft vocabulary is a sure rejection; a size above the "
        "number of distinct tokens in the data is filled up with unseen tokens in id order. T_D: the "
        f"`{args.recipe}` H-Spec drafter's step (k = 7, batch 1, 256 cached rows, random weights) with a draft "
        f"vocabulary of that size, median of {args.repeats}.",
        "",
        "| vocabulary | " + " | ".join(f"{t} ({tokens[t]} tok)" for t in tasks) + " | all | T_D ms |",
        "|---|" + "---|" * (len(tasks) + 2),
    ]
    for name, t2d in vocabularies.items():
        shares = coverage(answers, t2d)
        cells = [f"{100 * shares[t]:.1f}%" for t in [*tasks, "all"]]
        cells.append(f"{step_ms[name]:.1f}" if name in step_ms else "")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    write_report(args.out, lines)


if __name__ == "__main__":
    main()
