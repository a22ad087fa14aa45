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
import zipfile

import jax
import numpy as np

from hspec_jax.checkpoints.hf import CheckpointError, check_finite, staged_directory, target_config_from_hf
from hspec_jax.checkpoints.orbax_io import read_manifest, restore_pytree, save_pytree
from hspec_jax.drafters.api import init_drafter
from hspec_jax.drafters.config import FAMILIES, DrafterConfig, check_target
from hspec_jax.drafters.mamba2 import MambaConfig
from hspec_jax.drafters.vocab import DraftVocab, vocab_from_ids
from hspec_jax.models.config import TargetConfig

MANIFEST = "hspec_drafter.json"
VOCAB = "vocab.npz"
FORMAT = "hspec-jax-drafter"


def config_to_dict(config: DrafterConfig) -> dict:
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    fields["target"] = config.target.to_hf()
    if fields.get("mamba") is not None:
        fields["mamba"] = dataclasses.asdict(fields["mamba"])
    for key in ("dtype", "param_dtype"):
        fields[key] = None if fields[key] is None else str(np.dtype(fields[key]))
    return {"family": config.family, "fields": fields}


def config_from_dict(data: dict, target: TargetConfig | None = None, source: str = "drafter config") -> DrafterConfig:
    """The drafter config saved by `config_to_dict`; a bad value is an error naming `source`."""
    family = FAMILIES.get(data.get("family"))
    if family is None:
        raise CheckpointError(f"{source}: unknown drafter family {data.get('family')!r}")
    if not isinstance(data.get("fields"), dict) or not isinstance(data["fields"].get("target"), dict):
        raise CheckpointError(f"{source}: no drafter fields")
    fields = dict(data["fields"])
    fields["target"] = target or target_config_from_hf(fields["target"], source)
    known = {f.name for f in dataclasses.fields(family)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise CheckpointError(f"{source}: unknown drafter config field {unknown[0]!r}")
    try:
        if fields.get("mamba") is not None:
            fields["mamba"] = MambaConfig(**fields["mamba"])
        return family(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{source}: {e}") from None


def save_drafter(directory: str, params: dict, config: DrafterConfig, vocab: DraftVocab) -> None:
    with staged_directory(directory) as staging:
        save_pytree(os.path.join(staging, "params"), params)
        np.savez(os.path.join(staging, VOCAB), d2t=np.asarray(vocab.d2t), t2d=np.asarray(vocab.t2d))
        with open(os.path.join(staging, MANIFEST), "w") as f:
            json.dump({"format": FORMAT, "config": config_to_dict(config)}, f, indent=2)


def read_drafter_config(directory: str) -> DrafterConfig:
    """The config of a drafter checkpoint, read without its weights (cheap: for checks before loading)."""
    manifest = read_manifest(directory, MANIFEST, FORMAT, "an hspec-jax drafter checkpoint")
    for part in ("params", VOCAB):
        if not os.path.exists(os.path.join(directory, part)):
            raise CheckpointError(f"drafter checkpoint {directory!r} has no {part}")
    return config_from_dict(manifest["config"], source=os.path.join(directory, MANIFEST))


def read_vocab(path: str, config: DrafterConfig) -> DraftVocab:
    """The draft vocabulary saved beside a drafter; a corrupted or inconsistent file is an error naming it."""
    try:
        with np.load(path) as data:
            d2t, t2d = data["d2t"], data["t2d"]
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
        raise CheckpointError(f"{path}: not a readable draft vocabulary ({e})") from None
    want = (config.vocab_size,), (config.target.vocab_size,)
    if (d2t.shape, t2d.shape) != want:
        raise CheckpointError(f"{path}: d2t {d2t.shape} and t2d {t2d.shape}, expected {want[0]} and {want[1]}")
    try:
        vocab = vocab_from_ids(d2t, len(t2d))
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None
    if not np.array_equal(np.asarray(vocab.t2d), t2d):
        raise CheckpointError(f"{path}: d2t and t2d disagree")
    return vocab


def restore_drafter(directory: str, target: TargetConfig | None = None) -> tuple[DrafterConfig, dict, DraftVocab]:
    """(config, params, vocab). With `target`, the config is rebuilt for that (already loaded) target."""
    directory = os.path.abspath(directory)
    config = read_drafter_config(directory)
    if target is not None:
        try:
            check_target(config, target)
        except ValueError as e:
            raise CheckpointError(f"{directory}: {e}") from None
        config = config.replace(target=target)
    vocab = read_vocab(os.path.join(directory, VOCAB), config)
    expected = jax.eval_shape(lambda: init_drafter(config, jax.random.key(0)))
    params = restore_pytree(os.path.join(directory, "params"), expected)
    check_finite(params, directory)
    return config, params, vocab
