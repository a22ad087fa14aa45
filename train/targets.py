"""The target and its tokenizer for the data tools: any `load_target` spec, or `tiny` (the random target of
configs/tiny.py with the character tokenizer, for offline tests and quick runs)."""

from __future__ import annotations

import jax

from hspec_jax.checkpoints import load_target, load_tokenizer
from hspec_jax.models.config import TargetConfig
from hspec_jax.models.decoder import init_params
from train.tokenizers import char_tokenizer


def random_target(hf_config: dict, seed: int = 0) -> tuple[TargetConfig, dict]:
    """(config, randomly initialised params) for an architecture given by its HF config values."""
    config = TargetConfig.from_hf(dict(hf_config))
    return config, init_params(config, jax.random.key(seed))


def load_target_and_tokenizer(spec: str):
    """(target config, params, tokenizer) of a target spec: `tiny`, `smollm2`, an HF dir, a .gguf or an Orbax dir."""
    if spec == "tiny":
        from configs.tiny import HF_CONFIG

        config, params = random_target(HF_CONFIG)
        return config, params, char_tokenizer(config.vocab_size)
    config, params = load_target(spec)
    return config, params, load_tokenizer(spec)
