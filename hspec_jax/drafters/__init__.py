"""Drafters: H-Spec (Mamba-2 + target-KV attention hybrid), DFlash, DSpark, and the paper's variants."""

# The built-in families register their kinds on import, H-Spec first: tables list kinds in registration order.
from hspec_jax.drafters import hspec  # noqa: F401
from hspec_jax.drafters.api import (
    draft_block,
    draft_blocks,
    drafter_module,
    drafter_param_shapes,
    init_drafter,
    init_from_target,
)
from hspec_jax.drafters.config import PAPER_BLOCK_PATTERN, DFlashConfig, DrafterConfig, HSpecConfig, drafter_config
from hspec_jax.drafters.dflash import DFlash, empty_context
from hspec_jax.drafters.family import (
    DRAFTER_KINDS,
    DrafterFamily,
    DrafterKind,
    drafter_kind,
    register_family,
    register_kind,
)
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
    "DrafterFamily",
    "DrafterKind",
    "HSpec",
    "HSpecConfig",
    "MambaConfig",
    "build_draft_vocab",
    "draft_block",
    "draft_blocks",
    "draft_vocab_from_counts",
    "drafter_config",
    "drafter_kind",
    "drafter_module",
    "drafter_param_shapes",
    "empty_context",
    "full_vocab",
    "init_drafter",
    "init_from_target",
    "register_family",
    "register_kind",
]
