"""Linear layers over packed fp32 weights on x86 CPUs: an 8-row product at about the cost of a 1-row one.

XLA's CPU dots cost about twice as much for 8 rows as for 1 (benchmarks/results/matmul_rows.md), which made
verifying a block of drafted tokens cost 2.4x a plain decoding step. The native kernel (`packed_matmul.cc`, AVX2
and FMA, with an AVX-512F path chosen at run time where the CPU has it; an XLA FFI call) reads each weight block
once for all rows, so a SmolLM2 forward over 8 tokens costs about 1.3-1.5x one over a single token
(benchmarks/results/packed_matmul.md).

Modules:
* `reference`: the packed layout (`pack`, `pack_rows`, `unpack`) and the `jnp` definition of the product.
* `native`: building (once, into `build/` beside the source), loading and registering the C++ kernel.

Entry points: `available()` says whether the kernel runs here, `kernel_path()` which path it takes;
`packed_matmul(x, packed)` multiplies, with the kernel where it runs and the reference elsewhere; `packed` may be
a `StackedLayer`, one layer of stacked kernels read in place.
`hspec_jax.models.layers.for_backend` packs a model's linear layers on CPU where the kernel is available.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from hspec_jax.kernels.cpu_matmul import native
from hspec_jax.kernels.cpu_matmul.reference import (
    COLUMNS,
    pack,
    pack_rows,
    packable,
    packed_matmul_reference,
    unpack,
)

log = logging.getLogger(__name__)

__all__ = [
    "COLUMNS",
    "StackedLayer",
    "available",
    "kernel_path",
    "pack",
    "pack_rows",
    "packable",
    "packed_matmul",
    "packed_matmul_reference",
    "unpack",
]


@functools.cache
def available() -> bool:
    """Whether the native kernel runs in this process (built and registered on first call); says why once where
    it does not."""
    reason = native.unavailable_reason()
    if reason is None:
        try:
            native.load()
        except RuntimeError as error:
            reason = str(error)
    if reason is not None:
        log.info("linear layers keep XLA's dots: the packed CPU matmul kernel is unavailable (%s)", reason)
    return reason is None


def kernel_path() -> str | None:
    """The native kernel's path on this CPU, "avx512f" or "avx2" (None where the kernel does not run): the two
    compute the same bits, at different speeds."""
    if not available():
        return None
    return "avx512f" if native.vector_bits() == 512 else "avx2"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StackedLayer:
    """Layer `index` (a traced int32 scalar) of every layer's packed kernels stacked, `stack [L, N / 16, K, 16]`: what
    a scanned decoder step hands its linear layers, so the kernel reads that layer's weights where they lie instead
    of XLA copying them out of the stack first."""

    stack: jax.Array
    index: jax.Array


def packed_matmul(
    x: jax.Array, packed: jax.Array | StackedLayer, impl: str | None = None, first_block: int = 0
) -> jax.Array:
    """`x [..., K]` (fp32) times the packed kernel `[N / 16, K, 16]` (or a `StackedLayer` of such kernels), from its
    block `first_block` on -> fp32 `[..., N - 16 * first_block]`. `impl`: "native" (the C++ kernel), "reference"
    (`jnp`), or None: native where `available()`, else the reference."""
    impl = impl or ("native" if available() else "reference")
    stack, index = (packed.stack, packed.index) if isinstance(packed, StackedLayer) else (packed, None)
    if stack.ndim != (3 if index is None else 4):
        raise ValueError(f"need [N / 16, K, 16] weights or a StackedLayer of [L, N / 16, K, 16], got {stack.shape}")
    if impl == "reference":
        return packed_matmul_reference(x, (stack if index is None else stack[index])[first_block:])
    if impl != "native":
        raise ValueError(f"impl must be 'native', 'reference' or None, got {impl!r}")
    native.load()
    k, n = stack.shape[-2], (stack.shape[-3] - first_block) * COLUMNS
    rows = x.reshape(-1, k).astype(jnp.float32)
    call = jax.ffi.ffi_call(
        native.TARGET, jax.ShapeDtypeStruct((rows.shape[0], n), jnp.float32), vmap_method="sequential"
    )
    layer = jnp.zeros((), jnp.int32) if index is None else jnp.asarray(index, jnp.int32)
    return call(rows, stack, layer, first_block=np.int64(first_block)).reshape(*x.shape[:-1], n)
