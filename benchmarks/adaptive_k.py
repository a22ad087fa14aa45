"""The adaptive draft length (`--k auto`) against fixed k and plain decoding, on the embedded SmolLM2 target.

    python -m benchmarks.adaptive_k [--drafter smollm2-hspec --drafter random:hspec ...] [--k auto,2,7]
        [--new-tokens 64] [--repeats 3] [--out benchmarks/results/adaptive_k.md]

Every prompt (batch 1, greedy, chat template) is decoded by plain decoding and by each drafter at each k, all
compiled ahead of time and interleaved prompt by prompt; a method's decode time on a prompt is the median of
`--repeats` warm runs, taken in rounds over all the methods (so a slow spell of the machine slows them all).
Decode tokens/s = all prompts' tokens after the first / their decode seconds. Every greedy output is checked
against plain decoding. For `auto` the table also gives the share of steps at each draft length and the cost
table T(k) / T(0) measured on this machine (`hspec_jax/decoding/costs.py`; measured when not cached: run with a
fresh `XDG_CACHE_HOME` to measure it in the same quiet window). An `auto` engine starts each generation from the
acceptance estimates its previous one ended with, as a deployed engine would (only the first prompt's first run
starts from the policy's prior): the estimates are per-slot acceptance rates, never text.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys

import jax
import numpy as np

from benchmarks.common import PROMPTS, write_report
from hspec_jax.chat import chat_prompt_ids
from hspec_jax.checkpoints import load_target, load_tokenizer
from hspec_jax.cli import AUTO, DEFAULT_COMPILE_CACHE, parse_ks, use_compile_cache
from hspec_jax.decoding import Bundle, SamplingConfig, bucketed_shapes, pad_batch
from hspec_jax.decoding.engine import (
    compile_autoregressive,
    compile_speculative,
    format_chosen,
    generate_streaming,
    stop_ids,
)
from hspec_jax.decoding.policy import drafting
from hspec_jax.drafter_spec import DEFAULT_RECIPES, drafter_config, load_drafter
from hspec_jax.machine import cpu_model

DRAFTERS = ["smollm2-hspec", "random:hspec", "random:dflash"]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.adaptive_k", description=__doc__.split("\n")[0])
    parser.add_argument("--drafter", action="append", default=None, help=f"repeatable (default: {DRAFTERS})")
    parser.add_argument("--k", type=parse_ks, default=(AUTO, 2, 7), help="draft lengths, e.g. auto,2,7")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/adaptive_k.md")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    use_compile_cache(DEFAULT_COMPILE_CACHE)
    drafters = args.drafter or DRAFTERS
    target, params = load_target("smollm2")
    tokenizer = load_tokenizer("smollm2")
    ids = [chat_prompt_ids(tokenizer, p) for p in PROMPTS]
    longest = max(len(x) for x in ids)
    width, capacity = bucketed_shapes(longest, longest, 8, args.new_tokens, None)
    padded = [pad_batch([x], target.pad_token_id or 0, width) for x in ids]
    greedy = SamplingConfig()
    kw = dict(
        max_new_tokens=args.new_tokens,
        sampling=greedy,
        eos_ids=stop_ids(target, tokenizer),
        pad_id=target.pad_token_id or 0,
        seed=0,
    )
    engines = {"plain": compile_autoregressive(params, target, *padded[0], capacity, **kw)}
    policies, costs = {}, {}
    for spec in drafters:
        base = drafter_config(spec, target, DEFAULT_RECIPES["smollm2"])
        dparams, vocab = load_drafter(spec, base, params, ids)
        for k in args.k:
            config, policy = drafting(base, k)
            name = f"{spec} k={k}"
            print(f"compiling {name} ...", flush=True)
            bundle = Bundle(params, target, dparams, config, vocab)
            engines[name] = compile_speculative(bundle, *padded[0], capacity, **kw, policy=policy)
            if policy is not None:
                policies[name], costs[name] = policy, engines[name].costs
    seconds = {name: 0.0 for name in engines}
    tokens = dict.fromkeys(engines, 0)
    stats = {name: [] for name in engines}
    lossless = dict.fromkeys(engines, 0)
    for prompt in padded:
        reference = None
        shown_runs = {name: generate_streaming(engine, 8, prompts=prompt) for name, engine in engines.items()}
        runs = {name: [] for name in engines}
        for _ in range(args.repeats):  # in rounds over the methods: a slow spell of the machine hits them all
            for name, engine in engines.items():
                runs[name].append(generate_streaming(engine, 8, prompts=prompt).decode_seconds)
        for name, shown in shown_runs.items():
            n = int(shown.num_tokens[0])
            out = shown.tokens[0, :n]
            if reference is None:
                reference = out
            lossless[name] += bool(np.array_equal(out, reference))
            seconds[name] += statistics.median(runs[name])
            tokens[name] += n - 1
            if shown.stats is not None:
                stats[name].append(shown.stats)
            print(f"{name}: {n - 1} tokens, {seconds[name]:.3f} s so far", flush=True)
    rate = {name: tokens[name] / seconds[name] for name in engines}
    lines = [
        "# Adaptive draft length (`--k auto`) vs fixed k vs plain decoding",
        "",
        f"Command: `{shlex.join(['python', '-m', 'benchmarks.adaptive_k', *argv])}`",
        "",
        f"CPU: {cpu_model()}, {jax.device_count()} device(s); SmolLM2-135M-Instruct (embedded GGUF), fp32, greedy, "
        f"batch 1, {len(PROMPTS)} prompts (benchmarks/common.py) x up to {args.new_tokens} new tokens, prompt width "
        f"{width}, cache {capacity} rows; decode time per prompt = median of {args.repeats} warm runs "
        "taken in rounds over the methods, summed. Each `auto` engine starts a generation from the acceptance "
        "estimates its previous generation ended with (the first from the policy's prior).",
        "",
        "| method | decode tok/s | vs plain | tau (tokens per step) | lossless | draft length share (auto) |",
        "|---|---|---|---|---|---|",
    ]
    for name in engines:
        tau = "1.00"
        share = ""
        if stats[name]:
            steps = sum(int(np.sum(s.steps)) for s in stats[name])
            accepted = sum(int(np.sum(s.accepted)) for s in stats[name])
            tau = f"{(steps + accepted) / steps:.2f}"
            if name in policies:
                merged = stats[name][0]._replace(chosen=sum(np.asarray(s.chosen) for s in stats[name]))
                share = format_chosen(policies[name].choices, merged)
        cells = [f"{rate[name]:.1f}", f"{rate[name] / rate['plain']:.2f}x", tau, f"{lossless[name]}/{len(padded)}"]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {share} |")
    lines += ["", "Cost tables T(k) / T(0) used by `auto` (measured on this machine at first use, then cached):", ""]
    for name, table in costs.items():
        choices = policies[name].choices
        lines.append(f"- {name}: " + ", ".join(f"k={c}: {x:.2f}" for c, x in zip(choices, table, strict=True)))
    write_report(args.out, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
