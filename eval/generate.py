"""Generate chat answers with a target model, alone or with a speculative drafter, and report the speed.

    python -m eval.generate --target smollm2 --prompt "Why is the sky blue?" --max-new-tokens 64
    python -m eval.generate --target smollm2 --drafter random:hspec --prompt "Hi" [--k auto|7] [--mesh data=1,model=1]

The answer streams as it is produced (one prompt; a batch prints each completion at the end): decoding runs
on device in chunks of `--chunk` steps with the caches donated between chunks. Ctrl-C stops within a chunk,
prints what was generated and exits 130. Then come the speed lines:

    prefill: <prompt tokens> tokens in <s> s (<tok/s> tok/s)
    decode: <n> tokens in <s> s (<tok/s> tok/s)
    timed: <which run was timed>

`prefill` is the prompt pass (it also yields each sequence's first token); `decode` the tokens after it. Both
functions are compiled ahead of time, so no compilation is on the clock; the times are the median of
`--repeats` warm runs after the printed one (or the printed run itself with `--repeats 0`). With a drafter
a last line gives `spec: tau=<mean tokens per step> steps=<n> accept_by_position=<rates>`, the conditional
acceptance rate of each draft index given all earlier drafts were accepted (`-`: never reached), and with
`--k auto` (the default with a drafter) `drafted=<n>`, the blocks the drafter drafted (a block the policy then
declined to verify costs the drafter's time and yields nothing), `chosen k=<k>:<share of steps>,...`, the draft
length chosen per step by the adaptive policy (`hspec_jax/decoding/policy.py`; k = 0 is a plain step), from the
drafter's confidence, the acceptance so far and the step costs measured on this machine at first use (cached under
`~/.cache/hspec_jax/costs/`), and `step costs T(k)/T(0) k=<k>:<cost>,...`, that table. `--k N` drafts N tokens
every step.

`--compare` (with a drafter) streams plain decoding's answer, then draft-and-verify's, then times the warm runs of
both in rounds (each round runs both, the order reversed every other round, so that a slow spell of the machine
hits both alike), prints both speeds, and ends with `same text as plain decoding: yes (greedy)` (exit 1 if a
greedy answer differs) and `speedup: <x> decode tokens/s, draft-and-verify over plain`.

`--drafter` takes a drafter checkpoint directory, the short name of a drafter shipped with the package (e.g.
`smollm2-hspec`, see hspec_jax/trained/README.md), or `random:<kind>` (a randomly initialised drafter of that
kind under the target's recipe, useful for lossless checks; kinds: hspec, hspec_kv_only, hspec_last_token,
dflash, dspark, dflash_markov, dflash_target_kv). Every argument is checked before any weights are loaded, together with
the context length, the cache length and the memory the request needs.
"""

from __future__ import annotations

import os
import signal
import statistics
import sys
import threading
from collections.abc import Callable
from typing import NamedTuple

import jax
import numpy as np

from hspec_jax import parallel
from hspec_jax.chat import chat_prompt_ids, text_ids
from hspec_jax.checkpoints import load_target, load_tokenizer, read_target_config, resolve
from hspec_jax.cli import (
    AUTO,
    DEFAULT_COMPILE_CACHE,
    EXIT_INTERRUPTED,
    MAX_K,
    ArgumentParser,
    add_drafter_arguments,
    non_negative_float,
    non_negative_int,
    positive_int,
    probability,
    run,
    use_compile_cache,
)
from hspec_jax.decoding import Bundle, SamplingConfig, pad_batch
from hspec_jax.decoding.engine import (
    DEFAULT_CHUNK,
    Engine,
    Result,
    compile_autoregressive,
    compile_speculative,
    format_chosen,
    generate_streaming,
    stop_ids,
)
from hspec_jax.decoding.limits import (
    cache_rows,
    check_cache_length,
    check_context,
    check_memory,
    memory_needed,
    tree_bytes,
)
from hspec_jax.decoding.placement import Placement
from hspec_jax.decoding.policy import AdaptivePolicy, drafting
from hspec_jax.drafter_spec import DEFAULT_RECIPES, check_drafter_spec, drafter_config, load_drafter
from hspec_jax.drafters import drafter_param_shapes
from hspec_jax.drafters.dflash import drafter_context
from hspec_jax.errors import InputError


def parse_args(argv: list[str] | None = None):
    parser = ArgumentParser(prog="python -m eval.generate", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--target", default="smollm2", help="smollm2 (embedded), an HF directory, a .gguf file or an Orbax target"
    )
    parser.add_argument(
        "--prompt", action="append", required=True, help="user message; repeat the flag for a ragged batch"
    )
    parser.add_argument("--max-new-tokens", type=positive_int, default=64, help="tokens to generate per prompt")
    add_drafter_arguments(parser)
    parser.add_argument("--mesh", default="data=1,model=1", help="device mesh, e.g. data=2,model=4")
    parser.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=non_negative_int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=probability, default=1.0, help="in (0, 1]; 1.0 = off")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument(
        "--cache-length",
        type=positive_int,
        default=None,
        help="KV cache rows per sequence (default and minimum: longest prompt + max new tokens [+ k + 1])",
    )
    parser.add_argument("--chunk", type=positive_int, default=DEFAULT_CHUNK, help="decoding steps per streamed chunk")
    parser.add_argument(
        "--repeats", type=non_negative_int, default=1, help="warm runs to time after the printed one (0: time it)"
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="with --drafter: run plain decoding first, then check the text is the same and print the speedup",
    )
    parser.add_argument(
        "--compile-cache",
        default=DEFAULT_COMPILE_CACHE,
        help=f"persistent XLA compilation cache directory, '' for none (default {DEFAULT_COMPILE_CACHE})",
    )
    parser.add_argument(
        "--no-chat",
        dest="chat",
        action="store_false",
        help="tokenize prompts as plain text instead of applying the chat template",
    )
    return parser.parse_args(argv)


def check_args(args) -> None:
    """Every check that needs no weights and no tokenizer: argument combinations, paths, the mesh."""
    if args.compare and args.drafter is None:
        raise InputError("--compare puts plain decoding beside draft-and-verify: it needs --drafter")
    if args.k is not None and args.drafter is None:
        raise InputError("--k sets the drafted tokens per step: it needs --drafter")
    if isinstance(args.k, int) and args.k > MAX_K:
        raise InputError(f"--k must be in 1..{MAX_K}, got {args.k}")
    if args.recipe is not None and args.drafter is None:
        raise InputError("--recipe builds random:<kind> drafters: it needs --drafter random:<kind>")
    if not args.chat and any(not p for p in args.prompt):
        raise InputError("--prompt must not be empty")
    if args.drafter is not None:
        check_drafter_spec(args.drafter, args.target, args.recipe)
    try:
        parallel.make_mesh(args.mesh)
    except ValueError as e:
        raise InputError(f"--mesh: {e}") from None
    resolve(args.target)


class Request(NamedTuple):
    """A checked generation request: everything decided before the weights are loaded."""

    target: object  # TargetConfig
    drafter: object | None  # DrafterConfig
    tokenizer: object
    prompt_ids: list[list[int]]
    capacity: int
    policy: AdaptivePolicy | None  # `--k auto` (the default with a drafter); None for a fixed `--k N`


def plan(args) -> Request:
    """Read the target's config and tokenizer, tokenize, and check context, cache length and memory (on the
    mesh's devices)."""
    target = read_target_config(args.target)
    tokenizer = load_tokenizer(args.target)
    ids = encode_prompts(tokenizer, args.prompt, args.chat)
    if any(not p for p in ids):
        raise InputError("a prompt tokenized to nothing")
    top = max(max(p) for p in ids)
    if top >= target.vocab_size:
        raise InputError(f"the tokenizer gives id {top}, outside the model's vocabulary of {target.vocab_size}")
    drafter, policy = None, None
    if args.drafter is not None:
        recipe = args.recipe or DEFAULT_RECIPES.get(args.target)
        k = args.k if isinstance(args.k, int) else AUTO
        drafter, policy = drafting(drafter_config(args.drafter, target, recipe), k)
    longest = max(len(p) for p in ids)
    check_context(target, longest, args.max_new_tokens)
    lookahead = drafter.num_drafts + 1 if drafter else 0
    capacity = args.cache_length or cache_rows(longest, args.max_new_tokens, lookahead)
    check_cache_length(capacity, longest, args.max_new_tokens, lookahead)
    extra = {}
    if drafter is not None:
        weights = drafter_param_shapes(drafter)
        extra["drafter"] = tree_bytes((weights, jax.eval_shape(lambda: drafter_context(drafter, len(ids), capacity))))
    devices = list(parallel.make_mesh(args.mesh).devices.flat)
    check_memory(memory_needed(target, len(ids), capacity, longest, extra), devices)
    return Request(target, drafter, tokenizer, ids, capacity, policy)


def encode_prompts(tokenizer, prompts: list[str], chat: bool) -> list[list[int]]:
    if chat:
        return [chat_prompt_ids(tokenizer, p) for p in prompts]
    return [text_ids(tokenizer, p) for p in prompts]


class Interrupt:
    """Ctrl-C as a flag checked between chunks (the first press), or an immediate exit (a second press, or
    any press while `waiting` on loading/compilation, which runs in a worker thread for that reason)."""

    def __init__(self):
        self.requested = False
        self.waiting = False

    def __enter__(self):
        self.previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self.previous)

    def _handle(self, signum, frame):
        if self.waiting or self.requested:
            self._exit()
        self.requested = True

    @staticmethod
    def _exit():
        sys.stdout.flush()
        print("\ninterrupted", file=sys.stderr, flush=True)
        os._exit(EXIT_INTERRUPTED)

    def wait_for(self, fn: Callable, *args, **kwargs):
        """Run `fn` in a worker thread so that Ctrl-C, handled by the main thread, can exit at once."""
        out = {}

        def work():
            try:
                out["value"] = fn(*args, **kwargs)
            except BaseException as e:  # re-raised in the main thread
                out["error"] = e

        worker = threading.Thread(target=work, daemon=True)
        self.waiting = True
        if self.requested:  # pressed just before the wait: it would otherwise be seen only after it
            self._exit()
        worker.start()
        while worker.is_alive():
            worker.join(0.05)
        self.waiting = False
        if "error" in out:
            raise out["error"]
        return out["value"]


class TextStream:
    """Print one sequence's text as its tokens arrive (holding back a partial multi-byte character)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.printed = tokenizer, ""

    def __call__(self, tokens, num):
        text = self.tokenizer.decode(tokens[0, : num[0]], skip_special_tokens=True).rstrip("\ufffd")
        if text.startswith(self.printed) and len(text) > len(self.printed):
            sys.stdout.write(text[len(self.printed) :])
            sys.stdout.flush()
            self.printed = text


def progress(message: str) -> None:
    """A status line on stderr, for a person watching a terminal (pipes get only results and errors)."""
    if sys.stderr.isatty():
        print(message, file=sys.stderr, flush=True)


def format_rates(rates: list[float]) -> str:
    """Acceptance rates per draft index, `-` where the index was never reached."""
    return ",".join("-" if np.isnan(r) else f"{r:.2f}" for r in rates)


def format_k(policy: AdaptivePolicy | None, drafter) -> str:
    return f"{drafter.num_drafts}" if policy is None else f"auto (up to {policy.max_drafts})"


def speed_lines(prompt_tokens: int, result: Result, batch: int, timed: str) -> list[str]:
    decoded = int(result.num_tokens.sum()) - batch
    pre, dec = result.prefill_seconds, result.decode_seconds
    return [
        f"prefill: {prompt_tokens} tokens in {pre:.3f} s ({prompt_tokens / pre:.1f} tok/s)",
        f"decode: {decoded} tokens in {dec:.3f} s ({decoded / dec if dec else 0.0:.1f} tok/s)",
        f"timed: {timed}",
    ]


class Timed(NamedTuple):
    shown: Result  # the printed (streamed) run
    result: Result  # the timed one: median of the warm repeats, or the printed run
    what: str  # which run was timed


def show_run(engine: Engine, args, tokenizer, interrupt: Interrupt, batch: int) -> Result | None:
    """Stream one run, printing the answer; None if interrupted."""
    stream = TextStream(tokenizer) if batch == 1 else None
    shown = generate_streaming(engine, args.chunk, stream, lambda: interrupt.requested)
    if stream is not None:
        print()
    else:
        for row, n in zip(shown.tokens, shown.num_tokens, strict=True):
            print(tokenizer.decode(row[:n], skip_special_tokens=True))
    if shown.interrupted:
        print(f"interrupted after {int(shown.num_tokens.sum())} tokens", file=sys.stderr)
        return None
    return shown


def time_runs(engines: dict[str, Engine], shown: dict[str, Result], args, interrupt: Interrupt) -> dict | None:
    """`--repeats` warm runs of every engine, in rounds (each round runs every engine, the order reversed every
    other round, so that a slow spell of the machine slows them alike) -> {name: Timed}; None if interrupted."""
    timed = {name: [] for name in engines}
    for r in range(args.repeats):
        for name in list(engines)[:: 1 if r % 2 == 0 else -1]:
            timed[name].append(generate_streaming(engines[name], args.chunk, stop=lambda: interrupt.requested))
    if interrupt.requested:
        print("interrupted while timing", file=sys.stderr)
        return None
    how = f"; compiled ahead of time; decoding in chunks of {args.chunk} steps"
    if not args.repeats:
        return {name: Timed(shown[name], shown[name], "the printed run (streamed)" + how) for name in engines}
    rounds = " in rounds over plain and draft-and-verify" if len(engines) > 1 else ""
    what = f"median of {args.repeats} warm run(s) after the printed one{rounds}" + how
    return {
        name: Timed(
            shown[name],
            shown[name]._replace(
                prefill_seconds=statistics.median(r.prefill_seconds for r in runs),
                decode_seconds=statistics.median(r.decode_seconds for r in runs),
            ),
            what,
        )
        for name, runs in timed.items()
    }


def same_text(plain: Result, spec: Result) -> bool:
    """Whether two runs produced the same tokens for every sequence."""
    return all(
        np.array_equal(a[:n], b[:m])
        for a, n, b, m in zip(plain.tokens, plain.num_tokens, spec.tokens, spec.num_tokens, strict=True)
    )


def decode_rate(result: Result, batch: int) -> float:
    """Tokens per second after the first (the decoding phase)."""
    return (int(result.num_tokens.sum()) - batch) / result.decode_seconds if result.decode_seconds else 0.0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_args(args)
    use_compile_cache(args.compile_cache)
    with Interrupt() as interrupt:
        progress(f"reading {args.target} (config, tokenizer) ...")
        request = interrupt.wait_for(plan, args)
        mesh = parallel.make_mesh(args.mesh)
        mesh = None if mesh.size == 1 else mesh
        config, tokenizer, ids = request.target, request.tokenizer, request.prompt_ids
        progress(f"loading {args.target} ...")
        _, params = interrupt.wait_for(load_target, args.target)
        # Placed once: both engines of --compare then read the same weights (one copy in memory, not two).
        params = Placement(mesh, config).params(params)
        pad_id = config.pad_token_id if config.pad_token_id is not None else 0
        tokens, lengths = pad_batch(ids, pad_id)
        sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
        kw = dict(
            max_new_tokens=args.max_new_tokens,
            sampling=sampling,
            eos_ids=stop_ids(config, tokenizer),
            pad_id=pad_id,
            seed=args.seed,
            mesh=mesh,
        )
        engines, shown, policy = {}, {}, None
        if request.drafter is None or args.compare:
            progress("compiling ...")
            engines["plain"] = interrupt.wait_for(
                compile_autoregressive, params, config, tokens, lengths, request.capacity, **kw
            )
            if args.compare:
                print("== plain decoding")
            shown["plain"] = show_run(engines["plain"], args, tokenizer, interrupt, len(ids))
            if shown["plain"] is None:
                return EXIT_INTERRUPTED
        if request.drafter is not None:
            drafter_params, vocab = interrupt.wait_for(load_drafter, args.drafter, request.drafter, params, ids)
            policy = request.policy
            progress("compiling (and, for --k auto, measuring step costs once per machine and shape) ...")
            engines["spec"] = interrupt.wait_for(
                compile_speculative,
                Bundle(params, config, drafter_params, request.drafter, vocab),
                tokens,
                lengths,
                request.capacity,
                **kw,
                policy=policy,
            )
            if args.compare:
                print(f"== draft-and-verify with {args.drafter}, k={format_k(policy, request.drafter)}")
            shown["spec"] = show_run(engines["spec"], args, tokenizer, interrupt, len(ids))
            if shown["spec"] is None:
                return EXIT_INTERRUPTED
        runs = time_runs(engines, shown, args, interrupt)
        if runs is None:
            return EXIT_INTERRUPTED
        for name, run_ in runs.items():
            if args.compare:
                print(f"== {'plain decoding' if name == 'plain' else 'draft-and-verify'}: timing")
            print("\n".join(speed_lines(int(lengths.sum()), run_.result, len(ids), run_.what)))
            if name == "spec":
                stats = run_.shown.stats
                chosen = ""
                if policy is not None:
                    measured = ",".join(
                        f"{c}:{x:.2f}" for c, x in zip(policy.choices, engines["spec"].costs, strict=True)
                    )
                    drafted = int(np.sum(stats.drafted))
                    chosen = f" drafted={drafted} chosen {format_chosen(policy.choices, stats)}"
                    chosen += f" step costs T(k)/T(0) k={measured}"
                print(
                    f"spec: tau={stats.tau():.2f} steps={int(np.sum(stats.steps))} accept_by_position="
                    f"{format_rates(stats.acceptance_by_position())}{chosen}"
                )
    if args.compare:
        plain, spec = runs["plain"], runs["spec"]
        speedup = decode_rate(spec.result, len(ids)) / decode_rate(plain.result, len(ids))
        if args.temperature == 0:
            if not same_text(plain.shown, spec.shown):
                print("error: greedy draft-and-verify differs from plain decoding", file=sys.stderr)
                return 1
            print("same text as plain decoding: yes (greedy)")
        print(f"speedup: {speedup:.2f}x decode tokens/s, draft-and-verify over plain ({spec.what})")
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
