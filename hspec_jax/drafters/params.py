"""Which drafter parameters train, and which component each belongs to (for `eval.params`)."""

from __future__ import annotations

import jax
import numpy as np

from hspec_jax.drafters.api import mirrored_target_layers
from hspec_jax.drafters.config import DrafterConfig, HSpecConfig

# Kept frozen: the draft lm_head (target rows), and the q/k norms copied from the target layers whose
# KV cache is read (block keys must stay normalised exactly like the cached ones).
FROZEN_COPIES = ("q_norm", "k_norm")


def _path(key_path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", k)) for k in key_path)


def is_trainable(config: DrafterConfig, path: tuple[str, ...]) -> bool:
    if path[0] == "lm_head":
        return False
    mirrored = mirrored_target_layers(config)
    return not (path[0] in mirrored and len(path) > 2 and path[1] == "self_attn" and path[2] in FROZEN_COPIES)


def trainable_mask(params: dict, config: DrafterConfig):
    """A pytree of bools shaped like `params`: True where the optimizer updates."""
    return jax.tree_util.tree_map_with_path(lambda kp, _: is_trainable(config, _path(kp)), params)


def component(config: DrafterConfig, path: tuple[str, ...]) -> str:
    """Human-readable component of a parameter path."""
    top = path[0]
    if top in ("fc", "hidden_norm") or top.startswith("seed_projs"):
        return "latent fusion + seed" if isinstance(config, HSpecConfig) else "context fusion (fc)"
    if top.startswith("layers_"):
        if isinstance(config, HSpecConfig):
            kind = config.block_pattern[int(top.split("_")[1])]
            return {"mamba": "mamba-2 mixers", "attn": "attention", "mlp": "mlp"}[kind]
        return "attention" if path[1] in ("self_attn", "input_layernorm") else "mlp"
    return {
        "norm": "final norm",
        "lm_head": "draft lm_head",
        "markov_head": "markov head",
        "confidence_head": "confidence head",
    }[top]


def count_by_component(params, config: DrafterConfig) -> dict[str, dict[str, int]]:
    """{component: {"trainable": n, "frozen": n}} from concrete or abstract (`eval_shape`) params."""
    counts: dict[str, dict[str, int]] = {}
    for key_path, leaf in jax.tree_util.tree_leaves_with_path(params):
        path = _path(key_path)
        entry = counts.setdefault(component(config, path), {"trainable": 0, "frozen": 0})
        entry["trainable" if is_trainable(config, path) else "frozen"] += int(np.prod(leaf.shape))
    return counts
