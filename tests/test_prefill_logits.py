"""Prefill computes target logits only at each sequence's last prompt position: no `[B, T, V]` array is ever
formed, in plain or speculative decoding (their outputs are covered by the lossless tests)."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np

from hspec_jax.decoding import Bundle
from hspec_jax.decoding.autoregressive import prefill
from hspec_jax.decoding.speculative import spec_prefill
from hspec_jax.drafters import init_drafter
from hspec_jax.drafters.dflash import drafter_context
from hspec_jax.drafters.vocab import build_draft_vocab
from hspec_jax.models import init_cache, init_params
from hspec_jax.recipes import drafter_from_recipe, target_config

RECIPE = importlib.import_module("configs.tiny").get_config()
VOCAB = 157  # a size no other axis of the tiny model has
WIDTH = 23  # prompt width, likewise


def array_shapes(jaxpr):
    """Shapes of every array a jaxpr computes, nested jaxprs (jit, scan, while, cond, ...) included."""
    for eqn in jaxpr.eqns:
        yield from (v.aval.shape for v in eqn.outvars if hasattr(v.aval, "shape"))
        for param in eqn.params.values():
            for sub in param if isinstance(param, list | tuple) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from array_shapes(inner)


def test_prefill_never_forms_logits_for_every_prompt_position():
    target = target_config(RECIPE, vocab_size=VOCAB)
    params = jax.eval_shape(lambda: init_params(target, jax.random.key(0)))  # shapes suffice: nothing is computed
    drafter = drafter_from_recipe(RECIPE, "dspark", target)  # owns a KV cache: the widest prefill
    vocab = build_draft_vocab(np.arange(VOCAB), VOCAB, drafter.vocab_size)
    dparams = jax.eval_shape(lambda: init_drafter(drafter, jax.random.key(1)))
    batch, capacity = 2, 64
    prompts, lengths = jnp.ones((batch, WIDTH), jnp.int32), jnp.array([WIDTH, 5])
    cache = init_cache(target, batch, capacity)
    key = jax.random.key(0)

    context = drafter_context(drafter, batch, capacity)
    spec = spec_prefill.trace(
        Bundle(params, target, dparams, drafter, vocab), prompts, lengths, cache, context, key, max_new_tokens=8
    )
    plain = prefill.trace(params, target, prompts, lengths, cache, key)
    for jaxpr in (spec.jaxpr, plain.jaxpr):
        shapes = list(array_shapes(jaxpr))
        assert any(s[-1:] == (VOCAB,) for s in shapes)  # logits are computed ...
        assert not [s for s in shapes if s[-2:] == (WIDTH, VOCAB)]  # ... but never for all WIDTH positions
