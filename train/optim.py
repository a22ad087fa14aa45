"""The optimiser: AdamW (the paper) or Muon on 2-D weights + AdamW on the rest (the authors' code default),
with linear warmup and cosine decay to 0, global-norm clipping, masked to the trainable parameters.

Frozen parameters (the draft lm_head, the q/k norms copied from the target; `drafters/params.py`) get
`optax.set_to_zero` and therefore no optimiser state at all. The moments take the parameters' dtype: train
with fp32 parameters (`train/loop.py` does, whatever the compute dtype) so they are fp32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from hspec_jax.drafters.config import DrafterConfig
from hspec_jax.drafters.params import trainable_mask

OPTIMIZERS = ("adamw", "muon")


def learning_rate_schedule(peak: float, num_steps: int, warmup_fraction: float) -> optax.Schedule:
    """Linear warmup over `warmup_fraction` of the steps (at least one), then half a cosine down to 0."""
    warmup = max(1, round(warmup_fraction * num_steps))
    return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, max(num_steps, warmup + 1), end_value=0.0)


def muon_dimensions(params):
    """Muon's matrices: every 2-D weight except the depthwise conv kernels (`[K, C]`: independent channels,
    3-D in PyTorch), which go to AdamW as in the reference; None = AdamW."""

    def spec(key_path, x):
        names = [str(getattr(k, "key", k)) for k in key_path]
        return optax.contrib.MuonDimensionNumbers() if x.ndim == 2 and "conv1d" not in names else None

    return jax.tree_util.tree_map_with_path(spec, params)


def make_optimizer(train, params: dict, drafter: DrafterConfig):
    """(optimizer, schedule) from the recipe's `train` section (`optimizer`, `learning_rate`, `num_steps`,
    `warmup_fraction`, `weight_decay`, `muon_lr_multiplier`, `muon_weight_decay`, `clip_norm`, `b1`, `b2`)."""
    if train.optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {train.optimizer!r}; choose from {OPTIMIZERS}")
    schedule = learning_rate_schedule(train.learning_rate, train.num_steps, train.warmup_fraction)
    if train.optimizer == "adamw":
        inner = optax.adamw(schedule, train.b1, train.b2, weight_decay=train.weight_decay, mu_dtype=jnp.float32)
    else:
        # Muon on every 2-D weight, at `muon_lr_multiplier` x the learning rate with updates scaled to AdamW's
        # RMS (0.2 sqrt(max(fan_in, fan_out)), PyTorch's `match_rms_adamw`); AdamW on the rest.
        inner = optax.contrib.muon(
            lambda step: train.muon_lr_multiplier * schedule(step),
            weight_decay=train.muon_weight_decay,
            mu_dtype=jnp.float32,
            adam_b1=train.b1,
            adam_b2=train.b2,
            adam_weight_decay=train.weight_decay,
            adam_learning_rate=schedule,
            consistent_rms=0.2,
            muon_weight_dimension_numbers=muon_dimensions,
        )
    labels = jax.tree.map(lambda trainable: "train" if trainable else "frozen", trainable_mask(params, drafter))
    partition = optax.multi_transform({"train": inner, "frozen": optax.set_to_zero()}, labels)
    return optax.chain(optax.clip_by_global_norm(train.clip_norm), partition), schedule
