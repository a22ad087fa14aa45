"""Run by tests/test_parallel.py in a subprocess with 8 host devices: decode the same prompts on one device
and on several meshes, print the tokens as JSON. Each mesh runs two of the three decoders (`MESH_METHODS`), so
every decoder runs on two meshes and every mesh decodes twice: each sharded program costs a slow multi-device
compilation, and the nine mesh x decoder pairs repeated each other's code paths."""

import json
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np
from peaked import peaked

from hspec_jax.decoding import generate, pad_batch
from hspec_jax.decoding.bundle import Bundle
from hspec_jax.decoding.speculative import speculative_generate
from hspec_jax.drafters import init_drafter, init_from_target
from hspec_jax.drafters.vocab import build_draft_vocab
from hspec_jax.models import init_params
from hspec_jax.parallel import make_mesh, shard_params
from hspec_jax.recipes import drafter_from_recipe, load_config, target_config

assert jax.device_count() == 8, jax.devices()
recipe = load_config("configs/tiny.py")
target = target_config(recipe)
params = peaked(init_params(target, jax.random.key(0)), 4.0)
rng = np.random.default_rng(0)
prompts = [list(rng.integers(4, target.vocab_size, n)) for n in (5, 11, 8, 3, 9, 6, 12, 4)]
tokens, lengths = pad_batch(prompts)
tokens, lengths = jnp.asarray(tokens), jnp.asarray(lengths)
vocab = build_draft_vocab(np.concatenate(prompts), target.vocab_size, recipe.drafter.draft_vocab_size, always=(2,))
drafters = {}
for kind in ("hspec", "dspark"):
    config = drafter_from_recipe(recipe, kind, target)
    drafters[kind] = (config, init_from_target(init_drafter(config, jax.random.key(1)), config, params, vocab))

# data only (hspec's cache split over the batch), data x model with whole KV heads per device (dspark's cache split
# over heads), and more model shards than KV heads (the KV projections replicated).
MESH_METHODS = {
    "single": ("ar", "hspec", "dspark"),
    "data=8": ("ar", "hspec"),
    "data=4,model=2": ("hspec", "dspark"),
    "data=2,model=4": ("ar", "dspark"),
}
results = {}
for spec, methods in MESH_METHODS.items():
    mesh = None if spec == "single" else make_mesh(spec)
    out = {}
    if "ar" in methods:
        out["ar"] = np.asarray(generate(params, target, tokens, lengths, max_new_tokens=20, mesh=mesh).tokens).tolist()
    for kind in (m for m in methods if m != "ar"):
        config, dparams = drafters[kind]
        gen = speculative_generate(
            Bundle(params, target, dparams, config, vocab), tokens, lengths, max_new_tokens=20, mesh=mesh
        )
        out[kind] = np.asarray(gen.tokens).tolist()
        if mesh is not None:
            out[f"{kind}_cache_sharding"] = str(gen.cache.k[0].sharding.spec)
    if mesh is not None:
        placed = shard_params(params, mesh, target.head_dim)
        out["q_proj_sharding"] = str(placed["layers"]["self_attn"]["q_proj"]["kernel"].sharding.spec)
        out["embedding_sharding"] = str(placed["embed_tokens"]["embedding"].sharding.spec)
    results[spec] = out
print(json.dumps(results))
