"""What an H-Spec drafter uses of its target: held-out agreement with each conditioning path switched off.

    python -m benchmarks.drafter_ablation [--recipe configs/smollm2.py] [--drafter smollm2-hspec]
        [--out benchmarks/results/drafter_ablation.md]

The trained drafter is scored on the recipe's held-out batches (`data.held_out`, packed and anchored as
`train.main` packs them), on the training path, four times with the same weights:
- as trained;
- without the seed state (`use_state_injection=False`: the Mamba layers start from zero, the target's hidden
  states at the anchor are not read);
- without the target's KV cache (`use_target_kv=False`: attention sees only the block);
- without either (the drafter sees only the anchor token and its position).
A path whose removal costs little agreement is one the drafter learned to do without. Compare with the n-gram
floor (`benchmarks.ngram_baseline`), which sees only the anchor and the token before it.
"""

from __future__ import annotations

import argparse
import os

from benchmarks.common import write_report
from hspec_jax import parallel
from hspec_jax.checkpoints.drafter_io import restore_drafter
from hspec_jax.machine import cpu_model
from hspec_jax.recipes import drafter_from_recipe, load_config
from train.data import Source, load_conversations
from train.loop import fixed_batches, pooled_metrics
from train.losses import recipe_weights
from train.step import StepConfig, eval_sums_fn
from train.targets import load_target_and_tokenizer

VARIANTS = {
    "as trained": {},
    "no seed state": {"use_state_injection": False},
    "no target KV": {"use_target_kv": False},
    "neither": {"use_state_injection": False, "use_target_kv": False},
}


def held_out_agreement(step_config: StepConfig, params, target_params, vocab, batches) -> dict:
    """The pooled training-path metrics (`acc_k`, `sim_accept_len`, ...) of `params` on `batches`."""
    return pooled_metrics(eval_sums_fn(step_config), params, target_params, vocab, batches, step_config.weights)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default="configs/smollm2.py", help="its target, drafter shape and held-out file")
    parser.add_argument("--drafter", default="smollm2-hspec", help="drafter directory or shipped name (H-Spec kind)")
    parser.add_argument("--out", default="benchmarks/results/drafter_ablation.md")
    args = parser.parse_args(argv)
    recipe = load_config(args.recipe)
    if not recipe.data.held_out:
        parser.error(f"{args.recipe} has no data.held_out file to score on")
    target, target_params, tokenizer = load_target_and_tokenizer(recipe.target.path)
    drafter, params, vocab = restore_drafter(args.drafter, target, target_params)
    if not hasattr(drafter, "use_target_kv"):
        parser.error(f"--drafter {args.drafter} is of kind {drafter.kind}; this ablation switches H-Spec's paths")
    drafter = drafter.replace(dtype=drafter_from_recipe(recipe, target=target).dtype)
    mesh = parallel.make_mesh(recipe.mesh)
    held_out = load_conversations(Source("held_out", recipe.data.held_out))  # as train.main reads it
    batches = fixed_batches(held_out, tokenizer, recipe, drafter.num_drafts + 1, mesh)
    weights = recipe_weights(drafter.kind, recipe.train.gamma, **recipe.train.loss.to_dict())
    rows = []
    for name, fields in VARIANTS.items():
        step_config = StepConfig(target, drafter.replace(**fields), weights, recipe.train.anchors_per_chunk)
        metrics = held_out_agreement(step_config, params, target_params, vocab, batches)
        slots = [metrics[f"acc_{i}"] for i in range(1, drafter.num_drafts + 1)]
        rows.append(
            f"| {name} | {slots[0]:.3f} | {slots[1]:.3f} | {metrics['sim_accept_len']:.3f} | "
            f"{' '.join(f'{s:.2f}' for s in slots)} |"
        )
        print(rows[-1], flush=True)
    anchors = sum(int(b["anchor_valid"].sum()) for b in batches)
    lines = [
        f"# What `{args.drafter}` uses of its target: held-out agreement with each path switched off",
        "",
        f"Machine: {cpu_model()}, {os.cpu_count()} cores (no timing).",
        f"Command: `python -m benchmarks.drafter_ablation --recipe {args.recipe} --drafter {args.drafter}`",
        "",
        f"Held out: `{os.path.relpath(recipe.data.held_out)}`, {len(batches)} packed batches, {anchors} blocks; "
        "the same weights in every row. Agreement `acc_k`: the drafter's argmax at slot k equals the target's, "
        "given the target's tokens before it (conditional on nothing, unlike the engine's accepted prefix); "
        "sim accept length: 1 + sum of the cumulative products of the agreements (`train.losses`).",
        "",
        "| drafter reads | slot-1 agreement | slot-2 agreement | sim accept length | agreement by slot 1..k |",
        "|---|---|---|---|---|",
        *rows,
    ]
    write_report(args.out, lines)


if __name__ == "__main__":
    main()
