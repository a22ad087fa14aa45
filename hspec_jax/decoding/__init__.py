"""Decoding: sampling rules, plain autoregressive decoding, and the speculative draft-and-verify loop."""

from hspec_jax.decoding.autoregressive import Generation, decode, generate, prefill
from hspec_jax.decoding.batching import bucket, bucketed_shapes, pad_batch
from hspec_jax.decoding.bundle import Bundle
from hspec_jax.decoding.sampling import SamplingConfig, probabilities, sample

__all__ = [
    "Bundle",
    "Generation",
    "SamplingConfig",
    "bucket",
    "bucketed_shapes",
    "decode",
    "generate",
    "pad_batch",
    "prefill",
    "probabilities",
    "sample",
]
