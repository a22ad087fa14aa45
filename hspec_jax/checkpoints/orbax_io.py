"""Orbax save/restore of converted target parameters, with the config and tokenizer beside them.

A converted target is a directory:

    DIR/hspec_target.json   {"format": "hspec-jax-target", "config": <HF-style config dict>}
    DIR/params/             Orbax (StandardCheckpointer) pytree of the nested param dict
    DIR/tokenizer/          the tokenizer and chat template (`save_pretrained`), when one was given

Restoring checks the stored tree against the config's expected shapes and dtypes (strict). A target saved
before the decoder layers were stacked (`layers_0`, `layers_1`, ... trees) is restored layer by layer and
stacked on load, with the same checks.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os

import jax

from hspec_jax.checkpoints.hf import CheckpointError, check_finite, read_json, staged_directory, target_config_from_hf
from hspec_jax.models.config import TargetConfig
from hspec_jax.models.decoder import param_shapes, per_layer_names, stack_layers

MANIFEST = "hspec_target.json"
FORMAT = "hspec-jax-target"


def orbax():
    """`orbax.checkpoint`, imported on first use: ~0.4 s of every process start that reads and writes no Orbax
    file (a GGUF or HF target with a safetensors drafter)."""
    import orbax.checkpoint as ocp

    return ocp


def is_orbax_target(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST))


def save_target(directory: str, params: dict, config: TargetConfig, tokenizer=None) -> None:
    """Write params (Orbax), config and optionally the tokenizer; the directory appears only when complete."""
    with staged_directory(directory) as staging:
        save_pytree(os.path.join(staging, "params"), params)
        if tokenizer is not None:
            tokenizer.save_pretrained(os.path.join(staging, "tokenizer"))
        with open(os.path.join(staging, MANIFEST), "w") as f:
            json.dump({"format": FORMAT, "config": config.to_hf()}, f, indent=2)


def restore_target(directory: str, **config_overrides) -> tuple[TargetConfig, dict]:
    """(config, params) from a directory written by `save_target`."""
    directory = os.path.abspath(directory)
    config = orbax_target_config(directory, **config_overrides)
    expected, path = param_shapes(config), os.path.join(directory, "params")
    if os.path.isdir(path) and "layers_0" in orbax().StandardCheckpointer().metadata(path).item_metadata.tree:
        params = stack_layers(restore_pytree(path, per_layer_names(expected, config.num_layers)), config.num_layers)
    else:
        params = restore_pytree(path, expected)
    check_finite(params, directory)
    return config, params


def orbax_target_config(directory: str, **config_overrides) -> TargetConfig:
    """The target config stored in a converted target's manifest (weights in their stored dtype by default)."""
    hf = read_manifest(directory, MANIFEST, FORMAT, "a converted hspec-jax target")["config"]
    overrides = {"param_dtype": hf.get("torch_dtype"), **config_overrides}
    return target_config_from_hf(hf, os.path.join(directory, MANIFEST), **overrides)


def read_manifest(directory: str, filename: str, fmt: str, what: str) -> dict:
    """The JSON manifest of a checkpoint directory, checked to be of format `fmt`."""
    path = os.path.join(directory, filename)
    if not os.path.isfile(path):
        raise CheckpointError(f"{directory!r} is not {what} (no {filename})")
    manifest = read_json(path)
    if manifest.get("format") != fmt:
        raise CheckpointError(f"{path}: unknown format {manifest.get('format')!r}")
    if not isinstance(manifest.get("config"), dict):
        raise CheckpointError(f"{path}: no config")
    return manifest


def save_pytree(path: str, tree) -> None:
    """Write a pytree of host arrays. The calling process writes it alone (no barrier with other processes),
    so one process of a multi-process job can write a converted target by itself. A
    failing write (e.g. a full disk) is raised here with its cause, once Orbax's background threads have
    stopped; their own log of the same failure (hundreds of lines) is silenced."""
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.CRITICAL)
    me, ocp = jax.process_index(), orbax()
    only_me = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})
    checkpointer = ocp.StandardCheckpointer(multiprocessing_options=only_me)
    try:
        checkpointer.save(path, tree)
        checkpointer.wait_until_finished()
    except BaseException:
        with contextlib.suppress(Exception):  # the write's own error is the one to report
            checkpointer.close()
        raise
    finally:
        absl_logger.setLevel(level)


def restore_pytree(path: str, expected):
    """Restore an Orbax pytree after checking it holds exactly the leaves of `expected` (shapes from
    `jax.eval_shape`), with errors naming the first missing, unknown or misshapen parameter."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path!r}: the parameters are missing")
    ocp = orbax()
    stored = ocp.StandardCheckpointer().metadata(path).item_metadata.tree
    want = {jax.tree_util.keystr(k): tuple(v.shape) for k, v in jax.tree_util.tree_leaves_with_path(expected)}
    have = {jax.tree_util.keystr(k): tuple(v.shape) for k, v in jax.tree_util.tree_leaves_with_path(stored)}
    for key in sorted(want.keys() | have.keys()):
        if key not in have:
            raise CheckpointError(f"checkpoint {path!r} is missing parameter {key}")
        if key not in want:
            raise CheckpointError(f"unknown parameter {key} in checkpoint {path!r}")
        if want[key] != have[key]:
            raise CheckpointError(f"parameter {key} has shape {have[key]}, expected {want[key]}")
    return ocp.StandardCheckpointer().restore(path, expected)
