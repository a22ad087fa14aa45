"""Block attention over a context KV cache read in place: the drafters' attention, as tiled Pallas kernels
(a GPU and a TPU variant) beside a readable `jnp` reference, behind one entry point.

A drafter block of T tokens (anchor + masks) sits at positions a .. a+T-1, where a (the "anchor" position)
is also the number of context rows before it. Its queries attend to

  (a) context keys/values `[B, S, K, H]` (the target's own post-RoPE KV cache for H-Spec, read in place;
      the drafter's injected cache for DFlash): row j is visible iff doc_start <= j < a and, with a sliding
      window W, j >= a - W (the window is anchored at the block, so every slot sees the same context rows);
      with `per_query_window` the window is each query's own, as vLLM serves it: slot t sees j >= a + t - W + 1.
      `doc_starts [B, A]` is the first row of the anchor's document: 0 at inference; in training, where
      documents are packed into one row, it keeps a block from seeing an earlier document; and
  (b) the block's own keys/values `[.., T, K, H]`: causal (slot u visible to slot t iff u <= t) or, for
      DFlash, bidirectional.

Axis letters: B batch, A blocks per sequence, T block length, S context rows, N query heads, K KV heads,
G = N / K, H head dim, R query rows of one KV head (the T*G queries, padded), C context rows per chunk,
P context splits. Query head n reads KV head n // G. Softmax statistics are fp32.

Modules:
* `reference`: the masks and the masked dense `jnp` attention, the definition the kernels are tested against.
* `common`: the online-softmax helpers both kernel bodies share.
* `gpu`, `tpu`: the two Pallas kernel variants (context part only), each with its backend's block shapes.
* `pallas`: the kernel path: block part and combine in `jnp` around a variant, with the reference's backward.
* `dispatch`: the entry point `target_kv_attention(..., impl=...)` and which path runs where.
"""

from hspec_jax.kernels.target_kv_attention.dispatch import target_kv_attention
from hspec_jax.kernels.target_kv_attention.reference import reference, visible_range

__all__ = ["KernelSettings", "pallas_attention", "reference", "target_kv_attention", "visible_range"]
KERNEL_PATH = ("KernelSettings", "pallas_attention")


def __getattr__(name: str):
    """The kernel path's names, imported on first use (Pallas' back ends: ~0.5 s that the reference never needs)."""
    if name in KERNEL_PATH:
        from hspec_jax.kernels.target_kv_attention import pallas

        return getattr(pallas, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
