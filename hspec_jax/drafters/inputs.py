"""`DraftInputs`: everything any drafter may read for a batch of blocks, in one pytree.

Every drafter family takes the same inputs (`draft_blocks(params, config, inputs)`); a family ignores the
fields it does not use, so callers (the engine, training, benchmarks) never branch on the drafter kind.
Shapes: B sequences, A blocks per sequence (1 at inference, the sampled anchors in training), T block size,
S context rows, F*D fused taps, C context rows to inject.
"""

from __future__ import annotations

import flax.struct
import jax

from hspec_jax.models.kv_cache import KVBuffers, KVCache


@flax.struct.dataclass
class DraftInputs:
    embedding: jax.Array  # [V, D] the target's token embedding table (frozen, shared)
    block_tokens: jax.Array  # [B, A, T] [anchor token, MASK x (T - 1)]
    anchors: jax.Array  # [B, A] context row of slot 0 = number of context rows before the block
    doc_starts: jax.Array | None = None  # [B, A] first context row of the anchor's document (None = 0)
    seed_hidden: jax.Array | None = None  # [B, A, F*D] fused target taps at anchor - 1 (H-Spec)
    target_cache: KVCache | None = None  # the target's KV cache, read in place (H-Spec, DFlash + target KV)
    drafter_cache: KVBuffers | None = None  # DFlash/DSpark: their own cache, per layer k, v [B, S, K, H]
    inject_rows: tuple | None = None  # DFlash/DSpark: (taps [B, C, F*D], positions [B, C], first row [B])
    prev_tokens: jax.Array | None = None  # [B, A, T] target id before each slot (Markov head; None = no bias)
