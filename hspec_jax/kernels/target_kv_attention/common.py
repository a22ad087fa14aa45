"""What the GPU and TPU kernel bodies share: scaled scores of a chunk, the online-softmax update and its
finish, on `[R, .]` tiles with plain 2-D dots; and how many context splits a launch gets."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hspec_jax.models.layers import MASK_VALUE


def _precision(dtype):
    """fp32 inputs get full-precision dots (no TF32 on GPU, multi-pass on TPU); bf16 the native ones."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def chunk_scores(q, k, scale):
    """q `[R, H]`, k `[C, H]` -> `[R, C]` fp32 scaled scores (q k^T, no transpose materialised)."""
    dims = (((1,), (1,)), ((), ()))
    s = jax.lax.dot_general(q, k, dims, precision=_precision(q.dtype), preferred_element_type=jnp.float32)
    return s * scale


def online_update(m, denom, acc, scores, visible, values):
    """Fold one chunk into the running softmax: m, denom `[R, 1]`, acc `[R, H]` (fp32); scores `[R, C]` fp32;
    visible `[1, C]` bool; values `[C, H]` (zero on invisible rows). Invisible scores never count."""
    m_new = jnp.maximum(m, jnp.where(visible, scores, MASK_VALUE).max(axis=-1, keepdims=True))
    p = jnp.where(visible, jnp.exp(scores - m_new), 0.0)
    alpha = jnp.exp(m - m_new)
    pv = jax.lax.dot_general(
        p.astype(values.dtype),
        values,
        (((1,), (0,)), ((), ())),
        precision=_precision(values.dtype),
        preferred_element_type=jnp.float32,
    )
    return m_new, alpha * denom + p.sum(axis=-1, keepdims=True), alpha * acc + pv


def finish(m, denom, acc):
    """Running statistics -> (normalised output `[R, H]`, log-sum-exp `[R, 1]`); an empty split (no visible
    row, denom 0) gives output 0 and log-sum-exp MASK_VALUE, so it weighs nothing in the combine step."""
    empty = denom == 0.0
    safe = jnp.where(empty, 1.0, denom)
    return jnp.where(empty, 0.0, acc / safe), jnp.where(empty, MASK_VALUE, m + jnp.log(safe))


def num_splits(num_chunks: int, programs: int, target: int) -> int:
    """Splits of the context so that `programs * splits` reaches `target` (at most one per chunk)."""
    return max(1, min(num_chunks, -(-target // programs)))
