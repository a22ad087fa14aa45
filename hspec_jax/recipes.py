"""Recipes: the `ml_collections` configs of `configs/*.py` and their conversion to model configs.

A recipe `ConfigDict` has:
  target.name       the checkpoint it describes (documentation; nothing is downloaded)
  target.path       a local checkpoint (HF dir, .gguf, Orbax dir, or "smollm2"); "" = architecture only
  target.hf_config  the target's `config.json` values, so shapes and memory are known without weights
  drafter.*         the drafter recipe (`kind` selects H-Spec, DFlash, DSpark or an ablation)
"""

from __future__ import annotations

import ml_collections

from hspec_jax.drafters import PAPER_BLOCK_PATTERN, DrafterConfig, MambaConfig, drafter_config
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
    """The paper's recipe (DESIGN.md section 5) for one target."""
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
            "seed": 0,  # shuffling and anchor sampling
            "exclude_eval_prompts": True,  # drop conversations containing an evaluation prompt
            "held_out_prompts": 8,  # prompts kept out of training for the periodic real-tau check
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
    return TargetConfig.from_hf(c.target.hf_config.to_dict(), **overrides)


def drafter_from_recipe(
    c: ml_collections.ConfigDict,
    kind: str | None = None,
    target: TargetConfig | None = None,
) -> DrafterConfig:
    """The drafter config of `kind` (default: the recipe's `drafter.kind`) under this recipe."""
    fields = c.drafter.to_dict()
    kind = kind or fields.pop("kind")
    fields.pop("kind", None)
    fields["mamba"] = MambaConfig(**fields["mamba"])
    for key in ("fusion_layer_ids", "attn_kv_layer_ids", "block_pattern"):
        fields[key] = tuple(fields[key])
    return drafter_config(kind, target or target_config(c), **fields)


def load_config(path: str) -> ml_collections.ConfigDict:
    """Run a recipe file's `get_config()` (the same files `train.main --config=` reads)."""
    import importlib.util
    import os

    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file {path!r} does not exist")
    spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ValueError(f"config file {path!r} has no get_config()")
    return module.get_config()
