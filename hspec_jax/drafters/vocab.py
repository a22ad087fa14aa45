"""The draft vocabulary: the drafter predicts over the Vd most frequent target tokens only.

`DraftVocab.d2t [Vd]` holds the target id of each draft id (ascending target ids), `t2d [V]` marks
which target ids are draftable. The speculators checkpoint format stores d2t as offsets
(target = draft + d2t[draft]); `d2t_offsets` / `from_offsets` convert.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


@flax.struct.dataclass
class DraftVocab:
    d2t: jax.Array  # [Vd] int32, target id of each draft id, ascending
    t2d: jax.Array  # [V] bool, target id is in the draft vocabulary

    @property
    def size(self) -> int:
        return self.d2t.shape[0]


def full_vocab(vocab_size: int) -> DraftVocab:
    """The identity mapping (no pruning)."""
    return DraftVocab(jnp.arange(vocab_size, dtype=jnp.int32), jnp.ones((vocab_size,), bool))


def vocab_from_ids(target_ids, target_vocab_size: int) -> DraftVocab:
    """A draft vocabulary holding exactly `target_ids` (any order, no duplicates)."""
    ids = np.sort(np.asarray(target_ids, np.int64))
    if len(np.unique(ids)) != len(ids) or ids[0] < 0 or ids[-1] >= target_vocab_size:
        raise ValueError("draft vocabulary ids must be distinct target ids")
    t2d = np.zeros(target_vocab_size, bool)
    t2d[ids] = True
    return DraftVocab(jnp.asarray(ids, jnp.int32), jnp.asarray(t2d))


def build_draft_vocab(token_stream, target_vocab_size: int, draft_vocab_size: int, always=()) -> DraftVocab:
    """The `draft_vocab_size` most frequent ids of `token_stream` (ties: lower id first), plus `always`
    (e.g. EOS, which must stay draftable). If the stream has too few distinct ids, the lowest unused ids fill up."""
    counts = np.bincount(np.asarray(token_stream, np.int64).ravel(), minlength=target_vocab_size)
    if counts.shape[0] > target_vocab_size:
        raise ValueError(f"token ids must be below the target vocabulary size {target_vocab_size}")
    return draft_vocab_from_counts(counts, draft_vocab_size, always)


def draft_vocab_from_counts(counts, draft_vocab_size: int, always=()) -> DraftVocab:
    """As `build_draft_vocab`, from per-token counts `[V]` (e.g. the supervised tokens of a training set)."""
    counts = np.asarray(counts, np.float64).copy()
    target_vocab_size = counts.shape[0]
    if not 0 < draft_vocab_size <= target_vocab_size:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} must be in 1..{target_vocab_size}")
    counts[list(always)] = np.inf
    order = np.lexsort((np.arange(target_vocab_size), -counts))  # by count desc, then id asc
    return vocab_from_ids(order[:draft_vocab_size], target_vocab_size)


def to_target(draft_ids: jax.Array, vocab: DraftVocab) -> jax.Array:
    return vocab.d2t[draft_ids]


def to_draft(target_ids: jax.Array, vocab: DraftVocab) -> jax.Array:
    """Target ids -> draft ids, -1 where the token is not in the draft vocabulary."""
    index = jnp.cumsum(vocab.t2d.astype(jnp.int32)) - 1
    return jnp.where(vocab.t2d[target_ids], index[target_ids], -1)


def draft_rows(target_matrix: jax.Array, vocab: DraftVocab) -> jax.Array:
    """The rows `[Vd, D]` of a target-vocabulary matrix `[V, D]` (e.g. the lm_head) for the draft tokens."""
    return target_matrix[vocab.d2t]


def d2t_offsets(vocab: DraftVocab) -> np.ndarray:
    """The speculators `d2t` tensor: offsets with target = draft + d2t[draft] (int64)."""
    return np.asarray(vocab.d2t, np.int64) - np.arange(vocab.size)


def from_offsets(d2t: np.ndarray, t2d: np.ndarray) -> DraftVocab:
    """Inverse of `d2t_offsets`, checking that d2t and t2d describe the same set."""
    ids = np.asarray(d2t, np.int64) + np.arange(len(d2t))
    vocab = vocab_from_ids(ids, len(t2d))
    if not np.array_equal(np.asarray(vocab.t2d), np.asarray(t2d, bool)):
        raise ValueError("d2t and t2d disagree about the draft vocabulary")
    return vocab
