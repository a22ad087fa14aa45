"""What verifying 8 tokens costs the CPU's matrix products: one [M, 576] x [576, 1536] product (SmolLM2's MLP up
projection) at M = 1, 2, 4, 8, 16 rows, through XLA (fp32 and bf16), PyTorch (fp32, oneDNN) and the project's
packed kernel (`hspec_jax.kernels.cpu_matmul`, where it runs).

    python -m benchmarks.matmul_rows [--chain 20] [--repeats 30]

A target forward is ~210 such products, so T_T(8) / T_T(1) (verification of 8 positions against a single-token
step) cannot be lower than what the products give at 8 rows against 1: this is the bound on issue 9's goal of
T_T(8) / T_T(1) <= 1.3. Each timing is a chain of `--chain` products on different weights (so every product
reads its weights from memory, as in a forward), median of `--repeats` chains, divided by the chain length.
Writes `benchmarks/results/matmul_rows.md`.
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import median_time, write_report
from hspec_jax.kernels import cpu_matmul
from hspec_jax.machine import cpu_model

ROWS = (1, 2, 4, 8, 16)
K, N = 576, 1536


def xla_product_time(rows: int, dtype, chain: int, repeats: int, packed: bool = False) -> float:
    """Seconds per [rows, K] x [K, N] product in one jitted chain, accumulated in fp32 (`packed`: the weights
    packed, each product on the packed kernel)."""
    rng = np.random.default_rng(0)
    weights = [jnp.asarray(rng.standard_normal((K, N)) * 0.02, dtype) for _ in range(chain)]
    if packed:
        weights = [cpu_matmul.pack(w) for w in weights]
    x = jnp.asarray(rng.standard_normal((rows, K)), dtype)
    product = cpu_matmul.packed_matmul if packed else lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32)

    @jax.jit
    def products(x, weights):
        acc = jnp.zeros((rows, N), jnp.float32)
        for w in weights:
            acc = acc + product(x, w)
        return acc

    def call():
        products(x, weights).block_until_ready()

    call()
    return median_time(call, repeats) / chain


def torch_product_time(rows: int, chain: int, repeats: int) -> float:
    """Seconds per fp32 [rows, K] x [K, N] product in PyTorch (eager, oneDNN), written into a preallocated output."""
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(K, N, generator=gen) * 0.02 for _ in range(chain)]
    x, out = torch.randn(rows, K, generator=gen), torch.empty(rows, N)

    def call():
        with torch.inference_mode():
            for w in weights:
                torch.matmul(x, w, out=out)

    call()
    return median_time(call, repeats) / chain


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chain", type=int, default=20, help="products per timed call")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", default="benchmarks/results/matmul_rows.md")
    args = parser.parse_args(argv)
    cpu = cpu_model()
    series = {
        "XLA fp32": {m: xla_product_time(m, jnp.float32, args.chain, args.repeats) for m in ROWS},
        "XLA bf16": {m: xla_product_time(m, jnp.bfloat16, args.chain, args.repeats) for m in ROWS},
        "PyTorch fp32": {m: torch_product_time(m, args.chain, args.repeats) for m in ROWS},
    }
    if cpu_matmul.available():
        series["packed kernel fp32"] = {
            m: xla_product_time(m, jnp.float32, args.chain, args.repeats, True) for m in ROWS
        }
    flops = {m: 2 * m * K * N for m in ROWS}
    header = "| back end | " + " | ".join(f"{m} rows µs" for m in ROWS) + " | 8 rows / 1 row | GFLOP/s at 8 rows |"
    lines = [
        "# One matrix product at 1 to 16 rows: the bound on verifying 8 tokens at once (issue 9)",
        "",
        f"Machine: {cpu}, {os.cpu_count()} CPUs; jax {jax.__version__} ({jax.default_backend()}).  ",
        f"Command: `python -m benchmarks.matmul_rows --chain {args.chain} --repeats {args.repeats}`  ",
        f"[M, {K}] x [{K}, {N}] (SmolLM2's MLP up projection); a chain of {args.chain} products on different "
        f"weights per timed call, median of {args.repeats} calls, per product.",
        "",
        header,
        "|---|" + "---|" * (len(ROWS) + 2),
    ]
    for name, times in series.items():
        cells = " | ".join(f"{times[m] * 1e6:.0f}" for m in ROWS)
        lines.append(f"| {name} | {cells} | {times[8] / times[1]:.2f} | {flops[8] / times[8] / 1e9:.1f} |")
        print(name, "  ".join(f"{m}:{times[m] * 1e6:.0f}us" for m in ROWS), f"8/1 {times[8] / times[1]:.2f}")
    best8 = min(t[8] for t in series.values())
    best1 = min(t[1] for t in series.values())
    lines += [
        "",
        f"Best of the back ends: {best1 * 1e6:.0f} µs at 1 row, {best8 * 1e6:.0f} µs at 8 rows: **8 rows cost "
        f"{best8 / best1:.2f}x one row** at the products a SmolLM2 forward is made of ({cpu}).",
    ]
    write_report(args.out, lines)


if __name__ == "__main__":
    main()
