"""Decoder layers scanned or called per layer, on this backend: the time to trace, lower and compile one SmolLM2
forward, and a decoding (1 token) and verification (8 tokens) step, the two ways side by side.

    python -m benchmarks.scan_layers [--rounds 5] [--capacity 1024] [--target smollm2 | random:configs/llama.py]

Scanned: `lax.scan` over the stacked layer weights and a stacked cache (`TargetConfig(scan_layers=True)`).
Per layer: the same layer function called once per layer on one weight tree per layer (what single-device
placement gives on CPU and GPU, `for_backend`). Per layer, stacked weights: the layers called one by one on
slices of the stacked tree (what a sharded run without a scan does). All on the embedded SmolLM2-135M's weights
(or, `--target random:<recipe>`, random weights of a recipe's target, e.g. Llama-3.1-8B on an accelerator) with
fused projections, batch 1, a cache of `--capacity` rows half full. Steps are timed in interleaved rounds (median
of each round's median). Writes `benchmarks/results/scan_layers.md`; prints the CPU model beside the table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from benchmarks.common import median_time, write_report
from hspec_jax.checkpoints import load_target
from hspec_jax.machine import cpu_model
from hspec_jax.models import forward, init_cache, init_params
from hspec_jax.models.decoder import unstack_layers
from hspec_jax.models.layers import fuse_projections
from hspec_jax.recipes import load_config, target_config


def programs(config, params, capacity: int):
    """{(mode, tokens): (compiled forward, args, trace s, lower s, compile s)} for each mode and T = 1, 8."""
    out = {}
    fused = fuse_projections(params)
    modes = {
        "scanned": (True, fused),
        "per layer": (False, {**fused, "layers": unstack_layers(fused["layers"], config.num_layers)}),
        "per layer, stacked weights": (False, fused),
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scan_layers", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--capacity", type=int, default=1024)
    parser.add_argument("--target", default="smollm2", help="smollm2 (embedded weights) or random:<recipe file>")
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
    compiled = programs(config, params, args.capacity)
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
        f"`python -m benchmarks.scan_layers --rounds {args.rounds} --capacity {args.capacity} --target {args.target}`. "
        f"{name}, {config.num_layers} layers, batch 1, cache {args.capacity} rows half full, fused projections; "
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
    print("\n".join(lines))
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
