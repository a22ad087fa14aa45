"""What every drafter returns, and the shared output stage: final norm, draft lm_head, Markov/confidence heads."""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from hspec_jax.kernels import cpu_matmul
from hspec_jax.models.layers import INIT_STD, RMSNorm


class DraftOutput(NamedTuple):
    hidden: jax.Array  # [B, A, T, D] final-normed hidden states
    logits: jax.Array  # [B, A, T, Vd] fp32; with the Markov bias when prev_tokens were given
    confidence: jax.Array | None  # [B, A, T] fp32 confidence logits (with prev_tokens and a confidence head)
    drafter_cache: object | None = None  # DFlash: its drafter-side cache (`KVBuffers` or paged), new rows written


def draft_logits(module: nn.Module, config, h: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Final RMSNorm and the frozen draft lm_head `[Vd, D]`, created in `module`'s (compact) scope."""
    target = config.target
    hidden = RMSNorm(target.rms_norm_eps, config.storage_dtype, name="norm")(h)
    if module.has_variable("params", "packed_lm_head"):  # placed for the packed CPU kernel (`for_backend`)
        return hidden, cpu_matmul.packed_matmul(hidden, module.get_variable("params", "packed_lm_head"))
    lm_head = module.param(
        "lm_head", nn.initializers.normal(INIT_STD), (config.vocab_size, target.hidden_size), config.storage_dtype
    )
    logits = jnp.einsum("batd,vd->batv", hidden, lm_head.astype(hidden.dtype), preferred_element_type=jnp.float32)
    return hidden, logits


def apply_heads(config, markov, confidence, hidden, logits, prev_tokens) -> DraftOutput:
    """Add the Markov bias of `prev_tokens [B, A, T]` and compute confidence logits, when the config has them."""
    if not config.markov_rank or prev_tokens is None:
        return DraftOutput(hidden, logits, None)
    embedded, bias = markov(prev_tokens)
    conf = confidence(hidden, embedded) if config.confidence_head else None
    return DraftOutput(hidden, logits + bias, conf)


def drafted_slots(out: DraftOutput, config) -> DraftOutput:
    """The k drafting slots of `out` `[B, A, T, ...]` -> `[B, A, k, ...]`, slot i drafting the token i + 1 after
    the anchor (slot 0, the anchor itself, is dropped unless the config `sample_from_anchor`)."""
    keep = lambda x: None if x is None else x[:, :, config.first_draft_slot :]
    return out._replace(hidden=keep(out.hidden), logits=keep(out.logits), confidence=keep(out.confidence))
