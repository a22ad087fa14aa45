"""Drafter step time T_D(k=7): H-Spec vs DFlash vs DSpark, over batch size and context length, on CPU.

    python -m benchmarks.drafter_forward [--quick]

One drafter step = everything the drafter does per decoding step: for DFlash/DSpark, inject the K/V of the
k+1 rows the target just verified into the drafter-side cache (fc + every layer's k/v projections, written
in place) and draft; for H-Spec, fuse the last position's hidden states into the SSM seed and draft while
reading the target's KV cache in place. Drafting includes choosing the 7 tokens (sequential Markov head for
H-Spec and DSpark). Weights are random (speed does not depend on them); the target's KV cache is random
data of the right shape. Also times the three Mamba-2 scan forms at block 8 (the mixer's default is the
fastest). Writes `benchmarks/results/drafter_forward.md`.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import median_time, write_report
from hspec_jax.decoding import Bundle, SamplingConfig
from hspec_jax.decoding.speculative import draft_next
from hspec_jax.drafters import full_vocab, init_drafter
from hspec_jax.drafters.api import decoding_inputs, mirrored_target_layers
from hspec_jax.drafters.dflash import drafter_context
from hspec_jax.drafters.family import compared_kinds
from hspec_jax.drafters.mamba2 import SCAN_IMPLS, ssd
from hspec_jax.machine import cpu_model
from hspec_jax.models.kv_cache import KVCache
from hspec_jax.recipes import drafter_from_recipe, load_config, target_config

KINDS = compared_kinds()


def drafter_step_fn(config):
    """The engine's drafting step, jitted: `(bundle, embedding, target_cache, drafter_cache, taps, rng)
    -> (tokens, drafter_cache)`, taps `[B, k + 1, F*D]` being the rows verified last (`decoding_inputs`)."""
    greedy = SamplingConfig()

    def step(bundle, embedding, target_cache, drafter_cache, taps, rng):
        first_row = target_cache.lengths - taps.shape[1]
        inputs = decoding_inputs(
            config, embedding, jnp.ones_like(first_row), target_cache, taps, first_row, drafter_cache
        )
        tokens, _, _, drafter_cache = draft_next(bundle, greedy, inputs, rng)
        return tokens, drafter_cache

    # DFlash's cache is donated and updated in place; H-Spec only reads the target's cache.
    return jax.jit(step, donate_argnums=(3,) if config.owns_kv_cache else ())


def time_step(recipe, kind, batch, context_len, repeats):
    target = target_config(recipe)
    config = drafter_from_recipe(recipe, kind, target)
    rng = np.random.default_rng(0)
    params = init_drafter(config, jax.random.key(0))
    bundle = Bundle({}, target, params, config, full_vocab(config.vocab_size))  # id maps only: lm_head is pruned
    embedding = jnp.asarray(rng.standard_normal((target.vocab_size, target.hidden_size), np.float32) * 0.02)
    kv_shape = (batch, context_len + 64, target.num_kv_heads, target.head_dim)
    lengths = jnp.full((batch,), context_len, jnp.int32)
    fresh_kv = lambda n, shape=kv_shape: tuple(
        (jnp.asarray(rng.standard_normal(shape, np.float32)), jnp.asarray(rng.standard_normal(shape, np.float32)))
        for _ in range(n)
    )
    # Only the layers the drafter reads hold data; the others alias one small buffer (never read).
    mapped = list(mirrored_target_layers(config).values())
    kv = dict(zip(mapped, fresh_kv(len(mapped)), strict=True))
    (unread,) = fresh_kv(1, (batch, 1, target.num_kv_heads, target.head_dim))
    layers = [kv.get(i, unread) for i in range(target.num_layers)]
    target_cache = KVCache(tuple(k for k, _ in layers), tuple(v for _, v in layers), lengths)
    verified = config.num_drafts + 1
    taps = jnp.ones((batch, verified, len(config.fusion_layer_ids) * target.hidden_size), jnp.float32)
    drafter_cache = jax.tree.map(lambda x: x + 1.0, drafter_context(config, batch, context_len + 64))
    step = drafter_step_fn(config)
    state = {"drafter_cache": drafter_cache}

    def once():
        tokens, cache = step(bundle, embedding, target_cache, state["drafter_cache"], taps, jax.random.key(1))
        state["drafter_cache"] = cache  # DFlash's cache is donated and updated in place
        tokens.block_until_ready()

    once()
    return median_time(once, repeats)


def scan_forms(batch_sizes, repeats):
    """The SSM scan alone (no projections) at block 8, P=64, N=4, G=4: {(heads, batch): {impl: seconds}}."""
    results = {}
    for heads in (8, 48):
        for batch in batch_sizes:
            ks = jax.random.split(jax.random.key(0), 7)
            x = jax.random.normal(ks[0], (batch, 8, heads, 64))
            dt = jax.nn.softplus(jax.random.normal(ks[1], (batch, 8, heads)))
            a = -jnp.exp(jax.random.normal(ks[2], (heads,)))
            b, c = (jax.random.normal(k, (batch, 8, 4, 4)) for k in ks[3:5])
            d, s0 = jax.random.normal(ks[5], (heads,)), jax.random.normal(ks[6], (batch, heads, 64, 4))
            row = {}
            for impl in SCAN_IMPLS:
                fn = jax.jit(functools.partial(ssd, impl=impl))
                args = (x, dt, a, b, c, d, s0)
                jax.block_until_ready(fn(*args))
                row[impl] = median_time(lambda fn=fn, args=args: jax.block_until_ready(fn(*args)), repeats * 4)
            results[(heads, batch)] = row
            print(heads, batch, {k: f"{v * 1e3:.3f}ms" for k, v in row.items()}, flush=True)
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small grid (for a smoke run)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/drafter_forward.md")
    args = parser.parse_args(argv)
    batches, contexts = ((1, 4), (256, 1024)) if args.quick else ((1, 4, 16, 32), (256, 1024, 4096))
    paper_grid = ((1, 512),) if args.quick else ((1, 512), (1, 4096), (8, 512), (8, 4096))

    lines = [
        "# Drafter step time T_D(k=7) on CPU: H-Spec vs DFlash vs DSpark",
        "",
        f"Command: `python -m benchmarks.drafter_forward{' --quick' if args.quick else ''}`  ",
        f"Machine: {cpu_model()} ({platform.machine()}), {os.cpu_count()} CPUs, jax {jax.__version__}, fp32, "
        "reference attention "
        "(the CPU path). Median of the repeats, after compilation.",
        "",
        "A step is what each drafter does per decoding step: DFlash/DSpark inject the K/V of the 8 rows the target "
        "just verified into their own cache and then draft; H-Spec seeds its SSM from the last position and drafts "
        "while reading the target's cache in place. Ratio < 1 means H-Spec is faster.",
        "",
    ]
    for name, grid in (("smollm2", [(b, c) for c in contexts for b in batches]), ("qwen3_8b", paper_grid)):
        recipe = load_config(f"configs/{name}.py")
        lines += [
            f"## {recipe.target.name} sized drafters",
            "",
            "| batch | context | H-Spec ms | DFlash ms | DSpark ms | H-Spec / DFlash | H-Spec / DSpark |",
            "|---|---|---|---|---|---|---|",
        ]
        for batch, context_len in grid:
            t = {kind: time_step(recipe, kind, batch, context_len, args.repeats) for kind in KINDS}
            lines.append(
                f"| {batch} | {context_len} | {t['hspec'] * 1e3:.1f} | {t['dflash'] * 1e3:.1f} | "
                f"{t['dspark'] * 1e3:.1f} | {t['hspec'] / t['dflash']:.2f} | {t['hspec'] / t['dspark']:.2f} |"
            )
            print(lines[-1], flush=True)
        lines.append("")

    scans = scan_forms((1, 8) if args.quick else (1, 8, 32), args.repeats)
    lines += [
        "## Mamba-2 scan forms at block 8 (the SSM scan alone, ms)",
        "",
        "| heads | batch | " + " | ".join(SCAN_IMPLS) + " | fastest |",
        "|---|---|" + "---|" * (len(SCAN_IMPLS) + 1),
    ]
    totals = {impl: sum(row[impl] for row in scans.values()) for impl in SCAN_IMPLS}
    for (heads, batch), row in scans.items():
        best = min(row, key=row.get)
        cells = " | ".join(f"{row[impl] * 1e3:.3f}" for impl in SCAN_IMPLS)
        lines.append(f"| {heads} | {batch} | {cells} | {best} |")
    total_cells = ", ".join(f"{impl} {t * 1e3:.2f} ms" for impl, t in totals.items())
    fastest = min(totals, key=totals.get)
    lines += ["", f"Lowest total over the grid (the mixer's default): **{fastest}** ({total_cells})."]
    write_report(args.out, lines)


if __name__ == "__main__":
    main()
