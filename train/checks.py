"""What `train.main` checks before any work: the recipe's values, the target, the data sources, the mesh, the work
directory, and (on resume) the recipe the work directory was created with.

Each check reads at most small files (the target's config, the work directory's `recipe.json`) and raises an
`InputError` whose one line names the field (`--config.train.batch_size`), file or directory at fault.
"""

from __future__ import annotations

import json
import os

import ml_collections

from hspec_jax.checkpoints.drafter_io import TRAINING_RECORD
from hspec_jax.cli import check_output_dir
from hspec_jax.errors import InputError
from hspec_jax.models import TargetConfig
from hspec_jax.recipes import data_section, drafter_from_recipe
from train.data import FILE_FORMATS, parse_sources
from train.optim import OPTIMIZERS

# Integer fields and the least value each may take.
INT_BOUNDS = {
    "train.num_steps": 1,
    "train.batch_size": 1,
    "train.log_every": 1,
    "train.checkpoint_every": 1,
    "train.keep_checkpoints": 1,
    "train.anchors_per_chunk": 1,
    "train.eval_every": 0,
    "train.eval_max_new_tokens": 1,
    "train.seed": 0,
    "data.seq_len": 1,
    "data.max_anchors": 1,
    "data.seed": 0,
    "data.held_out_prompts": 0,
    "data.held_out_batches": 1,
    "data.held_out_family_batches": 0,
    "data.vocab_sample_tokens": 0,
}
RECIPE_FILE = "recipe.json"
# What a resumed run must share with the run that created its work directory: the checkpoint's shapes, the draft
# vocabulary, the target and the data stream. The rest (steps, learning rate, logging) may change on resume.
RESUME_PREFIXES = ("target.", "drafter.", "data.", "train.batch_size", "train.optimizer")
RESUME_FREE = (
    "target.name",
    "drafter.attention_impl",
    "data.vocab_sample_tokens",
    "data.held_out_batches",
    "data.held_out_family_batches",
)


def field(config: ml_collections.ConfigDict, name: str):
    section, key = name.split(".")
    return config[section][key]


def check_numbers(config: ml_collections.ConfigDict) -> None:
    """Integer fields within their bounds, a positive learning rate, a warm-up fraction in [0, 1], a known
    optimiser."""
    for name, least in INT_BOUNDS.items():
        value = field(config, name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise InputError(f"--config.{name} must be an integer, got {value!r}")
        if value < least:
            raise InputError(f"--config.{name} must be at least {least}, got {value}")
    train = config.train
    if not train.learning_rate > 0:
        raise InputError(f"--config.train.learning_rate must be positive, got {train.learning_rate}")
    if not 0 <= train.warmup_fraction <= 1:
        raise InputError(f"--config.train.warmup_fraction must be in [0, 1], got {train.warmup_fraction}")
    if train.optimizer not in OPTIMIZERS:
        raise InputError(
            f"--config.train.optimizer {train.optimizer!r} is unknown; choose from {', '.join(OPTIMIZERS)}"
        )


def target_config(spec: str) -> TargetConfig:
    """The target's config without its weights (`tiny`: the random tiny target of configs/tiny.py)."""
    if not spec:
        raise InputError("set the target to train against: --config.target.path=smollm2|tiny|HF dir|.gguf|Orbax dir")
    if spec == "tiny":
        from configs.tiny import HF_CONFIG

        return TargetConfig.from_hf(dict(HF_CONFIG))
    from hspec_jax.checkpoints import read_target_config

    return read_target_config(spec)


def check_sources(spec: str, flag: str = "--config.data.sources") -> None:
    """The source spec (given as `flag`) parses and every local file exists (read later, once)."""
    try:
        sources = parse_sources(spec)
    except ValueError as e:
        raise InputError(f"{flag}: {e}") from None
    for source in sources:
        local = source.location != "sharegpt" and not source.location.startswith("hf:")
        if local and not os.path.isfile(source.location):
            raise InputError(f"{flag}: data source file {source.location!r} does not exist")


def check_held_out(path: str) -> None:
    """The held-out set, when given, is an existing local conversations file (read later, once)."""
    if not path:
        return
    if os.path.splitext(path)[1].lower() not in FILE_FORMATS:
        raise InputError(f"--config.data.held_out {path!r} is not a {'/'.join(FILE_FORMATS)} file of conversations")
    if not os.path.isfile(path):
        raise InputError(f"--config.data.held_out: file {path!r} does not exist")


def check_recipe(config: ml_collections.ConfigDict, workdir: str) -> TargetConfig:
    """Every check that needs neither weights nor data; returns the target's config."""
    check_numbers(config)
    check_output_dir(workdir, "--workdir")
    check_sources(config.data.sources)
    check_held_out(config.data.held_out)
    target = target_config(config.target.path)
    drafter = drafter_from_recipe(config, target=target)
    block = drafter.num_drafts + 1
    if config.data.seq_len <= block + 1:
        raise InputError(
            f"--config.data.seq_len must exceed the block size + 1 = {block + 1}, got {config.data.seq_len}"
        )
    check_resume(config, workdir)
    return target


def flat_recipe(recipe: dict) -> dict:
    """{"section.field": value} of a recipe dict, values in their JSON form (tuples as lists), nested dicts
    (`target.hf_config`, `drafter.mamba`) flattened with dots."""
    out = {}
    for key, value in recipe.items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in flat_recipe(value).items()})
        else:
            out[key] = json.loads(json.dumps(value, default=str))
    return out


def resume_fields(recipe: dict) -> dict:
    """The fields of a (flattened) recipe a resumed run must share with the run that created the work directory."""
    return {
        k: v for k, v in flat_recipe(recipe).items() if k.startswith(RESUME_PREFIXES) and not k.startswith(RESUME_FREE)
    }


def recipe_differences(recorded: dict, requested: dict) -> list[str]:
    """`field: recorded (requested: value)` for each resume field that differs, sorted by field. A data field the
    recorded recipe lacks (its work directory is older than the field) is taken at its default, `data_section`'s."""
    old = {**resume_fields({"data": data_section().to_dict()}), **resume_fields(recorded)}
    new = resume_fields(requested)
    return [
        f"{k}={old.get(k, '<unset>')!r} (requested {new.get(k, '<unset>')!r})"
        for k in sorted(set(old) | set(new))
        if old.get(k) != new.get(k)
    ]


def read_recorded_recipe(workdir: str) -> dict | None:
    """The recipe `workdir/recipe.json` holds (a work directory from before that file: the recipe its exported
    drafter's `training.json` records), None for a new work directory."""
    path = os.path.join(workdir, RECIPE_FILE)
    exported = os.path.join(workdir, "drafter", TRAINING_RECORD)
    if not os.path.exists(path) and os.path.exists(exported):
        path = exported
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            recorded = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{path} is damaged ({e}); restore it or use a new --workdir") from None
    if path == exported and isinstance(recorded, dict):
        recorded = recorded.get("recipe")
    if not isinstance(recorded, dict):
        raise InputError(f"{path} does not hold a recipe; restore it or use a new --workdir")
    return recorded


def check_resume(config: ml_collections.ConfigDict, workdir: str) -> None:
    """A work directory created with another recipe is refused, naming the fields that differ."""
    recorded = read_recorded_recipe(workdir)
    if recorded is None:
        return
    differ = recipe_differences(recorded, config.to_dict())
    if differ:
        raise InputError(
            f"work directory {workdir} was created with another recipe: {'; '.join(differ)}. "
            "Resume with the recorded values or use a new --workdir"
        )


def record_recipe(config: ml_collections.ConfigDict, workdir: str) -> None:
    """Write `workdir/recipe.json` (the recipe as run) if it is not there yet; complete or not at all."""
    path = os.path.join(workdir, RECIPE_FILE)
    if os.path.exists(path):
        return
    partial = path + ".partial"
    with open(partial, "w") as f:
        json.dump(config.to_dict(), f, indent=2, default=str)
    os.replace(partial, path)
