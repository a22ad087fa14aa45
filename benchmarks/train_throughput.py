"""Training throughput and memory of one step on the SmolLM2 target: H-Spec vs DSpark vs DFlash, by anchor density.

    python -m benchmarks.train_throughput [--seq-len 1024 --batch-size 2 --anchors 64,128,256 --kinds hspec --steps 5]

Each kind runs the real jitted train step (`train/step.py`: frozen target forward over the packed rows,
drafter over all anchors in chunks, loss, AdamW update) on synthetic packed rows (random tokens in four
documents per row, half of each supervised; the step's cost does not depend on the token values). Reported:
median step time, training tokens/s (packed tokens per second), supervised block slots per second, the
compiled step's memory as XLA plans it (arguments + outputs + temporaries, `memory_analysis()`), and what caching
the frozen target's features on disk would save and cost: the jitted target forward alone on the same rows (the
time a cached epoch no longer spends) and the bytes per token a cache holds in bf16 (the fused taps, the last
layer's output for the labels, and the K/V of the target layers the drafter reads). All from one run on this
machine (CPU model printed beside the numbers).
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import median_time, write_report
from hspec_jax.checkpoints import load_target
from hspec_jax.drafters import init_drafter, init_from_target
from hspec_jax.drafters.api import mirrored_target_layers
from hspec_jax.drafters.family import compared_kinds
from hspec_jax.drafters.vocab import build_draft_vocab
from hspec_jax.machine import cpu_model
from hspec_jax.recipes import drafter_from_recipe, load_config
from train.losses import recipe_weights
from train.optim import make_optimizer
from train.step import StepConfig, fresh_state, make_train_step, target_features

KINDS = compared_kinds()


def synthetic_batch(rng, vocab_size: int, batch: int, length: int, anchors: int, block: int) -> dict:
    """Packed rows of four equal documents; the second half of each document supervised; sorted anchors."""
    doc = length // 4
    positions = np.tile(np.arange(length) % doc, (batch, 1)).astype(np.int32)
    doc_ids = np.tile(np.arange(length) // doc, (batch, 1)).astype(np.int32)
    loss_mask = positions >= doc // 2
    candidates = np.flatnonzero(loss_mask[0, : length - block] & loss_mask[0, 1 : length - block + 1])
    picks = np.stack([np.sort(rng.choice(candidates, anchors, replace=False)) for _ in range(batch)])
    return {
        "tokens": rng.integers(0, vocab_size, (batch, length)).astype(np.int32),
        "positions": positions,
        "doc_ids": doc_ids,
        "loss_mask": loss_mask,
        "anchors": picks.astype(np.int32),
        "anchor_valid": np.ones((batch, anchors), bool),
    }


def cached_bytes_per_token(drafter, target) -> int:
    """bf16 bytes per token of a feature cache for `drafter`'s training: every fused tap, the last layer's output,
    and K and V of each target layer whose cache the drafter reads."""
    read_layers = set(mirrored_target_layers(drafter).values())
    taps = len(drafter.fusion_layer_ids) + 1
    return 2 * (taps * target.hidden_size + len(read_layers) * 2 * target.num_kv_heads * target.head_dim)


def target_forward_time(step_config: StepConfig, target_params, batch, steps: int) -> float:
    """Median seconds of the jitted frozen-target forward of the train step, alone, on `batch`'s rows."""
    forward = jax.jit(lambda p, t, pos: target_features(p, step_config, t, pos))

    def once():
        jax.block_until_ready(forward(target_params, batch["tokens"], batch["positions"]))

    once()
    return median_time(once, steps)


def measure(recipe, kind, target, target_params, batch, steps):
    drafter = drafter_from_recipe(recipe, kind, target)
    vocab = build_draft_vocab(np.asarray(batch["tokens"]), target.vocab_size, drafter.vocab_size)
    params = init_from_target(init_drafter(drafter, jax.random.key(0)), drafter, target_params, vocab)
    train = recipe.train.copy_and_resolve_references()
    optimizer, schedule = make_optimizer(train, params, drafter)
    state = fresh_state(params, optimizer, seed=0)
    weights = recipe_weights(kind, train.gamma)
    step_config = StepConfig(target, drafter, weights, train.anchors_per_chunk)
    step = make_train_step(step_config, optimizer, schedule)
    batch = jax.tree.map(jnp.asarray, batch)
    compiled = step.lower(state, target_params, vocab, batch).compile()
    memory = compiled.memory_analysis()
    planned = memory.argument_size_in_bytes + memory.output_size_in_bytes + memory.temp_size_in_bytes
    holder = {"state": state}

    def once():
        holder["state"], metrics = compiled(holder["state"], target_params, vocab, batch)
        jax.block_until_ready(metrics["loss"])

    once()
    seconds = median_time(once, steps)
    forward = target_forward_time(step_config, target_params, batch, steps)
    return seconds, planned, memory.temp_size_in_bytes, forward, cached_bytes_per_token(drafter, target)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default="configs/smollm2.py")
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--anchors", default="128", help="anchors per row; a comma list sweeps the density")
    parser.add_argument("--kinds", default=",".join(KINDS), help="drafter kinds, comma separated")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/train_throughput.md")
    args = parser.parse_args(argv)
    anchor_counts = [int(a) for a in args.anchors.split(",")]
    kinds = args.kinds.split(",")
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        parser.error(f"--kinds: unknown {unknown}; choose from {list(KINDS)}")
    recipe = load_config(args.recipe)
    target, target_params = load_target(args.target)
    block = recipe.drafter.block_size
    tokens = args.batch_size * args.seq_len
    rows = []
    for anchors in anchor_counts:
        rng = np.random.default_rng(0)
        batch = synthetic_batch(rng, target.vocab_size, args.batch_size, args.seq_len, anchors, block)
        slots = args.batch_size * anchors * (block - 1)
        for kind in kinds:
            seconds, planned, temp, forward, cached = measure(recipe, kind, target, target_params, batch, args.steps)
            rows.append(
                f"| {kind} | {anchors} | {seconds * 1e3:.0f} | {tokens / seconds:.0f} | {slots / seconds:.0f} | "
                f"{planned / 2**20:.0f} | {temp / 2**20:.0f} | {forward * 1e3:.0f} ({forward / seconds:.0%}) | "
                f"{cached / 1024:.1f} |"
            )
            print(rows[-1], flush=True)
    lines = [
        "# Training step throughput on SmolLM2: H-Spec vs DSpark vs DFlash",
        "",
        f"Machine: {cpu_model()}, {os.cpu_count()} cores, jax {jax.__version__} ({jax.default_backend()}), fp32.",
        f"Command: `python -m benchmarks.train_throughput --recipe {args.recipe} --seq-len {args.seq_len} "
        f"--batch-size {args.batch_size} --anchors {args.anchors} --kinds {args.kinds} --steps {args.steps}`",
        "",
        f"A step: {args.batch_size} packed rows x {args.seq_len} tokens ({tokens} tokens), the given anchors per row "
        f"(each supervises {block - 1} block slots), anchors in chunks of {recipe.train.anchors_per_chunk}, AdamW. "
        "Synthetic packed rows (random tokens); median of the timed steps after compilation. Target forward: the "
        "frozen target alone on the same rows (its share of the step in brackets), what a cached epoch would not "
        "spend; cache KB/token: the bf16 features such a cache stores per token.",
        "",
        "| kind | anchors/row | step ms | tokens/s | block slots/s | step memory MiB (args+out+temp) | temporaries MiB "
        "| target forward ms | cache KB/token |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]
    write_report(args.out, lines)


if __name__ == "__main__":
    main()
