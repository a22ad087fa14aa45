"""Attention of one decoding or verification step, SmolLM2-shaped (9 query heads, 3 KV heads, head dim 64): the
dense reference (`layers.dot_product_attention`, a `[B, N, T, S]` score matrix over the whole cache) vs what the
decoder runs (`blocked_attention` in key blocks of `DECODE_BLOCK_K` rows, visiting only blocks up to the batch's
longest sequence).

    python -m benchmarks.decode_attention [--repeats 20]

Per shape: batch B, cache rows S, query tokens T (1: a decoding step; 8: verifying a k = 7 block), committed
lengths (the longest given, the others drawn below it), fp32, jitted, median of the repeats after a warm-up. The
model runs it once per layer (30 for SmolLM2). Writes `benchmarks/results/decode_attention.md`.
"""

from __future__ import annotations

import argparse
import functools
import platform

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import median_time, write_report
from hspec_jax.machine import cpu_model
from hspec_jax.models.blocked_attention import blocked_attention
from hspec_jax.models.decoder import DECODE_BLOCK_K
from hspec_jax.models.layers import causal_mask, dot_product_attention

SHAPES = [  # (batch, cache rows, query tokens, longest committed length)
    (1, 256, 1, 60),
    (1, 1024, 1, 500),
    (1, 1024, 8, 500),
    (1, 4096, 8, 2000),
    (16, 768, 1, 760),
    (16, 768, 1, 400),
    (16, 768, 8, 600),
    (32, 512, 1, 500),
]


def inputs(batch: int, rows: int, tokens: int, longest: int):
    """(q, k, v, query rows `[B, T]`) with lengths up to `longest` (the first sequence the longest)."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(batch, tokens, 9, 64)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(batch, rows, 3, 64)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(batch, rows, 3, 64)), jnp.float32)
    lengths = np.r_[longest, rng.integers(max(longest // 3, 1), longest + 1, batch - 1)]
    query_rows = jnp.asarray(lengths[:, None] - tokens + np.arange(tokens)[None, :], jnp.int32)
    return q, k, v, query_rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/results/decode_attention.md")
    args = parser.parse_args(argv)
    dense = jax.jit(lambda q, k, v, rows: dot_product_attention(q, k, v, causal_mask(rows, k.shape[1])))
    blocked = jax.jit(functools.partial(blocked_attention, block_k=DECODE_BLOCK_K))
    lines = [
        "# Decoding-step attention: dense reference vs blocked (SmolLM2 shapes, one layer, fp32, CPU)",
        "",
        f"Command: `python -m benchmarks.decode_attention --repeats {args.repeats}`  ",
        f"Machine: {cpu_model()}, {platform.machine()}; jax {jax.__version__}. Blocked: key blocks of "
        f"{DECODE_BLOCK_K} rows. SmolLM2 runs this once per layer (30 layers).",
        "",
        "| batch | cache rows | query tokens | longest | dense ms | blocked ms | dense / blocked | max abs diff |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for batch, rows, tokens, longest in SHAPES:
        x = inputs(batch, rows, tokens, longest)
        ref, out = dense(*x), blocked(*x)
        diff = float(jnp.max(jnp.abs(ref - out)))
        t_dense = median_time(lambda x=x: jax.block_until_ready(dense(*x)), args.repeats)
        t_blocked = median_time(lambda x=x: jax.block_until_ready(blocked(*x)), args.repeats)
        lines.append(
            f"| {batch} | {rows} | {tokens} | {longest} | {1e3 * t_dense:.3f} | {1e3 * t_blocked:.3f} | "
            f"{t_dense / t_blocked:.2f}x | {diff:.1e} |"
        )
        print(lines[-1], flush=True)
    write_report(args.out, lines)


if __name__ == "__main__":
    main()
