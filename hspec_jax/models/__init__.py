"""Target language models: config, decoder, RoPE and the KV cache the drafters read in place."""

from hspec_jax.models.config import RopeScaling, TargetConfig, default_dtype
from hspec_jax.models.decoder import (
    DecoderOutput,
    decoder_layer,
    embedding_matrix,
    forward,
    init_params,
    layer_params,
    lm_head_matrix,
    param_shapes,
)
from hspec_jax.models.kv_cache import KVCache, check_capacity, commit, init_cache

__all__ = [
    "DecoderOutput",
    "KVCache",
    "RopeScaling",
    "TargetConfig",
    "check_capacity",
    "commit",
    "decoder_layer",
    "default_dtype",
    "embedding_matrix",
    "forward",
    "init_cache",
    "init_params",
    "layer_params",
    "lm_head_matrix",
    "param_shapes",
]
