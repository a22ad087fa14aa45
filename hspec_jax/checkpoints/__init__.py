"""Checkpoint import/export: HF safetensors / PyTorch, GGUF, Orbax, and target-spec resolution."""

from hspec_jax.checkpoints.hf import CheckpointError, export_hf_target, load_hf_target
from hspec_jax.checkpoints.orbax_io import restore_target, save_target
from hspec_jax.checkpoints.sources import load_target, load_tokenizer, read_target_config, resolve

__all__ = [
    "CheckpointError",
    "export_hf_target",
    "load_hf_target",
    "load_target",
    "load_tokenizer",
    "read_target_config",
    "resolve",
    "restore_target",
    "save_target",
]
