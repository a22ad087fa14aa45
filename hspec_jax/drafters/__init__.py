"""Drafters: H-Spec (Mamba-2 + target-KV attention hybrid), DFlash, DSpark, and the paper's variants."""

from hspec_jax.drafters.api import draft_block, draft_blocks, drafter_module, init_drafter, init_from_target
from hspec_jax.drafters.config import (
    DRAFTER_KINDS,
    PAPER_BLOCK_PATTERN,
    DFlashConfig,
    DrafterConfig,
    HSpecConfig,
    drafter_config,
)
from hspec_jax.drafters.dflash import DFlash, empty_context
from hspec_jax.drafters.hspec import HSpec
from hspec_jax.drafters.inputs import DraftInputs
from hspec_jax.drafters.mamba2 import MambaConfig
from hspec_jax.drafters.output import DraftOutput
from hspec_jax.drafters.vocab import DraftVocab, build_draft_vocab, draft_vocab_from_counts, full_vocab

__all__ = [
    "DRAFTER_KINDS",
    "PAPER_BLOCK_PATTERN",
    "DFlash",
    "DFlashConfig",
    "DraftInputs",
    "DraftOutput",
    "DraftVocab",
    "DrafterConfig",
    "HSpec",
    "HSpecConfig",
    "MambaConfig",
    "build_draft_vocab",
    "draft_block",
    "draft_blocks",
    "draft_vocab_from_counts",
    "drafter_config",
    "drafter_module",
    "empty_context",
    "full_vocab",
    "init_drafter",
    "init_from_target",
]
