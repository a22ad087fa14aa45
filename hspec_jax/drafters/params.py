"""Which drafter parameters train, and which component each belongs to (for `eval.params`)."""

from __future__ import annotations

import re

import jax
import numpy as np

from hspec_jax.drafters.api import mirrored_target_layers
from hspec_jax.drafters.config import DrafterConfig
from hspec_jax.drafters.family import family_of

# Kept frozen: the draft lm_head (target rows), the drafter's own mask-token embedding row, and the q/k norms
# copied from the target layers whose KV cache is read (block keys must stay normalised exactly like the cached
# ones). q/k norms of a target without them (Llama) have nothing to copy and train.
FROZEN_COPIES = ("q_norm", "k_norm")
FROZEN_TOP = ("lm_head", "mask_embedding")


def _path(key_path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", k)) for k in key_path)


def is_trainable(config: DrafterConfig, path: tuple[str, ...]) -> bool:
    if path[0] in FROZEN_TOP:
        return False
    mirrored = mirrored_target_layers(config)
    copied = config.target.qk_norm and len(path) > 2 and path[1] == "self_attn" and path[2] in FROZEN_COPIES
    return not (path[0] in mirrored and copied)


def trainable_mask(params: dict, config: DrafterConfig):
    """A pytree of bools shaped like `params`: True where the optimizer updates."""
    return jax.tree_util.tree_map_with_path(lambda kp, _: is_trainable(config, _path(kp)), params)


_SUBLAYER_COMPONENTS = {
    "self_attn": "attention",
    "input_layernorm": "attention",
    "ssm": "mamba-2 mixers",
    "ssm_norm": "mamba-2 mixers",
}
# The pieces several families share (tap fusion, the output stage of `output.py` and `heads.py`); each family adds
# its own (`DrafterFamily.components`).
_COMMON_COMPONENTS = {
    "fc": "fusion of target hidden states",
    "hidden_norm": "fusion of target hidden states",
    "norm": "final norm",
    "lm_head": "draft lm_head",
    "mask_embedding": "mask embedding",
    "markov_head": "markov head",
    "confidence_head": "confidence head",
}


def component(config: DrafterConfig, path: tuple[str, ...]) -> str:
    """Human-readable component of a parameter path (the same names for every drafter family). A numbered
    top-level name (`seed_projs_0`) is looked up without its number."""
    top = re.sub(r"_\d+$", "", path[0])
    if top == "layers":
        return _SUBLAYER_COMPONENTS.get(path[1], "mlp")
    family = family_of(config)
    components = {**_COMMON_COMPONENTS, **family.components}
    if top not in components:
        raise KeyError(
            f"parameter {path[0]!r} of the {family.name!r} drafter family has no component; known: {sorted(components)}"
        )
    return components[top]


def count_by_component(params, config: DrafterConfig) -> dict[str, dict[str, int]]:
    """{component: {"trainable": n, "frozen": n}} from concrete or abstract (`eval_shape`) params."""
    counts: dict[str, dict[str, int]] = {}
    for key_path, leaf in jax.tree_util.tree_leaves_with_path(params):
        path = _path(key_path)
        entry = counts.setdefault(component(config, path), {"trainable": 0, "frozen": 0})
        entry["trainable" if is_trainable(config, path) else "frozen"] += int(np.prod(leaf.shape))
    return counts
