"""A drafter named the way the command lines take it: a checkpoint directory, the short name of a drafter shipped
with the package (`hspec_jax/trained/README.md`), or `random:<kind>`, a randomly initialised drafter of that kind
built from a recipe (useful for lossless checks and quick runs)."""

from __future__ import annotations

import os

import jax
import numpy as np

from hspec_jax.checkpoints.drafter_io import read_drafter_config, resolve_drafter, restore_drafter, trained_drafters
from hspec_jax.drafters import DRAFTER_KINDS, init_drafter, init_from_target
from hspec_jax.drafters.config import check_target
from hspec_jax.drafters.vocab import build_draft_vocab
from hspec_jax.errors import InputError
from hspec_jax.recipes import drafter_from_recipe, load_config

RANDOM = "random:"
# The recipe a random drafter follows for a target named by its short name.
DEFAULT_RECIPES = {"smollm2": "smollm2"}


def check_drafter_spec(spec: str, target_spec: str, recipe: str | None) -> None:
    """Every check of a `--drafter` (with the `--target` and `--recipe` it comes with) that needs no weights: a
    random drafter's kind and recipe, a shipped name or a checkpoint directory with a readable config; an
    `InputError` naming what is wrong otherwise."""
    if recipe is not None and not spec.startswith(RANDOM):
        raise InputError("--recipe builds random:<kind> drafters: it needs --drafter random:<kind>")
    if spec.startswith(RANDOM):
        kind = spec.removeprefix(RANDOM)
        if kind not in DRAFTER_KINDS:
            raise InputError(f"unknown drafter kind {kind!r}; choose from {', '.join(DRAFTER_KINDS)}")
        if recipe is None and target_spec not in DEFAULT_RECIPES and not target_spec.startswith(RANDOM):
            raise InputError("a random drafter for this target needs --recipe <name or configs/<name>.py>")
        load_config(recipe or DEFAULT_RECIPES.get(target_spec) or target_spec.removeprefix(RANDOM))
        return
    if not os.path.isdir(resolve_drafter(spec)):
        raise InputError(
            f"drafter {spec!r} is neither random:<kind>, a shipped drafter "
            f"({', '.join(trained_drafters()) or 'none installed'}) nor a checkpoint directory"
        )
    read_drafter_config(spec)


def drafter_config(spec: str, target, recipe: str | None = None):
    """The config (no weights) of drafter `spec` for `target` (a TargetConfig), drafting its own k tokens per step
    (`policy.drafting` sets another k or the adaptive policy). `recipe` (a name or a configs/<name>.py file) builds
    `random:<kind>` drafters."""
    if spec.startswith(RANDOM):
        if recipe is None:
            raise InputError(f"a random drafter ({spec}) for this target needs a recipe")
        config = drafter_from_recipe(load_config(recipe), spec.removeprefix(RANDOM), target)
    else:
        config = read_drafter_config(spec)
    try:
        check_target(config, target)
        config = config.replace(target=target)
        return config
    except ValueError as e:
        raise InputError(f"--drafter {spec}: {e}") from None


def load_drafter(spec: str, config, target_params: dict, prompt_ids: list[list[int]]) -> tuple[dict, object]:
    """(params, draft vocabulary) of drafter `spec` whose config `drafter_config` built. A random drafter's draft
    vocabulary is the prompts' tokens, then the lowest ids."""
    if spec.startswith(RANDOM):
        target = config.target
        stream = np.concatenate(prompt_ids)
        vocab = build_draft_vocab(stream, target.vocab_size, config.vocab_size, always=target.eos_token_ids)
        return init_from_target(init_drafter(config, jax.random.key(0)), config, target_params, vocab), vocab
    _, params, vocab = restore_drafter(spec, config.target, target_params)
    return params, vocab
