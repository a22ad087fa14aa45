"""Drafters on the embedded SmolLM2 target, with target state from a real prefill of a chat prompt: one kind per
family and per way of reading the target (H-Spec: state injection + target KV; DFlash: injected context, target
KV, Markov/confidence heads). The kinds left out (hspec_kv_only, hspec_last_token, dflash_markov) switch one of
these inputs off or move the Markov head; tests/test_drafters.py checks each of them on the tiny recipe. The
target's weights and state are passed to the jitted functions as arguments, never closed over: a closed-over
SmolLM2 embedding (49152 x 576) is baked into the program as a constant and makes each compilation slow."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hspec_jax.drafters import DraftInputs, draft_block, draft_blocks, init_drafter, init_from_target
from hspec_jax.drafters.api import block_inputs, seed_hidden_at
from hspec_jax.drafters.dflash import drafter_context
from hspec_jax.drafters.vocab import build_draft_vocab
from hspec_jax.models import commit, forward, init_cache
from hspec_jax.recipes import drafter_from_recipe, load_config

pytestmark = pytest.mark.slow
RECIPE = load_config("configs/smollm2.py")


@pytest.fixture(scope="module")
def prefill(smollm2, chat_prompt):
    config, params = smollm2
    tokens = jnp.asarray([chat_prompt])
    out = jax.jit(lambda p, t, c: forward(p, config, t, c, RECIPE.drafter.fusion_layer_ids))(
        params, tokens, init_cache(config, 1, 128)
    )
    cache = commit(out.cache, jnp.array([tokens.shape[1]]))
    vocab = build_draft_vocab(np.asarray(tokens), config.vocab_size, RECIPE.drafter.draft_vocab_size)
    return tokens, cache, jnp.concatenate(out.hidden, axis=-1), vocab


FORWARD_KINDS = ("hspec", "dspark", "dflash", "dflash_target_kv")


@pytest.mark.parametrize("kind", FORWARD_KINDS)
def test_forward_on_real_target_state(kind, smollm2, prefill):
    """One jitted inference block: logits of the right shape, finite, not constant."""
    target, target_params = smollm2
    tokens, cache, hidden, vocab = prefill
    config = drafter_from_recipe(RECIPE, kind, target)
    params = init_from_target(init_drafter(config, jax.random.key(0)), config, target_params, vocab)
    anchor = cache.lengths
    block = jnp.concatenate([tokens[:, -1:], jnp.full((1, config.num_drafts), config.mask_token_id)], axis=1)
    positions = jnp.arange(hidden.shape[1])[None]
    kw = dict(  # every input; each kind reads what it uses
        target_cache=cache,
        seed_hidden=hidden[:, -1],
        drafter_cache=drafter_context(config, 1, 128),
        inject_rows=(hidden, positions, positions[:, 0]),
    )
    embedding = target_params["embed_tokens"]["embedding"]
    out = jax.jit(lambda p, e, b, a, kw: draft_block(p, config, e, b, a, **kw))(params, embedding, block, anchor, kw)
    assert out.logits.shape == (1, 8, config.vocab_size) and bool(jnp.isfinite(out.logits).all())
    assert float(out.logits.std()) > 0


@pytest.mark.parametrize("kind", ["hspec", "dspark"])
def test_gradients_on_real_target_state(kind, smollm2, prefill):
    """The jitted training path over three blocks: a finite loss, finite gradients, a nonzero one in layer 0."""
    target, target_params = smollm2
    tokens, cache, hidden, vocab = prefill
    config = drafter_from_recipe(RECIPE, kind, target)
    params = init_from_target(init_drafter(config, jax.random.key(0)), config, target_params, vocab)
    anchors = jnp.array([[5, 17, 30]])
    block, prev, labels = block_inputs(tokens, anchors, config.block_size, config.mask_token_id)
    draft_labels = jnp.clip(jnp.cumsum(vocab.t2d) - 1, 0)[labels]
    positions = jnp.arange(hidden.shape[1])[None]
    inputs = DraftInputs(
        embedding=target_params["embed_tokens"]["embedding"],
        block_tokens=block,
        anchors=anchors,
        seed_hidden=seed_hidden_at(hidden, anchors),
        target_cache=cache,
        drafter_cache=drafter_context(config, 1, 128),
        inject_rows=(hidden, positions, positions[:, 0]),
        prev_tokens=prev,
    )

    def loss(p, inputs):
        out = draft_blocks(p, config, inputs)
        logp = jax.nn.log_softmax(out.logits)
        return -jnp.take_along_axis(logp, draft_labels[..., None], -1)[:, :, 1:].mean()

    value, grads = jax.jit(jax.value_and_grad(loss))(params, inputs)
    assert np.isfinite(float(value))
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))
    assert (
        float(
            jnp.abs(
                grads["layers_0"]["ssm" if kind == "hspec" else "mlp"]["out_proj" if kind == "hspec" else "down_proj"][
                    "kernel"
                ]
            ).sum()
        )
        > 0
    )
