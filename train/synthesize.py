"""Magpie-style self-synthesis: user instructions sampled from the target itself (JSONL out, resumable).

    python -m train.synthesize --target smollm2 --out synth.jsonl --num 1000 \\
        [--batch-size 8 --max-new-tokens 128 --temperature 1.0 --top-p 1.0 --seed 0 --min-length 16]

The target is given only the chat template up to the start of a user turn (for SmolLM2 its default system
message, then `<|im_start|>user\\n`) and samples the user message; a sample counts when it ends with the
end-of-turn token within `--max-new-tokens`, has at least `--min-length` characters (after stripping), and its
`normalize_text` form is new (deduplicated against everything in the file). Each line is
`{"id": "synth-<seed>-<n>", "source": "synthesize", "messages": [{"role": "user", "content": ...}]}`; the
answers come from `train.regenerate --sources synth=FILE.jsonl`.

Resumable: rerunning the same command continues until the file holds `--num` records (a partial last line is
cut). Batch k after n records is sampled with the key fold(seed, n, attempt), so a resumed run draws what an
uninterrupted one would.
"""

from __future__ import annotations

import argparse
import logging
import sys

import jax

from hspec_jax.chat import encode, render
from hspec_jax.cli import ArgumentParser, non_negative_int, positive_int, probability, run
from hspec_jax.decoding import SamplingConfig
from hspec_jax.errors import InputError
from train.chat import normalize_text
from train.checks import target_config
from train.generation import BatchGenerator
from train.jsonl import JsonlAppender, check_out_file
from train.targets import load_target_and_tokenizer

log = logging.getLogger("train.synthesize")
SENTINEL = "\x00USER-MESSAGE\x00"


def parse_args(argv=None) -> argparse.Namespace:
    parser = ArgumentParser(prog="python -m train.synthesize", description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="smollm2", help="target spec: smollm2, tiny, an HF dir, .gguf or Orbax dir")
    parser.add_argument("--out", required=True, help="output JSONL file (appended to; rerun to resume)")
    parser.add_argument("--num", type=positive_int, required=True, help="number of instructions the file should hold")
    parser.add_argument("--batch-size", type=positive_int, default=8)
    parser.add_argument("--max-new-tokens", type=positive_int, default=128, help="longest instruction, in tokens")
    parser.add_argument("--temperature", type=float, default=1.0, help="must be > 0 (greedy repeats itself)")
    parser.add_argument("--top-p", type=probability, default=1.0)
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument(
        "--min-length", type=non_negative_int, default=16, help="shortest instruction kept, in characters"
    )
    parser.add_argument(
        "--max-idle-batches", type=positive_int, default=50, help="give up after this many batches in a row add nothing"
    )
    args = parser.parse_args(argv)
    if not args.temperature > 0:
        parser.error("--temperature must be > 0: greedy decoding would sample the same instruction every time")
    return args


def user_turn_prefix(tokenizer) -> list[int]:
    """Token ids of the chat template up to the start of a user message's content."""
    text = render(tokenizer, [{"role": "user", "content": SENTINEL}])
    return encode(tokenizer, text[: text.index(SENTINEL)])


def accepted(texts: list[str], seen: set[str], min_length: int) -> list[str]:
    """The texts long enough and new after `normalize_text` (in order; `seen` is updated)."""
    kept = []
    for text in texts:
        key = normalize_text(text)
        if len(text) >= min_length and key and key not in seen:
            seen.add(key)
            kept.append(text)
    return kept


def instructions(records: list[dict], path: str) -> set[str]:
    """The `normalize_text` forms of the instructions a file of this tool holds; another file is an error."""
    try:
        return {normalize_text(r["messages"][0]["content"]) for r in records}
    except (KeyError, IndexError, TypeError):
        raise InputError(f"{path} holds records that are not this tool's instructions: use another --out") from None


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", force=True)
    from tqdm import tqdm

    check_out_file(args.out)
    target_config(args.target)
    with JsonlAppender(args.out, check=instructions) as out:  # another kind of file: refused before loading
        config, params, tokenizer = load_target_and_tokenizer(args.target)
        sampling = SamplingConfig(args.temperature, top_p=args.top_p)
        generator = BatchGenerator(config, params, tokenizer, args.batch_size, args.max_new_tokens, sampling)
        prompt = user_turn_prefix(tokenizer)
        key = jax.random.key(args.seed)
        seen = instructions(out.records, args.out)
        count, attempt = len(out.records), 0
        bar = tqdm(total=args.num, initial=min(count, args.num), unit="instr", dynamic_ncols=True)
        try:
            while count < args.num:
                rng = jax.random.fold_in(jax.random.fold_in(key, count), attempt)
                samples = generator([prompt] * args.batch_size, rng)
                texts = [generator.text(ids).strip() for ids, stopped in samples if stopped]
                new = accepted(texts, seen, args.min_length)[: args.num - count]
                out.append(
                    [
                        {"id": f"synth-{args.seed}-{count + i}", "source": "synthesize", "messages": [m]}
                        for i, m in enumerate({"role": "user", "content": t} for t in new)
                    ]
                )
                count += len(new)
                attempt = 0 if new else attempt + 1
                bar.update(len(new))
                if attempt >= args.max_idle_batches:
                    log.error("%d batches in a row gave no new instruction; stopping at %d", attempt, count)
                    return 1
        except KeyboardInterrupt:
            bar.close()
            raise KeyboardInterrupt(f"{args.out} holds {count} complete instructions; rerun to continue") from None
        bar.close()
    log.info("%s holds %d instructions", args.out, count)
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
