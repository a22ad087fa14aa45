"""A target named the way the command lines take it: the embedded `smollm2`, an HF directory, a .gguf file, an
Orbax target, or `random:<recipe>` (e.g. random:tiny): a randomly initialised target of `configs/<recipe>.py`, with
weights scaled up so greedy choices are far from ties, whose prompts are the SmolLM2 tokenizer's ids taken modulo its
vocabulary (`hspec_jax.chat.ChatEncoder`). A random target exercises the whole pipeline in seconds; its numbers say
nothing about real drafters."""

from __future__ import annotations

from typing import NamedTuple

import jax

from hspec_jax.chat import ChatEncoder
from hspec_jax.checkpoints import load_target, load_tokenizer, read_target_config
from hspec_jax.decoding.engine import stop_ids
from hspec_jax.drafter_spec import DEFAULT_RECIPES
from hspec_jax.models import init_params
from hspec_jax.recipes import load_config, recipe_path, target_config

RANDOM = "random:"
RANDOM_TARGET_SCALE = 4.0  # random targets: 2-D weights x4, so greedy argmaxes are far from ties


class Target(NamedTuple):
    name: str
    config: object  # TargetConfig
    params: dict
    encoder: ChatEncoder  # its tokenizer, chat template and (random targets) the vocabulary fold
    eos_ids: tuple[int, ...]
    pad_id: int
    recipe: str | None  # recipe file for random:<kind> drafters


def read_target_spec_config(spec: str):
    """The TargetConfig of a target spec, without its weights (what checks before loading need)."""
    if spec.startswith(RANDOM):
        return target_config(load_config(spec.removeprefix(RANDOM)))
    return read_target_config(spec)


def load_encoder(spec: str) -> ChatEncoder:
    """The chat encoder of a target spec alone (its tokenizer, folded for a random target), without its weights."""
    if spec.startswith(RANDOM):
        return ChatEncoder(load_tokenizer("smollm2"), read_target_spec_config(spec).vocab_size)
    return ChatEncoder(load_tokenizer(spec))


def load_target_spec(spec: str, recipe: str | None, seed: int) -> Target:
    """The target, its chat encoder and stop ids, from a checkpoint spec or `random:<recipe>` (weights from
    `seed`); `recipe` builds random drafters (default: the random target's own recipe, or smollm2's for smollm2)."""
    tokenizer = load_tokenizer("smollm2" if spec.startswith(RANDOM) else spec)
    if spec.startswith(RANDOM):
        recipe = recipe or recipe_path(spec.removeprefix(RANDOM))
        config = target_config(load_config(recipe))
        params = init_params(config, jax.random.key(seed))
        params = jax.tree.map(lambda x: x * RANDOM_TARGET_SCALE if x.ndim == 2 else x, params)
        name = f"{spec} (random weights, SmolLM2 tokenizer ids modulo {config.vocab_size})"
        return Target(name, config, params, ChatEncoder(tokenizer, config.vocab_size), config.eos_token_ids, 0, recipe)
    config, params = load_target(spec)
    pad_id = config.pad_token_id if config.pad_token_id is not None else 0
    recipe = recipe or DEFAULT_RECIPES.get(spec)
    return Target(spec, config, params, ChatEncoder(tokenizer), stop_ids(config, tokenizer), pad_id, recipe)
