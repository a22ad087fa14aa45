"""Drafter checkpoints: the drafter config, its weights and the draft vocabulary, in one directory.

    DIR/hspec_drafter.json   {"format": "hspec-jax-drafter", "config": <drafter config as JSON>}
    DIR/model.safetensors    the drafter's param dict, one tensor per leaf named by its dotted path
                             (e.g. `layers_0.ssm.A_log`), in the dtype chosen at save time (bf16 to ship)
    DIR/vocab.npz            d2t [Vd] (target id of each draft id) and t2d [V]

A drafter's `lm_head` is (frozen) the target's lm_head rows of the draft tokens. Saved with those rows at hand,
a checkpoint whose `lm_head` equals them (in the stored dtype) leaves it out and says so in the manifest
(`"from_target": ["lm_head"]`); restoring it then needs the target's params, from which the rows are taken again.
For SmolLM2 that is 9.4 M of the H-Spec drafter's 33.4 M parameters.

Restoring rebuilds the config, checks every stored tensor against the config's shapes (strict: none missing,
none unknown), casts to the config's parameter dtype, and `check_target` tells a mismatched target/drafter
pair apart with a clear error. A drafter shipped with the package is found by its short name (`TRAINED`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import zipfile

import jax
import numpy as np
from flax import traverse_util

from hspec_jax.checkpoints.hf import (
    SAFETENSORS,
    SAFETENSORS_INDEX,
    CheckpointError,
    check_finite,
    read_state_dict,
    staged_directory,
    target_config_from_hf,
    write_state_dict,
)
from hspec_jax.checkpoints.orbax_io import read_manifest
from hspec_jax.drafters.api import drafter_param_shapes
from hspec_jax.drafters.config import DrafterConfig, check_target
from hspec_jax.drafters.family import drafter_family, family_of
from hspec_jax.drafters.vocab import DraftVocab, draft_rows, vocab_from_ids
from hspec_jax.models.config import TargetConfig
from hspec_jax.models.decoder import lm_head_matrix

MANIFEST = "hspec_drafter.json"
VOCAB = "vocab.npz"
TRAINING_RECORD = "training.json"  # beside a training run's export: the step, the recipe, the data, the metrics
FORMAT = "hspec-jax-drafter"


def config_to_dict(config: DrafterConfig) -> dict:
    family = family_of(config)
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    fields["target"] = config.target.to_hf()
    for key in family.nested:
        if fields[key] is not None:
            fields[key] = dataclasses.asdict(fields[key])
    for key in ("dtype", "param_dtype"):
        fields[key] = None if fields[key] is None else str(np.dtype(fields[key]))
    return {"family": family.name, "fields": fields}


def config_from_dict(data: dict, target: TargetConfig | None = None, source: str = "drafter config") -> DrafterConfig:
    """The drafter config saved by `config_to_dict`; a bad value is an error naming `source`."""
    try:
        family = drafter_family(data.get("family"))
    except ValueError as e:
        raise CheckpointError(f"{source}: {e}") from None
    if not isinstance(data.get("fields"), dict) or not isinstance(data["fields"].get("target"), dict):
        raise CheckpointError(f"{source}: no drafter fields")
    fields = dict(data["fields"])
    fields["target"] = target or target_config_from_hf(fields["target"], source)
    known = {f.name for f in dataclasses.fields(family.config)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise CheckpointError(f"{source}: unknown drafter config field {unknown[0]!r}")
    try:
        for key, nested in family.nested.items():
            if fields.get(key) is not None:
                fields[key] = nested(**fields[key])
        return family.config(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{source}: {e}") from None


# Drafters shipped inside the package (hspec_jax/trained/<name>/), loadable by name wherever a path is.
TRAINED_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "trained")


def trained_drafters() -> list[str]:
    """Short names of the drafters shipped with the package."""
    if not os.path.isdir(TRAINED_DIR):
        return []
    return sorted(d for d in os.listdir(TRAINED_DIR) if os.path.isfile(os.path.join(TRAINED_DIR, d, MANIFEST)))


def resolve_drafter(spec: str) -> str:
    """The directory behind a drafter spec: a shipped drafter's short name (e.g. `smollm2-hspec`) or a path."""
    if os.path.sep not in spec and spec in trained_drafters():
        return os.path.join(TRAINED_DIR, spec)
    return spec


def save_drafter(
    directory: str, params: dict, config: DrafterConfig, vocab: DraftVocab, dtype=None, target_rows=None
) -> None:
    """Write a drafter checkpoint; `dtype` (e.g. bfloat16) stores the weights in that dtype (default: as is).
    `target_rows`: the target's lm_head rows of the draft tokens (`target_lm_head`); an `lm_head` equal to them in
    the stored dtype is left out (module docstring)."""
    flat = traverse_util.flatten_dict(jax.device_get(params), sep=".")
    state = {k: np.asarray(v if dtype is None else np.asarray(v).astype(dtype)) for k, v in flat.items()}
    from_target = []
    if target_rows is not None:
        rows = np.asarray(jax.device_get(target_rows)).astype(state["lm_head"].dtype)
        if np.array_equal(rows, state["lm_head"]):
            from_target.append("lm_head")
            del state["lm_head"]
    manifest = {"format": FORMAT, "config": config_to_dict(config)}
    if from_target:
        manifest["from_target"] = from_target
    with staged_directory(directory) as staging:
        write_state_dict(state, staging)
        np.savez(os.path.join(staging, VOCAB), d2t=np.asarray(vocab.d2t), t2d=np.asarray(vocab.t2d))
        with open(os.path.join(staging, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=2)


def target_lm_head(target_params: dict, config: DrafterConfig, vocab: DraftVocab) -> jax.Array:
    """The drafter's frozen lm_head `[Vd, D]`: the target's lm_head rows of the draft tokens."""
    return draft_rows(lm_head_matrix(target_params, config.target), vocab)


def read_drafter_manifest(directory: str) -> dict:
    """The manifest of a drafter checkpoint directory, after checking that its weights and vocabulary are there."""
    manifest = read_manifest(directory, MANIFEST, FORMAT, "an hspec-jax drafter checkpoint")
    if not any(os.path.isfile(os.path.join(directory, f)) for f in (SAFETENSORS, SAFETENSORS_INDEX)):
        raise CheckpointError(f"drafter checkpoint {directory!r} has no {SAFETENSORS}")
    if not os.path.isfile(os.path.join(directory, VOCAB)):
        raise CheckpointError(f"drafter checkpoint {directory!r} has no {VOCAB}")
    return manifest


def read_drafter_config(spec: str) -> DrafterConfig:
    """The config of a drafter checkpoint (directory or shipped name), read without its weights (cheap: for
    checks before loading)."""
    directory = resolve_drafter(spec)
    return config_from_dict(read_drafter_manifest(directory)["config"], source=os.path.join(directory, MANIFEST))


def read_drafter_meta(spec: str, target: TargetConfig | None = None) -> tuple[DrafterConfig, DraftVocab, list[str]]:
    """(config, vocab, parameters taken from the target) of a drafter directory or shipped name, its weights not
    read. With `target`, the config is checked against and rebuilt for that (already loaded) target."""
    directory = os.path.abspath(resolve_drafter(spec))
    manifest = read_drafter_manifest(directory)
    config = config_from_dict(manifest["config"], source=os.path.join(directory, MANIFEST))
    if target is not None:
        try:
            check_target(config, target)
        except ValueError as e:
            raise CheckpointError(f"{directory}: {e}") from None
        config = config.replace(target=target)
    from_target = manifest.get("from_target", [])
    if set(from_target) - {"lm_head"}:
        raise CheckpointError(f"{directory}: unknown from_target entries {sorted(set(from_target) - {'lm_head'})}")
    return config, read_vocab(os.path.join(directory, VOCAB), config), from_target


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


def restore_params(directory: str, expected: dict, given: dict | None = None) -> dict:
    """The param dict stored in the safetensors of `directory` (one file or shards), checked leaf by leaf
    against `expected` (shapes and dtypes from `jax.eval_shape`) and cast to its dtypes; errors name the first
    missing, unknown or misshapen parameter. `given` (flat dotted names) supplies leaves not stored."""
    stored = read_state_dict(directory)
    given = given or {}
    want = traverse_util.flatten_dict(expected, sep=".")
    for key in sorted(want.keys() | stored.keys() | given.keys()):
        if key in given and key in stored:
            raise CheckpointError(
                f"checkpoint {directory!r} stores {key}, which its manifest says comes from the target"
            )
        if key not in stored and key not in given:
            raise CheckpointError(f"checkpoint {directory!r} is missing parameter {key}")
        if key not in want:
            raise CheckpointError(f"unknown parameter {key} in checkpoint {directory!r}")
        found = stored[key].shape if key in stored else tuple(given[key].shape)
        if tuple(want[key].shape) != found:
            raise CheckpointError(f"parameter {key} has shape {found}, expected {tuple(want[key].shape)}")
    flat = {k: jax.numpy.asarray((stored[k] if k in stored else given[k]).astype(want[k].dtype)) for k in want}
    return traverse_util.unflatten_dict(flat, sep=".")


def restore_drafter(
    spec: str, target: TargetConfig | None = None, target_params: dict | None = None
) -> tuple[DrafterConfig, dict, DraftVocab]:
    """(config, params, vocab) of a drafter directory or shipped drafter name. With `target`, the config is
    rebuilt for that (already loaded) target. A checkpoint that leaves its lm_head to the target (module
    docstring) needs `target_params`."""
    directory = os.path.abspath(resolve_drafter(spec))
    config, vocab, from_target = read_drafter_meta(directory, target)
    given = {}
    if from_target:
        if target_params is None:
            raise CheckpointError(
                f"{directory}: this drafter's lm_head is the target's rows (not stored): load it with the target's "
                "weights"
            )
        given["lm_head"] = target_lm_head(target_params, config, vocab)
    expected = drafter_param_shapes(config)
    params = restore_params(directory, expected, given)
    check_finite(params, directory)
    return config, params, vocab
