"""Turning token prompts into a right-padded batch with per-sequence lengths, on bucketed shapes (text to token ids:
`hspec_jax.chat`).

Jitted prefill/decode functions compile once per shape. `bucket` rounds a padded prompt width or a cache capacity
up to a power of two (at least 16), and `bucketed_shapes` is the one rule the engine entry points (`generate`,
`speculative_generate`) and the evaluation use: prompts of 5 and 6 tokens, or 300 and 310, then share one compiled
program. The decode loops depend on the capacity only, so they compile once per capacity bucket.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

MIN_BUCKET = 16


def bucket(n: int) -> int:
    """The smallest power of two >= n, at least `MIN_BUCKET` (16)."""
    return max(MIN_BUCKET, 1 << max(n - 1, 0).bit_length())


def bucketed_shapes(longest: int, width: int, lookahead: int, max_new_tokens: int, capacity: int | None = None):
    """(padded prompt width, cache capacity) for a batch whose longest prompt has `longest` tokens, given as a
    `[B, width]` array. The capacity (unless given) holds the prompt, `max_new_tokens` and `lookahead` rows (the
    speculative engine's k+1 verification rows), bucketed; the width is bucketed too but never exceeds it."""
    capacity = capacity or bucket(longest + max_new_tokens + lookahead)
    return max(width, min(bucket(width), capacity)), capacity


def pad_batch(sequences: list[list[int]], pad_id: int = 0, length: int | None = None):
    """(tokens `[B, T]` int32 right-padded with `pad_id`, lengths `[B]` int32); T = longest unless given."""
    if not sequences or any(len(s) == 0 for s in sequences):
        raise ValueError("every prompt must have at least one token")
    width = length or max(len(s) for s in sequences)
    if width < max(len(s) for s in sequences):
        raise ValueError(f"a prompt of {max(len(s) for s in sequences)} tokens does not fit in width {width}")
    tokens = np.full((len(sequences), width), pad_id, np.int32)
    for i, seq in enumerate(sequences):
        tokens[i, : len(seq)] = seq
    return tokens, np.asarray([len(s) for s in sequences], np.int32)


def pad_to_width(tokens: jax.Array, width: int, pad_id: int) -> jax.Array:
    """Right-pad a `[B, T]` batch to `[B, width]` with `pad_id` (unchanged if it is already that wide)."""
    extra = width - tokens.shape[1]
    return tokens if extra <= 0 else jnp.pad(tokens, ((0, 0), (0, extra)), constant_values=pad_id)
