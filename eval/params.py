"""Trainable parameters per component of H-Spec, DSpark and DFlash under one target's recipe.

    python -m eval.params --config configs/qwen3_8b.py

Shapes come from `jax.eval_shape` (no weights are allocated). Frozen parameters (the draft lm_head rows
and the q/k norms copied from the target) are listed apart; target embeddings are shared, not counted.
"""

from __future__ import annotations

import sys

from hspec_jax.cli import ArgumentParser, run
from hspec_jax.drafters import drafter_param_shapes
from hspec_jax.drafters.family import compared_kinds
from hspec_jax.drafters.params import count_by_component
from hspec_jax.recipes import drafter_from_recipe, load_config, target_config

KINDS = compared_kinds()


def parameter_table(recipe) -> tuple[list[str], dict[str, int]]:
    """Markdown lines of the per-component table, and the trainable totals per kind."""
    target = target_config(recipe)
    counts = {}
    for kind in KINDS:
        drafter = drafter_from_recipe(recipe, kind, target)
        shapes = drafter_param_shapes(drafter)
        counts[kind] = count_by_component(shapes, drafter)
    components = list(dict.fromkeys(c for kind in KINDS for c in counts[kind]))
    fmt = lambda n: f"{n:,}" if n else "-"
    lines = [f"| component | {' | '.join(KINDS)} |", "|---" * (len(KINDS) + 1) + "|"]
    for comp in components:
        cells = [fmt(counts[k].get(comp, {}).get("trainable", 0)) for k in KINDS]
        lines.append(f"| {comp} | {' | '.join(cells)} |")
    totals = {k: sum(v["trainable"] for v in counts[k].values()) for k in KINDS}
    frozen = {k: sum(v["frozen"] for v in counts[k].values()) for k in KINDS}
    lines.append(f"| **trainable total** | {' | '.join(f'**{fmt(totals[k])}**' for k in KINDS)} |")
    lines.append(f"| frozen (draft lm_head, copied q/k norms) | {' | '.join(fmt(frozen[k]) for k in KINDS)} |")
    return lines, totals


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m eval.params", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="a recipe file or name, e.g. configs/qwen3_8b.py or qwen3_8b")
    args = parser.parse_args(argv)
    recipe = load_config(args.config)
    lines, totals = parameter_table(recipe)
    print(f"Trainable drafter parameters for {recipe.target.name} ({args.config}):\n")
    print("\n".join(lines))
    diff = totals["hspec"] / totals["dspark"] - 1
    print(f"\nH-Spec vs DSpark: {diff:+.2%} trainable parameters")
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
