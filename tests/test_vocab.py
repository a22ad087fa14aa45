"""Draft vocabulary: most frequent tokens, sorted by id; id maps both ways; speculators offsets."""

import jax.numpy as jnp
import numpy as np
import pytest

from hspec_jax.drafters.vocab import (
    build_draft_vocab,
    d2t_offsets,
    draft_rows,
    from_offsets,
    full_vocab,
    to_draft,
    to_target,
)


def test_top_n_most_frequent_sorted_by_id():
    stream = [7] * 5 + [3] * 4 + [9] * 4 + [1] * 2 + [0]
    vocab = build_draft_vocab(stream, 12, 3)
    np.testing.assert_array_equal(np.asarray(vocab.d2t), [3, 7, 9])  # 9 and 3 tie at 4: both beat 1
    assert np.asarray(vocab.t2d).sum() == 3 and bool(vocab.t2d[7]) and not bool(vocab.t2d[1])
    forced = build_draft_vocab(stream, 12, 3, always=(11,))
    np.testing.assert_array_equal(np.asarray(forced.d2t), [3, 7, 11])


def test_short_stream_fills_with_lowest_ids():
    vocab = build_draft_vocab([5, 5, 8], 10, 4)
    np.testing.assert_array_equal(np.asarray(vocab.d2t), [0, 1, 5, 8])


def test_maps_and_offsets_round_trip():
    vocab = build_draft_vocab(np.random.default_rng(0).integers(0, 50, 500), 50, 20)
    draft = jnp.arange(20)
    np.testing.assert_array_equal(np.asarray(to_draft(to_target(draft, vocab), vocab)), np.arange(20))
    outside = int(np.flatnonzero(~np.asarray(vocab.t2d))[0])
    assert int(to_draft(jnp.array([outside]), vocab)[0]) == -1
    offsets = d2t_offsets(vocab)
    np.testing.assert_array_equal(offsets + np.arange(20), np.asarray(vocab.d2t))
    back = from_offsets(offsets, np.asarray(vocab.t2d))
    np.testing.assert_array_equal(np.asarray(back.d2t), np.asarray(vocab.d2t))
    with pytest.raises(ValueError, match="disagree"):
        from_offsets(offsets, np.roll(np.asarray(vocab.t2d), 1))
    matrix = jnp.arange(50 * 3).reshape(50, 3)
    np.testing.assert_array_equal(np.asarray(draft_rows(matrix, vocab)), np.asarray(matrix)[np.asarray(vocab.d2t)])
    np.testing.assert_array_equal(np.asarray(full_vocab(6).d2t), np.arange(6))
