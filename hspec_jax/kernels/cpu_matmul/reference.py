"""The packed weight layout and the `jnp` definition the native kernel is tested against.

A linear layer's kernel `[K, N]` (input K, output N, N a multiple of 16) is stored packed as `[N / 16, K, 16]`:
block b holds columns 16b .. 16b + 15, one contiguous run of K rows of 16 floats, the order in which the kernel
streams them. An lm_head stored as rows `[V, D]` (y = x @ W^T) packs the same way as the kernel `W^T`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

COLUMNS = 16  # columns per packed block (two AVX registers of 8 floats)


def packable(kernel: jax.Array) -> bool:
    """Whether a `[K, N]` kernel (or a stack of them, `[L, K, N]`) has a packed form the native kernel runs: fp32 and
    N a multiple of 16."""
    return kernel.ndim in (2, 3) and kernel.dtype == jnp.float32 and kernel.shape[-1] % COLUMNS == 0


def pack(kernel: jax.Array) -> jax.Array:
    """`[..., K, N]` -> `[..., N / 16, K, 16]` (a new array; leading axes, such as a layer axis, kept)."""
    *lead, k, n = kernel.shape
    return jnp.swapaxes(kernel.reshape(*lead, k, n // COLUMNS, COLUMNS), -3, -2)


def pack_rows(rows: jax.Array) -> jax.Array:
    """`[N, K]` rows (an lm_head `[V, D]`) -> the packed form of the kernel `rows.T`: `[N / 16, K, 16]`."""
    n, k = rows.shape
    return rows.reshape(n // COLUMNS, COLUMNS, k).transpose(0, 2, 1)


def unpack(packed: jax.Array) -> jax.Array:
    """`[..., N / 16, K, 16]` -> the kernel `[..., K, N]`."""
    *lead, blocks, k, columns = packed.shape
    return jnp.swapaxes(packed, -3, -2).reshape(*lead, k, blocks * columns)


def packed_matmul_reference(x: jax.Array, packed: jax.Array) -> jax.Array:
    """`x [..., K]` times the packed kernel `[N / 16, K, 16]` -> fp32 `[..., N]`."""
    return jnp.einsum("...k,bkc->...bc", x.astype(jnp.float32), packed).reshape(*x.shape[:-1], -1)
