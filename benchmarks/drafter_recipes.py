"""Drafter step time T_D of H-Spec under several recipes of one target, at the draft lengths to compare, on CPU.

    python -m benchmarks.drafter_recipes --recipes smollm2,smollm2_small --k 2,7 --contexts 256,1024

The step is the one `benchmarks/drafter_forward.py` times (seed fusion, the sub-layers reading the target's KV
cache, the Markov head choosing the k tokens), at batch 1 with random weights; with a recipe's acceptance tau
(from `eval.main`) it gives the end-to-end speedup the recipe can reach, tau x T_plain / (T_verify + T_D).
Writes a table with each recipe's parameter count beside its times.
"""

from __future__ import annotations

import argparse
import os
import platform

import jax

from benchmarks.common import write_report
from benchmarks.drafter_forward import time_step
from hspec_jax.drafters import drafter_param_shapes
from hspec_jax.machine import cpu_model
from hspec_jax.recipes import drafter_from_recipe, load_config


def parameter_count(recipe) -> int:
    """Parameters of the recipe's drafter (shapes only, nothing allocated)."""
    config = drafter_from_recipe(recipe)
    shapes = drafter_param_shapes(config)
    return sum(leaf.size for leaf in jax.tree.leaves(shapes))


def with_drafts(recipe, k: int):
    """A copy of the recipe drafting k tokens per step."""
    recipe = recipe.copy_and_resolve_references()
    recipe.drafter.block_size = drafter_from_recipe(recipe).with_drafts(k).block_size
    return recipe


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipes", default="smollm2,smollm2_small", help="comma-separated recipe names or files")
    parser.add_argument("--k", default="2,7", help="drafted tokens per step, comma-separated")
    parser.add_argument("--contexts", default="256,1024", help="context lengths, comma-separated")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/results/recipes_smollm2/drafter_step.md")
    args = parser.parse_args(argv)
    names = args.recipes.split(",")
    ks = [int(k) for k in args.k.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    recipes = {name: load_config(name) for name in names}

    lines = [
        "# H-Spec drafter step time T_D by recipe (CPU, batch 1)",
        "",
        f"Command: `python -m benchmarks.drafter_recipes --recipes {args.recipes} --k {args.k} "
        f"--contexts {args.contexts} --repeats {args.repeats}`  ",
        f"Machine: {cpu_model()} ({platform.machine()}), {os.cpu_count()} CPUs, jax {jax.__version__}, fp32. "
        "Median of the repeats after compilation; random weights (speed does not depend on them).",
        "",
        "| recipe | parameters (with the frozen lm_head) | "
        + " | ".join(f"k={k} @{c} ms" for k in ks for c in contexts)
        + " |",
        "|---|---|" + "---|" * (len(ks) * len(contexts)),
    ]
    for name, recipe in recipes.items():
        times = [time_step(with_drafts(recipe, k), "hspec", 1, c, args.repeats) for k in ks for c in contexts]
        cells = " | ".join(f"{t * 1e3:.2f}" for t in times)
        lines.append(f"| {name} | {parameter_count(recipe) / 1e6:.1f} M | {cells} |")
        print(lines[-1], flush=True)
    write_report(args.out, lines)


if __name__ == "__main__":
    main()
