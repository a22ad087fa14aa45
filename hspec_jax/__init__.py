"""hspec-jax: H-Spec speculative decoding in JAX/Flax (drafter without a KV cache of its own)."""

__version__ = "0.1.0"
