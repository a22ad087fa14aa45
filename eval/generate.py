"""Generate chat answers with a target model, alone or with a speculative drafter, and report the speed.

    python -m eval.generate --target smollm2 --prompt "Why is the sky blue?" --max-new-tokens 64
    python -m eval.generate --target smollm2 --drafter random:hspec --prompt "Hi" [--k 7] [--mesh data=1,model=1]

Prints each completion, then `decode: <n> tokens in <s> s (<tok/s> tok/s)`: n is the number of new
tokens over the whole batch, s the wall time of prefill plus decoding, measured after compilation
(both jitted functions are compiled ahead of time, before the clock starts). With a drafter it then prints
`spec: tau=<mean accepted length> steps=<n> accept_by_position=<rates>` (the conditional acceptance
rate of each draft index, given all earlier drafts were accepted).

`--drafter` takes a drafter checkpoint directory or `random:<kind>` (a randomly initialised drafter of that
kind under the target's recipe, useful for lossless checks; kinds: hspec, hspec_kv_only, hspec_last_token,
dflash, dspark, dflash_target_kv).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import NamedTuple

import jax
import numpy as np

from hspec_jax import parallel
from hspec_jax.checkpoints import CheckpointError, load_target, load_tokenizer
from hspec_jax.checkpoints.drafter_io import restore_drafter
from hspec_jax.decoding import SamplingConfig, chat_prompt_ids, pad_batch
from hspec_jax.decoding.autoregressive import decode, prefill
from hspec_jax.decoding.speculative import SpecStats, spec_decode, spec_prefill
from hspec_jax.drafters import DRAFTER_KINDS, init_drafter, init_from_target
from hspec_jax.drafters.config import check_target
from hspec_jax.drafters.dflash import drafter_context
from hspec_jax.drafters.vocab import build_draft_vocab
from hspec_jax.models import check_capacity, init_cache

DEFAULT_RECIPES = {"smollm2": "configs/smollm2.py"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m eval.generate", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--target", default="smollm2", help="smollm2 (embedded), an HF directory, a .gguf file or an Orbax target"
    )
    parser.add_argument(
        "--prompt", action="append", required=True, help="user message; repeat the flag for a ragged batch"
    )
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt")
    parser.add_argument("--drafter", default=None, help="drafter checkpoint directory, or random:<kind>")
    parser.add_argument(
        "--recipe",
        default=None,
        help="recipe file for random:<kind> drafters (default: configs/smollm2.py for smollm2)",
    )
    parser.add_argument("--k", type=int, default=None, help="drafted tokens per step, 1..15 (default: the drafter's)")
    parser.add_argument("--mesh", default="data=1,model=1", help="device mesh, e.g. data=2,model=4")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument(
        "--cache-length",
        type=int,
        default=None,
        help="KV cache rows per sequence (default: longest prompt + max new tokens [+ k + 1])",
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


class Timed(NamedTuple):
    """One generation timed after compilation: wall seconds of prefill + decode, and of the prefill alone."""

    tokens: np.ndarray  # [B, max_new_tokens]
    num_tokens: np.ndarray  # [B]
    seconds: float
    prefill_seconds: float
    stats: SpecStats | None = None  # speculative runs only


def _timed(first, then):
    """(then(first()), seconds of both, seconds of first) on the wall clock, blocking until each result is ready."""
    start = time.perf_counter()
    pre = jax.block_until_ready(first())
    middle = time.perf_counter()
    out = jax.block_until_ready(then(pre))
    return out, time.perf_counter() - start, middle - start


def compile_autoregressive(
    params, config, tokens, lengths, capacity, *, max_new_tokens, sampling, eos_ids, pad_id, seed, mesh=None
):
    """Compile prefill + decode ahead of time for the shapes of `tokens [B, T]` and `capacity`. Returns
    `run(new_tokens=None, new_lengths=None, new_seed=None) -> Timed`: one generation (fresh cache each call) timed
    without any compilation on the clock, for the compiled prompts or new ones of the same shape (and seed)."""
    place = Placement(mesh, config.head_dim)
    params = place.params(params)
    first_rng, loop_rng = jax.random.split(jax.random.key(seed))
    batch = place.batch(tokens, lengths)
    cache = place.kv(init_cache(config, tokens.shape[0], capacity))
    pre_c = prefill.lower(params, config, *batch, cache, first_rng, sampling).compile()
    pre_shape = jax.eval_shape(lambda: prefill(params, config, *batch, cache, first_rng, sampling))
    dec_kw = dict(max_new_tokens=max_new_tokens, sampling=sampling, eos_ids=eos_ids, pad_id=pad_id)
    dec_c = decode.lower(params, config, pre_shape.cache, pre_shape.token, loop_rng, **dec_kw).compile()

    def run(new_tokens=None, new_lengths=None, new_seed=None) -> Timed:
        prompts, prompt_lengths = batch if new_tokens is None else place.batch(new_tokens, new_lengths)
        first, loop = (first_rng, loop_rng) if new_seed is None else jax.random.split(jax.random.key(new_seed))
        fresh = jax.block_until_ready(place.kv(init_cache(config, tokens.shape[0], capacity)))
        out, seconds, prefill_seconds = _timed(
            lambda: pre_c(params, prompts, prompt_lengths, fresh, first),
            lambda pre: dec_c(params, pre.cache, pre.token, loop),
        )
        return Timed(np.asarray(out.tokens), np.asarray(out.num_tokens), seconds, prefill_seconds)

    return run


def compile_speculative(
    target_params,
    target,
    drafter_params,
    drafter,
    vocab,
    tokens,
    lengths,
    capacity,
    *,
    max_new_tokens,
    sampling,
    eos_ids,
    pad_id,
    seed,
    mesh=None,
):
    """As `compile_autoregressive`, for draft-and-verify; the `Timed` result carries the `SpecStats`."""
    place = Placement(mesh, target.head_dim)
    target_params, drafter_params = place.params(target_params), place.params(drafter_params)
    batch = place.batch(tokens, lengths)

    def fresh_caches():
        size = tokens.shape[0]
        return place.kv((init_cache(target, size, capacity), drafter_context(drafter, size, capacity)))

    kw = dict(max_new_tokens=max_new_tokens, sampling=sampling, eos_ids=eos_ids, pad_id=pad_id)
    cache, context = fresh_caches()
    rng = jax.random.key(seed)
    args = (target_params, target, drafter_params, drafter, vocab, *batch, cache, context, rng)
    pre_c = spec_prefill.lower(*args, **kw).compile()
    state, cache_s, context_s = jax.eval_shape(lambda: spec_prefill(*args, **kw))
    dec_c = spec_decode.lower(
        target_params, target, drafter_params, drafter, vocab, state, cache_s, context_s, **kw
    ).compile()

    def run(new_tokens=None, new_lengths=None, new_seed=None) -> Timed:
        prompts, prompt_lengths = batch if new_tokens is None else place.batch(new_tokens, new_lengths)
        key = rng if new_seed is None else jax.random.key(new_seed)
        cache, context = jax.block_until_ready(fresh_caches())
        out, seconds, prefill_seconds = _timed(
            lambda: pre_c(target_params, drafter_params, vocab, prompts, prompt_lengths, cache, context, key),
            lambda pre: dec_c(target_params, drafter_params, vocab, *pre),
        )
        return Timed(np.asarray(out.tokens), np.asarray(out.num_tokens), seconds, prefill_seconds, out.stats)

    return run


class Placement:
    """Put params / batch / caches on the mesh (identity without one)."""

    def __init__(self, mesh, head_dim):
        self.mesh, self.head_dim = mesh, head_dim

    def params(self, params):
        return params if self.mesh is None else parallel.shard_params(params, self.mesh, self.head_dim)

    def batch(self, *arrays):
        return arrays if self.mesh is None else parallel.shard_batch(self.mesh, *arrays)

    def kv(self, tree):
        return tree if self.mesh is None else parallel.shard_kv(self.mesh, tree)


def check_drafter_args(spec: str | None, k: int | None) -> None:
    """Fail fast, before any model is loaded, on a drafter spec or k that cannot work."""
    if k is not None and not 1 <= k <= 15:
        raise ValueError(f"--k must be in 1..15, got {k}")
    if spec is None:
        return
    if spec.startswith("random:"):
        kind = spec.split(":", 1)[1]
        if kind not in DRAFTER_KINDS:
            raise ValueError(f"unknown drafter kind {kind!r}; choose from {', '.join(DRAFTER_KINDS)}")
    elif not os.path.isdir(spec):
        raise CheckpointError(f"drafter {spec!r} is neither random:<kind> nor a checkpoint directory")


def build_drafter(spec: str, target_spec: str, target, target_params, recipe_path, prompt_ids, k):
    """(config, params, vocab) from a checkpoint directory or `random:<kind>` (checked by `check_drafter_args`)."""
    if spec.startswith("random:"):
        from hspec_jax.recipes import drafter_from_recipe, load_config

        kind = spec.split(":", 1)[1]
        recipe_path = recipe_path or DEFAULT_RECIPES.get(target_spec)
        if recipe_path is None:
            raise ValueError("a random drafter for this target needs --recipe configs/<name>.py")
        config = drafter_from_recipe(load_config(recipe_path), kind, target)
        check_target(config, target)
        # The draft vocabulary of an untrained drafter: the prompt's tokens, then the lowest ids.
        vocab = build_draft_vocab(
            np.concatenate(prompt_ids), target.vocab_size, config.vocab_size, always=target.eos_token_ids
        )
        params = init_from_target(init_drafter(config, jax.random.key(0)), config, target_params, vocab)
    else:
        config, params, vocab = restore_drafter(spec, target)
    if k is not None:
        config = config.replace(block_size=k + 1)
    return config, params, vocab


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        check_drafter_args(args.drafter, args.k)
        mesh = parallel.make_mesh(args.mesh)
        mesh = None if mesh.size == 1 else mesh
        config, params = load_target(args.target)
        tokenizer = load_tokenizer(args.target)
        pad_id = config.pad_token_id if config.pad_token_id is not None else 0
        ids = encode_prompts(tokenizer, args.prompt, args.chat)
        drafter = None
        if args.drafter:
            drafter = build_drafter(args.drafter, args.target, config, params, args.recipe, ids, args.k)
        lookahead = drafter[0].block_size if drafter else 1
        tokens, lengths = pad_batch(ids, pad_id)
        capacity = args.cache_length or int(lengths.max()) + args.max_new_tokens + lookahead
        check_capacity(lengths, lookahead, capacity)
    except (CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
    kw = dict(
        max_new_tokens=args.max_new_tokens,
        sampling=sampling,
        eos_ids=stop_ids(config, tokenizer),
        pad_id=pad_id,
        seed=args.seed,
        mesh=mesh,
    )
    if drafter is None:
        result = compile_autoregressive(params, config, tokens, lengths, capacity, **kw)()
    else:
        drafter_config, drafter_params, vocab = drafter
        run = compile_speculative(
            params, config, drafter_params, drafter_config, vocab, tokens, lengths, capacity, **kw
        )
        result = run()
    for row, n in zip(result.tokens, result.num_tokens, strict=True):
        print(tokenizer.decode(row[:n], skip_special_tokens=True))
    total, seconds = int(result.num_tokens.sum()), result.seconds
    print(f"decode: {total} tokens in {seconds:.3f} s ({total / seconds:.1f} tok/s)")
    if drafter is not None:
        stats = result.stats
        rates = ",".join(f"{r:.2f}" for r in stats.acceptance_by_position())
        print(f"spec: tau={stats.tau():.2f} steps={int(np.sum(stats.steps))} accept_by_position={rates}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
