"""The entry point `target_kv_attention` and which path runs where (`impl`):

* `"reference"`: masked dense `jnp` attention; the training path and the CPU path.
* `"pallas"`: the kernel variant of the current platform (TPU -> TPU variant, GPU -> GPU variant; on CPU
  the GPU variant in interpret mode). `"pallas_gpu"` / `"pallas_tpu"` name a variant; on CPU each runs in
  its interpret mode (the TPU one through `pltpu.InterpretParams`), which is how the tests check both.
* `"auto"`: the kernel only on a platform in `VERIFIED_PLATFORMS` (where `benchmarks/device_check.py`
  has compiled it and matched the reference), else the reference; the choice is logged once.
"""

from __future__ import annotations

import logging

import jax

from hspec_jax.kernels.target_kv_attention.reference import reference

IMPLS = ("auto", "reference", "pallas", "pallas_gpu", "pallas_tpu")
# Platforms (`jax.default_backend()`) on which the kernel has compiled and matched the reference in
# `benchmarks/device_check.py`: GPU on one NVIDIA H200 (benchmarks/results/device_nvidia_h200.md: every shape within
# the reference's own bf16 error, gradients equal). TPU has not been run.
VERIFIED_PLATFORMS: set[str] = {"gpu"}

logger = logging.getLogger(__name__)
_logged_choices: set[tuple[str, str]] = set()


def auto_impl(platform: str) -> str:
    """What `impl="auto"` runs on `platform`: the kernel only where it has been verified. Logged once per
    process for each (platform, choice)."""
    choice = "pallas" if platform in VERIFIED_PLATFORMS else "reference"
    if (platform, choice) not in _logged_choices:
        _logged_choices.add((platform, choice))
        why = "verified there" if choice == "pallas" else f"kernel verified only on {sorted(VERIFIED_PLATFORMS)}"
        logger.info("target_kv_attention impl=auto on %s: %s (%s)", platform, choice, why)
    return choice


def target_kv_attention(
    q,
    k_blk,
    v_blk,
    k_ctx,
    v_ctx,
    anchors,
    doc_starts=None,
    *,
    window: int | None = None,
    causal: bool = True,
    per_query_window: bool = False,
    impl: str = "auto",
):
    """Entry point: the contract is the package docstring's, this module's says which `impl` runs where."""
    if impl not in IMPLS:
        raise ValueError(f"unknown attention impl {impl!r}; choose one of {IMPLS}")
    platform = jax.default_backend()
    if impl == "auto":
        impl = auto_impl(platform)
    mask = dict(window=window, causal=causal, per_query_window=per_query_window)
    if impl == "reference":
        return reference(q, k_blk, v_blk, k_ctx, v_ctx, anchors, doc_starts, **mask)
    native = "tpu" if platform == "tpu" else "gpu"
    variant = native if impl == "pallas" else impl.removeprefix("pallas_")
    if platform != "cpu" and variant != native:
        raise ValueError(f"attention impl {impl!r} cannot run on {platform}: use 'pallas' or 'reference'")
    # Imported here: Pallas' GPU and TPU back ends cost ~0.5 s of every process start that never runs the kernel.
    from hspec_jax.kernels.target_kv_attention.pallas import KernelSettings, pallas_attention

    settings = KernelSettings(variant=variant, interpret=platform == "cpu")
    return pallas_attention(q, k_blk, v_blk, k_ctx, v_ctx, anchors, doc_starts, **mask, settings=settings)
