"""Decoder layers scanned or called per layer, on this backend: the time to trace, lower and compile one SmolLM2
forward, and a decoding (1 token) and verification (8 tokens) step, the two ways side by side.

    python -m benchmarks.scan_layers [--rounds 5] [--capacity 1024] [--target smollm2 | random:configs/llama.py]
                                     [--xla-dots] [--engines ROUNDS [--new-tokens 64]]

Scanned: `lax.scan` over the stacked layer weights and a stacked cache (`TargetConfig(scan_layers=True)`; what
single-device placement gives on TPU and on CPU with the packed kernel, `for_backend`). Per layer: the same layer
function called once per layer on one weight tree per layer (what placement gives on GPU). Per layer, stacked
weights: the layers called one by one on slices of the stacked tree (what a sharded run without a scan does). All
on the embedded SmolLM2-135M's weights (or, `--target random:<recipe>`, random weights of a recipe's target, e.g.
Llama-3.1-8B on an accelerator) with fused projections, linear layers on the packed CPU kernel where it runs
(`--xla-dots`: XLA's dots), batch 1, a cache of `--capacity` rows half full. Steps are timed in interleaved rounds
(median of each round's median). `--engines R` (SmolLM2) adds whole engines, plain decoding and the shipped drafter
at k = 7, scanned and per layer, decoding the benchmark prompts in R interleaved rounds, outputs compared. Writes
`benchmarks/results/scan_layers.md`; prints the CPU model beside the table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import PROMPTS, median_time, write_report
from hspec_jax.chat import chat_prompt_ids
from hspec_jax.checkpoints import load_target, load_tokenizer
from hspec_jax.decoding import Bundle, SamplingConfig, bucketed_shapes, pad_batch
from hspec_jax.decoding.engine import compile_autoregressive, compile_speculative, generate_streaming, stop_ids
from hspec_jax.drafter_spec import DEFAULT_RECIPES, drafter_config, load_drafter
from hspec_jax.kernels import cpu_matmul
from hspec_jax.machine import cpu_model
from hspec_jax.models import forward, init_cache, init_params
from hspec_jax.models.decoder import unstack_layers
from hspec_jax.models.layers import for_backend, fuse_projections, pack_linear_layers
from hspec_jax.recipes import load_config, target_config


def programs(config, params, capacity: int, pack: bool):
    """{(mode, tokens): (compiled forward, args, trace s, lower s, compile s)} for each mode and T = 1, 8; linear
    layers on the packed CPU kernel if `pack`."""
    out = {}
    fused = fuse_projections(params)
    place = pack_linear_layers if pack else (lambda tree: tree)
    modes = {
        "scanned": (True, place(fused)),
        "per layer": (False, place({**fused, "layers": unstack_layers(fused["layers"], config.num_layers)})),
        "per layer, stacked weights": (False, place(fused)),
    }
    for mode, (scan, placed) in modes.items():
        cfg = config.replace(scan_layers=scan)
        for t in (1, 8):
            cache = init_cache(cfg, 1, capacity).replace(lengths=jnp.asarray([capacity // 2], jnp.int32))
            tokens = jnp.ones((1, t), jnp.int32)
            fn = jax.jit(lambda p, tok, c, cfg=cfg: forward(p, cfg, tok, c).logits)
            began = time.perf_counter()
            traced = fn.trace(placed, tokens, cache)
            traced_at = time.perf_counter()
            lowered = traced.lower()
            lowered_at = time.perf_counter()
            compiled = lowered.compile()
            done = time.perf_counter()
            timings = (traced_at - began, lowered_at - traced_at, done - lowered_at)
            out[mode, t] = (compiled, (placed, tokens, cache), *timings)
    return out


def engines(config, params, new_tokens: int) -> tuple[dict, list]:
    """{(mode, method): (engine, compile s)} for plain decoding and the shipped drafter at k = 7, with the decoder
    scanned and per layer (both placed for this backend: per layer as one tree per layer), and the padded prompts."""
    tokenizer = load_tokenizer("smollm2")
    ids = [chat_prompt_ids(tokenizer, p) for p in PROMPTS]
    longest = max(len(x) for x in ids)
    width, capacity = bucketed_shapes(longest, longest, 8, new_tokens, None)
    prompts = [pad_batch([x], config.pad_token_id or 0, width) for x in ids]
    kw = dict(
        max_new_tokens=new_tokens,
        sampling=SamplingConfig(),
        eos_ids=stop_ids(config, tokenizer),
        pad_id=config.pad_token_id or 0,
        seed=0,
    )
    drafter = drafter_config("smollm2-hspec", config, DEFAULT_RECIPES["smollm2"]).with_drafts(7)
    dparams, vocab = load_drafter("smollm2-hspec", drafter, params, ids)
    fused = fuse_projections(params)
    stacked = for_backend(fused)
    per_layer = for_backend({**fused, "layers": unstack_layers(fused["layers"], config.num_layers)})
    out = {}
    for mode, (cfg, placed) in {
        "scanned": (config.replace(scan_layers=True), stacked),
        "per layer": (config.replace(scan_layers=False), per_layer),
    }.items():
        began = time.perf_counter()
        plain = compile_autoregressive(placed, cfg, *prompts[0], capacity, **kw)
        out[mode, "plain"] = (plain, time.perf_counter() - began)
        began = time.perf_counter()
        spec = compile_speculative(Bundle(placed, cfg, dparams, drafter, vocab), *prompts[0], capacity, **kw)
        out[mode, "k = 7"] = (spec, time.perf_counter() - began)
    return out, prompts


def engine_lines(config, params, new_tokens: int, rounds: int) -> list[str]:
    """The engines of `engines` decoding the benchmark prompts in interleaved rounds: a table of decode tokens/s,
    scanned against per layer, and whether every output equals plain per-layer decoding."""
    compiled, prompts = engines(config, params, new_tokens)
    seconds = {key: [] for key in compiled}
    tokens = dict.fromkeys(compiled, 0)
    same = dict.fromkeys(compiled, True)
    for prompt in prompts:
        outputs = {}
        for key, (engine, _) in compiled.items():
            shown = generate_streaming(engine, 8, prompts=prompt)
            n = int(shown.num_tokens[0])
            outputs[key], tokens[key] = shown.tokens[0, :n], tokens[key] + n - 1
        for key in compiled:
            same[key] &= bool(np.array_equal(outputs[key], outputs["per layer", "plain"]))
        runs = {key: [] for key in compiled}
        for _ in range(rounds):
            for key, (engine, _) in compiled.items():
                runs[key].append(generate_streaming(engine, 8, prompts=prompt).decode_seconds)
        for key in compiled:
            seconds[key].append(statistics.median(runs[key]))
    rate = {key: tokens[key] / sum(seconds[key]) for key in compiled}
    lines = [
        "",
        "## Whole engines",
        "",
        f"Plain decoding and the shipped drafter (smollm2-hspec) at k = 7, greedy, batch 1, {len(prompts)} prompts "
        f"(benchmarks/common.py) x up to {new_tokens} new tokens; a prompt's decode time is the median of {rounds} "
        "warm runs taken in rounds over the four engines, summed over the prompts. Compile: the engine's build "
        "(prefill and decoding chunk; a fixed k measures no cost table), the persistent compilation cache off.",
        "",
        "| method | decoder | compile (s) | decode tokens/s | scanned / per layer | output = plain per layer |",
        "|---|---|---|---|---|---|",
    ]
    for mode, method in compiled:
        ratio = rate[mode, method] / rate["per layer", method]
        lines.append(
            f"| {method} | {mode} | {compiled[mode, method][1]:.2f} | {rate[mode, method]:.1f} | {ratio:.3f}x "
            f"| {'yes' if same[mode, method] else 'NO'} |"
        )
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scan_layers", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--capacity", type=int, default=1024)
    parser.add_argument("--target", default="smollm2", help="smollm2 (embedded weights) or random:<recipe file>")
    parser.add_argument("--xla-dots", action="store_true", help="keep XLA's dots where the packed CPU kernel runs")
    parser.add_argument("--engines", type=int, default=0, metavar="ROUNDS", help="also time whole engines (smollm2)")
    parser.add_argument("--new-tokens", type=int, default=64, help="per prompt, with --engines")
    parser.add_argument("--out", default="benchmarks/results/scan_layers.md")
    args = parser.parse_args(argv)
    jax.config.update("jax_enable_compilation_cache", False)  # compile times measured, not cache reads
    if args.target.startswith("random:"):
        recipe = load_config(args.target.removeprefix("random:"))
        config = target_config(recipe)
        params = init_params(config, jax.random.key(0))
        name = f"{recipe.target.name} (random weights, {config.dtype.name})"
    else:
        config, params = load_target(args.target)
        name = f"{args.target} ({config.dtype.name})"
    pack = cpu_matmul.available() and not args.xla_dots
    compiled = programs(config, params, args.capacity, pack)
    steps = {key: [] for key in compiled}
    for _ in range(args.rounds):
        for key, (fn, fn_args, *_) in compiled.items():
            jax.block_until_ready(fn(*fn_args))
            steps[key].append(median_time(lambda fn=fn, a=fn_args: jax.block_until_ready(fn(*a)), repeats=10))
    step = {key: statistics.median(values) for key, values in steps.items()}
    lines = [
        "# Decoder layers: scanned or called per layer",
        "",
        f"{jax.default_backend()} backend, CPU: {cpu_model()}, {os.cpu_count()} cores. Command: "
        f"`python -m benchmarks.scan_layers --rounds {args.rounds} --capacity {args.capacity} --target {args.target}"
        f"{' --xla-dots' if args.xla_dots else ''}"
        f"{f' --engines {args.engines}' if args.engines else ''}`. {name}, {config.num_layers} layers, batch 1, cache "
        f"{args.capacity} rows half full, fused projections, linear layers on "
        f"{f'the packed CPU kernel ({cpu_matmul.kernel_path()} path)' if pack else 'XLA dots'}; "
        f"steps: median of {args.rounds} interleaved rounds of 10.",
        "",
        "| layers | tokens | trace (s) | lower (s) | compile (s) | step (ms) | step vs per layer |",
        "|---|---|---|---|---|---|---|",
    ]
    for (mode, t), (_, _, trace, lower, comp) in compiled.items():
        ratio = step[mode, t] / step["per layer", t]
        lines.append(
            f"| {mode} | {t} | {trace:.2f} | {lower:.2f} | {comp:.2f} | {step[mode, t] * 1e3:.2f} | {ratio:.2f}x |"
        )
    if args.engines:
        lines += engine_lines(config, params, args.new_tokens, args.engines)
    print("\n".join(lines))
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
