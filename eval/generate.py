"""Generate a chat answer with a target model and report decoding speed.

    python -m eval.generate --target smollm2 --prompt "Why is the sky blue?" --max-new-tokens 64

Prints each completion, then `decode: <n> tokens in <s> s (<tok/s> tok/s)`: n is the number of new
tokens over the whole batch, s the wall time of prefill plus decoding, measured after compilation
(both jitted functions are compiled ahead of time, before the clock starts).
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import numpy as np

from hspec_jax.checkpoints import CheckpointError, load_target, load_tokenizer
from hspec_jax.decoding import SamplingConfig, chat_prompt_ids, pad_batch
from hspec_jax.decoding.autoregressive import decode, prefill
from hspec_jax.models import check_capacity, init_cache


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m eval.generate", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--target",
        default="smollm2",
        help="smollm2 (embedded), an HF directory, a .gguf file or an Orbax target",
    )
    parser.add_argument(
        "--prompt", action="append", required=True, help="user message; repeat the flag for a ragged batch"
    )
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument(
        "--cache-length",
        type=int,
        default=None,
        help="KV cache rows per sequence (default: longest prompt + max new tokens)",
    )
    parser.add_argument(
        "--no-chat",
        dest="chat",
        action="store_false",
        help="tokenize prompts as plain text instead of applying the chat template",
    )
    return parser.parse_args(argv)


def encode_prompts(tokenizer, prompts: list[str], chat: bool) -> list[list[int]]:
    if chat:
        return [chat_prompt_ids(tokenizer, p) for p in prompts]
    return [list(tokenizer(p)["input_ids"]) for p in prompts]


def stop_ids(config, tokenizer) -> tuple[int, ...]:
    ids = set(config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))


def compile_autoregressive(
    params, config, tokens, lengths, capacity, *, max_new_tokens, sampling, eos_ids, pad_id, seed
):
    """Compile prefill + decode ahead of time; returns `run() -> (tokens, num_tokens, seconds)` that times one
    generation (fresh cache each call) without any compilation on the clock."""
    first_rng, loop_rng = jax.random.split(jax.random.key(seed))
    cache = init_cache(config, tokens.shape[0], capacity)
    pre_c = prefill.lower(params, config, tokens, lengths, cache, first_rng, sampling).compile()
    pre_shape = jax.eval_shape(lambda: prefill(params, config, tokens, lengths, cache, first_rng, sampling))
    dec_kw = dict(max_new_tokens=max_new_tokens, sampling=sampling, eos_ids=eos_ids, pad_id=pad_id)
    dec_c = decode.lower(params, config, pre_shape.cache, pre_shape.token, loop_rng, **dec_kw).compile()

    def run():
        fresh = init_cache(config, tokens.shape[0], capacity)
        jax.block_until_ready(fresh)
        start = time.perf_counter()
        pre = pre_c(params, tokens, lengths, fresh, first_rng)
        out = dec_c(params, pre.cache, pre.token, loop_rng)
        out.tokens.block_until_ready()
        return np.asarray(out.tokens), np.asarray(out.num_tokens), time.perf_counter() - start

    return run


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config, params = load_target(args.target)
        tokenizer = load_tokenizer(args.target)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    pad_id = config.pad_token_id if config.pad_token_id is not None else 0
    ids = encode_prompts(tokenizer, args.prompt, args.chat)
    tokens, lengths = pad_batch(ids, pad_id)
    capacity = args.cache_length or int(lengths.max()) + args.max_new_tokens
    try:
        check_capacity(lengths, 1, capacity)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
    run = compile_autoregressive(
        params,
        config,
        tokens,
        lengths,
        capacity,
        max_new_tokens=args.max_new_tokens,
        sampling=sampling,
        eos_ids=stop_ids(config, tokenizer),
        pad_id=pad_id,
        seed=args.seed,
    )
    out, num, seconds = run()
    for row, n in zip(out, num, strict=True):
        print(tokenizer.decode(row[:n], skip_special_tokens=True))
    total = int(num.sum())
    print(f"decode: {total} tokens in {seconds:.3f} s ({total / seconds:.1f} tok/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
