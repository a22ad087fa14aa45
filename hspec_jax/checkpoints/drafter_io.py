"""Drafter checkpoints: Orbax params, the drafter config and the draft vocabulary, in one directory.

    DIR/hspec_drafter.json   {"format": "hspec-jax-drafter", "config": <drafter config as JSON>}
    DIR/params/              Orbax pytree of the drafter's param dict
    DIR/vocab.npz            d2t [Vd] (target id of each draft id) and t2d [V]

Restoring rebuilds the config, checks every stored parameter against the config's shapes (strict), and
`check_target` tells a mismatched target/drafter pair apart with a clear error.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np

from hspec_jax.checkpoints.hf import CheckpointError, staged_directory
from hspec_jax.checkpoints.orbax_io import read_manifest, restore_pytree, save_pytree
from hspec_jax.drafters.api import init_drafter
from hspec_jax.drafters.config import FAMILIES, DrafterConfig, check_target
from hspec_jax.drafters.mamba2 import MambaConfig
from hspec_jax.drafters.vocab import DraftVocab, vocab_from_ids
from hspec_jax.models.config import TargetConfig

MANIFEST = "hspec_drafter.json"
FORMAT = "hspec-jax-drafter"


def config_to_dict(config: DrafterConfig) -> dict:
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    fields["target"] = config.target.to_hf()
    if fields.get("mamba") is not None:
        fields["mamba"] = dataclasses.asdict(fields["mamba"])
    for key in ("dtype", "param_dtype"):
        fields[key] = None if fields[key] is None else str(np.dtype(fields[key]))
    return {"family": config.family, "fields": fields}


def config_from_dict(data: dict, target: TargetConfig | None = None) -> DrafterConfig:
    family = FAMILIES.get(data.get("family"))
    if family is None:
        raise CheckpointError(f"unknown drafter family {data.get('family')!r}")
    fields = dict(data["fields"])
    fields["target"] = target or TargetConfig.from_hf(fields["target"])
    if fields.get("mamba") is not None:
        fields["mamba"] = MambaConfig(**fields["mamba"])
    known = {f.name for f in dataclasses.fields(family)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise CheckpointError(f"unknown drafter config field {unknown[0]!r}")
    return family(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})


def save_drafter(directory: str, params: dict, config: DrafterConfig, vocab: DraftVocab) -> None:
    with staged_directory(directory) as staging:
        save_pytree(os.path.join(staging, "params"), params)
        np.savez(os.path.join(staging, "vocab.npz"), d2t=np.asarray(vocab.d2t), t2d=np.asarray(vocab.t2d))
        with open(os.path.join(staging, MANIFEST), "w") as f:
            json.dump({"format": FORMAT, "config": config_to_dict(config)}, f, indent=2)


def restore_drafter(directory: str, target: TargetConfig | None = None) -> tuple[DrafterConfig, dict, DraftVocab]:
    """(config, params, vocab). With `target`, the config is rebuilt for that (already loaded) target."""
    directory = os.path.abspath(directory)
    config = config_from_dict(read_manifest(directory, MANIFEST, FORMAT, "an hspec-jax drafter checkpoint")["config"])
    if target is not None:
        check_target(config, target)
        config = config.replace(target=target)
    expected = jax.eval_shape(lambda: init_drafter(config, jax.random.key(0)))
    params = restore_pytree(os.path.join(directory, "params"), expected)
    with np.load(os.path.join(directory, "vocab.npz")) as data:
        vocab = vocab_from_ids(data["d2t"], len(data["t2d"]))
        if not np.array_equal(np.asarray(vocab.t2d), data["t2d"]):
            raise CheckpointError("vocab.npz: d2t and t2d disagree")
    return config, params, vocab
