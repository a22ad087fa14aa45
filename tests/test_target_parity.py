"""The JAX decoder against transformers (fp32) on tiny random checkpoints of every supported family."""

import jax.numpy as jnp
import numpy as np
from conftest import hf_logits

from hspec_jax.checkpoints import load_hf_target
from hspec_jax.models import forward, init_cache
from hspec_jax.models.layers import rms_norm

TOKENS = np.array([[5, 17, 33, 2, 91, 40, 7, 7, 62, 11, 3, 80, 45, 28, 19, 66, 1, 50, 50, 9]])


def test_logits_and_taps_match_transformers(tiny_hf_dir):
    _, model, path = tiny_hf_dir
    config, params = load_hf_target(path)
    num_layers = config.num_layers
    taps = tuple(range(num_layers + 1))
    out = forward(params, config, jnp.asarray(TOKENS), init_cache(config, 1, 32), taps)
    ref = hf_logits(model, TOKENS, output_hidden_states=True)
    np.testing.assert_allclose(np.asarray(out.logits), ref.logits.numpy(), atol=1e-4, rtol=0)
    # Tap i is HF hidden_states[i] (the residual entering layer i) ...
    for i in range(num_layers):
        np.testing.assert_allclose(np.asarray(out.hidden[i]), ref.hidden_states[i].numpy(), atol=1e-5, rtol=0)
    # ... and tap L is the last layer's output *before* the final norm; HF's last entry has the norm applied.
    normed = rms_norm(out.hidden[num_layers], params["norm"]["scale"], config.rms_norm_eps)
    np.testing.assert_allclose(np.asarray(normed), ref.hidden_states[num_layers].numpy(), atol=1e-5, rtol=0)


def test_llama3_rope_scaling_is_applied(tiny_hf_dir):
    """Positions past original_max_position_embeddings exercise every llama3 frequency band."""
    family, model, path = tiny_hf_dir
    if family != "llama":
        return
    config, params = load_hf_target(path)
    assert config.rope_scaling is not None and config.rope_scaling.factor == 8.0
    tokens = np.arange(200).reshape(1, 200) % 96
    out = forward(params, config, jnp.asarray(tokens), init_cache(config, 1, 200))
    ref = hf_logits(model, tokens).logits.numpy()
    np.testing.assert_allclose(np.asarray(out.logits), ref, atol=1e-4, rtol=0)
    unscaled = forward(params, config.replace(rope_scaling=None), jnp.asarray(tokens), init_cache(config, 1, 200))
    assert np.abs(np.asarray(unscaled.logits) - ref).max() > 1e-3


def test_bf16_compute_tracks_fp32(tiny_hf_dir):
    _, model, path = tiny_hf_dir
    config, params = load_hf_target(path)
    bf16 = config.replace(dtype=jnp.bfloat16)
    out = forward(params, bf16, jnp.asarray(TOKENS), init_cache(bf16, 1, 32))
    ref = hf_logits(model, TOKENS).logits.numpy()
    assert out.logits.dtype == jnp.float32 and out.cache.k[0].dtype == jnp.bfloat16
    err = np.abs(np.asarray(out.logits) - ref).max()
    assert 1e-4 < err < 0.1  # really computed in bf16, and still close
