"""Whole programs lowered for the accelerators on CPU: the decoding chunk and the speculative chunk of
Llama-3.1-8B with H-Spec (abstract shapes, no weights, an abstract 8-device mesh with the shipped sharding rules),
layers scanned as they are on TPU and GPU. Compiling for the chip still needs the device
(`benchmarks/device_check.sh`)."""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, NamedSharding

from hspec_jax import parallel
from hspec_jax.decoding import Bundle, SamplingConfig
from hspec_jax.decoding.autoregressive import decode_chunk, start_decode
from hspec_jax.decoding.bundle import init_caches
from hspec_jax.decoding.speculative import spec_decode_chunk, spec_prefill
from hspec_jax.drafters import drafter_param_shapes
from hspec_jax.drafters.vocab import DraftVocab
from hspec_jax.models import init_cache, param_shapes
from hspec_jax.recipes import drafter_from_recipe, load_config, target_config

BATCH, CAPACITY, NEW = 8, 4096, 256
MESH = AbstractMesh((4, 1, 2), parallel.AXES)  # data=4, model=2: 8 devices


def abstract(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def sharded_params(shapes, head_dim):
    return abstract(shapes, parallel.param_shardings(shapes, MESH, head_dim))


def sharded_cache(tree):
    def place(x):
        axes = (None,) * (x.ndim - 4) + ("batch", None, "heads", None) if x.ndim >= 4 else ("batch",)
        return jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=NamedSharding(MESH, parallel.spec_for(MESH, x.shape, axes))
        )

    return jax.tree.map(place, tree)


def assert_sharded_stacked_layers(text: str) -> None:
    """The stacked q_proj kernels `[32, 4096, 4096]` enter with heads on `model` and the layer axis whole."""
    assert 'tensor<32x4096x4096xbf16> {sdy.sharding = #sdy.sharding<@mesh, [{}, {}, {"model"}]>' in text


@functools.cache
def llama():
    recipe = load_config("llama")
    config = target_config(recipe, dtype="bfloat16", param_dtype="bfloat16").replace(scan_layers=True)
    return recipe, config


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_llama_8b_decoding_chunk_lowers_for_the_accelerator(platform):
    _, config = llama()
    params = sharded_params(param_shapes(config), config.head_dim)
    cache = sharded_cache(jax.eval_shape(lambda: init_cache(config, BATCH, CAPACITY)))
    assert cache.k.shape[0] == config.num_layers  # stacked: the layers are scanned
    first = jax.ShapeDtypeStruct((BATCH,), jnp.int32)
    loop = dict(max_new_tokens=NEW, eos_ids=(128009,), pad_id=0)
    state = jax.eval_shape(functools.partial(start_decode, **loop), cache, first, jax.random.key(0))
    lowered = decode_chunk.trace(params, config, state, cache, jnp.int32(8), sampling=SamplingConfig(), **loop)
    text = lowered.lower(lowering_platforms=(platform,)).as_text()
    assert "stablehlo.while" in text and text.count("func.func") < 40  # one layer inside the loop, not 32
    assert_sharded_stacked_layers(text)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_llama_8b_speculative_chunk_with_hspec_lowers_for_the_accelerator(platform):
    recipe, config = llama()
    drafter = drafter_from_recipe(recipe, "hspec", config)
    params = sharded_params(param_shapes(config), config.head_dim)
    dparams = sharded_params(drafter_param_shapes(drafter), config.head_dim)
    vocab = DraftVocab(
        jax.ShapeDtypeStruct((drafter.vocab_size,), jnp.int32), jax.ShapeDtypeStruct((config.vocab_size,), bool)
    )
    bundle = Bundle(params, config, dparams, drafter, vocab)
    caches = jax.eval_shape(lambda: init_caches(bundle, BATCH, CAPACITY))
    cache, context = sharded_cache(caches[0]), caches[1]
    prompts = jax.ShapeDtypeStruct((BATCH, 128), jnp.int32)
    lengths = jax.ShapeDtypeStruct((BATCH,), jnp.int32)
    kw = dict(max_new_tokens=NEW, sampling=SamplingConfig(), eos_ids=(128009,), pad_id=0)
    carry = jax.eval_shape(lambda: spec_prefill(bundle, prompts, lengths, cache, context, jax.random.key(0), **kw))
    lowered = spec_decode_chunk.trace(bundle, *carry, jnp.int32(4), **kw)
    text = lowered.lower(lowering_platforms=(platform,)).as_text()
    assert "stablehlo.while" in text
    assert_sharded_stacked_layers(text)
