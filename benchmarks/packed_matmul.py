"""What the packed CPU matmul kernel changes: a SmolLM2 target forward over T = 1, 2, 4, 5 and 8 tokens (a plain
step, and verifying 1, 3, 4 or 7 drafted tokens) with XLA's dots against the packed kernel, in one process.

    python -m benchmarks.packed_matmul [--repeats 15] [--contexts 64,1024]

Both trees are placed as the engines place them (`for_backend`): XLA's dots as on a CPU without the kernel (fused
projections, one tree per layer, layers called one by one), the packed kernel as here (fused, packed, layers
stacked and scanned). Each forward is jitted with its cache donated, as in the engines; the two trees alternate call by
call (A, B, A, B, ...) and each cell is a median of `--repeats` calls. Also checks that both give the same greedy
tokens. Writes `benchmarks/results/packed_matmul.md`.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import write_report
from hspec_jax.checkpoints import load_target
from hspec_jax.kernels import cpu_matmul
from hspec_jax.machine import cpu_model
from hspec_jax.models import forward, init_cache
from hspec_jax.models.decoder import unstack_layers
from hspec_jax.models.layers import for_backend, fuse_projections

WIDTHS = (1, 2, 4, 5, 8)


def forward_times(trees: dict, context: int, repeats: int) -> tuple[dict, bool]:
    """{(tree name, T): median seconds} of one forward over T tokens after `context` cached rows (`trees`: name ->
    (config, placed params)), and whether every tree gave the same greedy tokens."""

    def run(p, config, t, c):
        out = forward(p, config, t, c)
        return out.logits.argmax(-1), out.cache

    jitted = jax.jit(run, static_argnums=1, donate_argnums=3)
    step = lambda tree, t, c: jitted(tree[1], tree[0], t, c)
    config = next(iter(trees.values()))[0]
    fresh = lambda config=config: init_cache(config, 1, context + 16).replace(lengths=jnp.array([context], jnp.int32))
    rng = np.random.default_rng(context)
    tokens = {t: jnp.asarray(rng.integers(0, config.vocab_size, (1, t)), jnp.int32) for t in WIDTHS}
    agree = True
    for t in WIDTHS:
        outs = [np.asarray(step(tree, tokens[t], fresh(tree[0]))[0]) for tree in trees.values()]
        agree &= all(np.array_equal(outs[0], o) for o in outs[1:])
    samples = {(name, t): [] for name in trees for t in WIDTHS}
    for _ in range(repeats):
        for t in WIDTHS:
            for name, tree in trees.items():
                cache = fresh(tree[0])
                jax.block_until_ready(cache)
                start = time.perf_counter()
                jax.block_until_ready(step(tree, tokens[t], cache))
                samples[name, t].append(time.perf_counter() - start)
    return {key: float(np.median(v)) for key, v in samples.items()}, agree


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--contexts", default="64,1024")
    parser.add_argument("--out", default="benchmarks/results/packed_matmul.md")
    args = parser.parse_args(argv)
    if not cpu_matmul.available():
        raise SystemExit("the packed CPU matmul kernel does not run here (see the log line above)")
    config, params = load_target("smollm2")
    fused = fuse_projections(params)
    per_layer = {**fused, "layers": unstack_layers(fused["layers"], config.num_layers)}
    trees = {
        "XLA dots": (config.replace(scan_layers=False), for_backend(per_layer, pack=False)),
        "packed kernel": (config, for_backend(params, pack=True)),
    }
    cpu = cpu_model()
    lines = [
        "# The packed CPU matmul kernel: a SmolLM2 forward over T tokens, XLA's dots against the packed kernel",
        "",
        f"Machine: {cpu}, {os.cpu_count()} CPUs; jax {jax.__version__} ({jax.default_backend()}); "
        f"SmolLM2-135M-Instruct fp32, batch 1; the kernel's {cpu_matmul.kernel_path()} path.  ",
        f"Command: `python -m benchmarks.packed_matmul --repeats {args.repeats} --contexts {args.contexts}`  ",
        "Placed as the engines place them (fused projections; XLA's dots one tree per layer, called one by one, as "
        "on a CPU without the kernel; the packed kernel's layers stacked and scanned), cache donated, the two trees "
        f"alternating call by call, median of {args.repeats} calls. T(t) / T(1): what verifying t - 1 drafted tokens "
        "costs over a plain step.",
        "",
        "| context | dots | " + " | ".join(f"T={t} ms" for t in WIDTHS) + " | T(8)/T(1) | same greedy tokens |",
        "|---|---|" + "---|" * (len(WIDTHS) + 2),
    ]
    for context in (int(c) for c in args.contexts.split(",")):
        times, agree = forward_times(trees, context, args.repeats)
        for name in trees:
            cells = " | ".join(f"{times[name, t] * 1e3:.1f}" for t in WIDTHS)
            ratio = times[name, 8] / times[name, 1]
            lines.append(f"| {context} | {name} | {cells} | {ratio:.2f} | {'yes' if agree else 'NO'} |")
            print(context, name, cells, f"T(8)/T(1) {ratio:.2f}", cpu)
        speedup = " | ".join(f"{times['XLA dots', t] / times['packed kernel', t]:.2f}x" for t in WIDTHS)
        lines.append(f"| {context} | XLA / packed | {speedup} | | |")
    write_report(args.out, lines)


if __name__ == "__main__":
    main()
