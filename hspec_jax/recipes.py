"""Recipes: the `ml_collections` configs of `configs/*.py` and their conversion to model configs.

A recipe `ConfigDict` has:
  target.name       the checkpoint it describes (documentation; nothing is downloaded)
  target.path       a local checkpoint (HF dir, .gguf, Orbax dir, or "smollm2"); "" = architecture only
  target.hf_config  the target's `config.json` values, so shapes and memory are known without weights
  drafter.*         the drafter recipe (`kind` selects H-Spec, DFlash, DSpark or an ablation)
"""

from __future__ import annotations

import importlib.util
import os

import ml_collections

from hspec_jax.drafters import PAPER_BLOCK_PATTERN, DrafterConfig, drafter_config
from hspec_jax.errors import InputError
from hspec_jax.models import TargetConfig


def recipe(
    *,
    name: str,
    hf_config: dict,
    fusion_layer_ids: tuple[int, ...],
    attn_kv_layer_ids: tuple[int, ...],
    mamba_heads: int,
    fusion_rank: int,
    mask_token_id: int,
    draft_vocab_size: int = 32000,
    markov_rank: int = 256,
    path: str = "",
) -> ml_collections.ConfigDict:
    """The paper's recipe for one target: block 8 (k = 7), Mamba-2 heads of 64, d_state 4, 4 groups, sliding
    window 2048, draft vocabulary 32000, Markov rank 256; layer ids and widths per target."""
    c = ml_collections.ConfigDict()
    c.target = ml_collections.ConfigDict({"name": name, "path": path, "hf_config": hf_config})
    c.drafter = ml_collections.ConfigDict(
        {
            "kind": "hspec",
            "block_size": 8,
            "draft_vocab_size": draft_vocab_size,
            "mask_token_id": mask_token_id,
            "fusion_layer_ids": tuple(fusion_layer_ids),
            "attn_kv_layer_ids": tuple(attn_kv_layer_ids),
            "fusion_rank": fusion_rank,
            "block_pattern": PAPER_BLOCK_PATTERN,
            "seed_mode": "shared",
            "sliding_window": 2048,
            "markov_rank": markov_rank,
            "confidence_head": True,
            "num_layers": 5,
            "mamba": {"num_heads": mamba_heads, "head_dim": 64, "d_state": 4, "n_groups": 4, "conv_kernel": 4},
            "attention_impl": "auto",
        }
    )
    c.data = data_section()
    c.train = train_section()
    c.mesh = "data=1,fsdp=1,model=1"
    return c


def data_section() -> ml_collections.ConfigDict:
    """Training data (`train/data.py`): sources and their mixture weights, packing and anchor sampling."""
    return ml_collections.ConfigDict(
        {
            "sources": "sharegpt",  # comma-separated source specs with weights, see train/data.py
            "seq_len": 2048,  # packed row length L
            "max_anchors": 512,  # blocks per packed row (A)
            "seed": 0,  # shuffling and anchor sampling of the training data (held-out rows: a fixed seed)
            "exclude_eval_prompts": True,  # drop conversations containing an evaluation prompt
            # Conversations never trained on (a local file; any training conversation sharing a user turn with
            # one is dropped), measured every `train.eval_every` steps; "" = the last `held_out_prompts`
            # conversations of the first source.
            "held_out": "",
            "held_out_prompts": 8,  # held-out prompts the periodic real-tau check generates from (the first ones)
            # Packed batches (`train.batch_size` rows each, fixed) of the held-out conversations the training
            # path's per-slot agreement and simulated accept length are measured on (repeating them if too few).
            "held_out_batches": 4,
            # Packed batches per family where the held-out records name families (their "source" field, as the
            # task-shaped files do): agreement and simulated accept length per family; 0 = none.
            "held_out_family_batches": 1,
            # Supervised tokens of a random sample of the conversations the draft vocabulary is counted from
            # (its top tokens by frequency); 0 = every conversation (slow: minutes for ShareGPT).
            "vocab_sample_tokens": 2_000_000,
        }
    )


def train_section() -> ml_collections.ConfigDict:
    """The optimisation recipe (`train/main.py`): the paper's AdamW at 6e-4, cosine, 1% warmup."""
    placeholder = ml_collections.config_dict.placeholder
    return ml_collections.ConfigDict(
        {
            "num_steps": 1000,
            "batch_size": 8,  # packed rows per step, over all processes and devices
            "optimizer": "adamw",  # or "muon" (2-D weights; AdamW on the rest), the authors' code default
            "learning_rate": 6e-4,
            "warmup_fraction": 0.01,
            "weight_decay": 0.01,
            "b1": 0.9,
            "b2": 0.999,
            "muon_lr_multiplier": 10.0,
            "muon_weight_decay": 0.1,
            "clip_norm": 1.0,
            # A drafter (directory or shipped name) to fine-tune: its weights and draft vocabulary start the
            # run (the optimiser starts fresh); its config must be the recipe's drafter.
            "init_from": placeholder(str),
            # Or a smaller drafter cut from it (train/warm_start.py): the init_from sub-layer each of the recipe's
            # sub-layers starts from, comma-separated ("0,1,2,9,10"); a smaller draft vocabulary keeps its top tokens.
            "init_layers": placeholder(str),
            # Loss weights; unset = the kind's recipe (0.1 CE + 0.9 TV + 1.0 confidence; DFlash: CE only).
            "loss": {"ce": placeholder(float), "tv": placeholder(float), "confidence": placeholder(float)},
            "gamma": 4.0,  # position decay of the loss weights
            "anchors_per_chunk": 64,  # blocks drafted at once inside the step (bounds activation memory)
            "seed": 0,
            "log_every": 10,
            "checkpoint_every": 100,
            "keep_checkpoints": 3,
            "eval_every": 200,  # real tau from the draft-and-verify engine on the held-out prompts (0 = off)
            "eval_max_new_tokens": 64,
        }
    )


def target_config(c: ml_collections.ConfigDict, **overrides) -> TargetConfig:
    """The target's config from the recipe's `target.hf_config`."""
    try:
        return TargetConfig.from_hf(c.target.hf_config.to_dict(), **overrides)
    except (ValueError, TypeError, KeyError) as e:
        raise InputError(f"recipe {c.target.name!r}: target: {e}") from None


def drafter_from_recipe(
    c: ml_collections.ConfigDict,
    kind: str | None = None,
    target: TargetConfig | None = None,
) -> DrafterConfig:
    """The drafter config of `kind` (default: the recipe's `drafter.kind`) under this recipe."""
    target = target or target_config(c)
    fields = c.drafter.to_dict()
    kind = kind or fields.pop("kind")
    fields.pop("kind", None)
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
    try:
        return drafter_config(kind, target, **fields)
    except (ValueError, TypeError, KeyError) as e:
        raise InputError(f"recipe {c.target.name!r}: {kind} drafter: {e}") from None


# Recipe names resolve to the repository's configs/ folder (present when the package is used from a clone,
# editable-installed or on PYTHONPATH; absent from a wheel).
RECIPE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def recipe_names() -> list[str]:
    """The recipe names available in the repository's configs/ folder (empty outside a clone)."""
    if not os.path.isdir(RECIPE_DIR):
        return []
    return sorted(f[:-3] for f in os.listdir(RECIPE_DIR) if f.endswith(".py") and not f.startswith("_"))


def recipe_path(spec: str) -> str:
    """The recipe file behind `spec`: a path to a `.py` file, or a name such as "smollm2" (configs/smollm2.py)."""
    if os.path.exists(spec) or os.sep in spec or spec.endswith(".py"):
        if not os.path.isfile(spec):
            raise InputError(f"recipe file {spec!r} does not exist")
        if not spec.endswith(".py"):
            raise InputError(f"{spec!r} is not a recipe file (a .py file with get_config())")
        return spec
    names = recipe_names()
    if not names:
        raise InputError(
            f"recipe name {spec!r} needs the repository's configs/ folder, which is not at {RECIPE_DIR}; "
            "pass the path of a recipe file instead"
        )
    if spec not in names:
        raise InputError(f"unknown recipe {spec!r}; choose from {', '.join(names)} or pass a recipe file path")
    return os.path.join(RECIPE_DIR, f"{spec}.py")


def load_config(spec: str) -> ml_collections.ConfigDict:
    """Run a recipe's `get_config()`; `spec` is a recipe file path or a recipe name from the repository's
    configs/ (see `recipe_path`)."""
    path = recipe_path(spec)
    module_spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except SyntaxError as e:
        raise InputError(f"{path}:{e.lineno}: {e.msg}") from None
    if not callable(getattr(module, "get_config", None)):
        raise InputError(f"config file {path!r} has no get_config()")
    config = module.get_config()
    if not isinstance(config, ml_collections.ConfigDict) or not {"target", "drafter"} <= set(config.keys()):
        raise InputError(f"{path}: get_config() did not return a recipe (a ConfigDict with target and drafter)")
    return config
