"""Sharding: meshes from specs, sharding rules, and sharded decoding equal to one device (8 host devices)."""

import dataclasses
import json
import os
import subprocess
import sys
import types

import jax
import pytest
from jax.sharding import PartitionSpec as P

from hspec_jax.drafters import DRAFTER_KINDS, init_drafter
from hspec_jax.models import init_params
from hspec_jax.parallel import logical_axes, make_mesh, param_shardings, parse_mesh_spec, spec_for, with_fsdp
from hspec_jax.recipes import drafter_from_recipe, load_config, target_config

MESHES = ("data=8", "data=4,model=2", "data=2,model=4")


def test_mesh_spec_parsing_and_errors():
    assert parse_mesh_spec("data=2,model=4") == {"data": 2, "fsdp": 1, "model": 4}
    assert parse_mesh_spec("model=2") == {"data": 1, "fsdp": 1, "model": 2}
    for bad in ("pipe=2", "data=0", "data=two"):
        with pytest.raises(ValueError, match="bad mesh spec"):
            parse_mesh_spec(bad)
    with pytest.raises(ValueError, match="needs 16 devices"):
        make_mesh("data=4,model=4")
    assert make_mesh("data=1,model=1").shape == {"data": 1, "fsdp": 1, "model": 1}


def test_rules_shard_whole_heads_and_replicate_the_rest():
    mesh = types.SimpleNamespace(shape={"data": 2, "model": 4})
    granule = {"heads": 16}
    q = logical_axes("layers_0/self_attn/q_proj/kernel", (64, 128))
    assert spec_for(mesh, (64, 128), q, granule) == P(None, "model")  # 8 heads over 4
    assert spec_for(mesh, (64, 32), logical_axes("layers_0/self_attn/k_proj/kernel", (64, 32)), granule) == P(
        None, None
    )
    assert spec_for(mesh, (96, 64), logical_axes("embed_tokens/embedding", (96, 64))) == P("model", None)
    assert spec_for(mesh, (64,), logical_axes("layers_0/input_layernorm/scale", (64,))) == P(None)
    assert spec_for(mesh, (6, 10), ("batch", None)) == P("data", None)
    assert spec_for(mesh, (3, 10), ("batch", None)) == P(None, None)  # 3 sequences do not split over 2


def test_fsdp_shards_the_batch_and_the_largest_free_dimension():
    mesh = types.SimpleNamespace(shape={"data": 2, "fsdp": 2, "model": 2})
    assert spec_for(mesh, (8, 10), ("batch", None)) == P(("data", "fsdp"), None)
    assert spec_for(mesh, (2, 10), ("batch", None)) == P(None, None)  # 2 rows do not split over 4
    q = spec_for(mesh, (64, 128), logical_axes("layers_3/self_attn/q_proj/kernel", (64, 128)), {"heads": 16})
    assert with_fsdp(mesh, (64, 128), q) == P("fsdp", "model")
    assert with_fsdp(mesh, (576, 1536), P(None, None)) == P(None, "fsdp")
    assert with_fsdp(mesh, (7,), P(None)) == P(None)  # nothing divisible: replicated


# Every target family: Llama (and tied embeddings, SmolLM2's case), Qwen2 (q/k/v biases), Qwen3 (q/k norms), and a
# decoder with every optional bias (o_proj, MLP).
TINY = load_config("configs/tiny.py")
FAMILIES = {
    "llama": dict(model_type="llama", qk_norm=False),
    "llama_tied": dict(model_type="llama", qk_norm=False, tie_word_embeddings=True),
    "qwen2": dict(model_type="qwen2", qk_norm=False, qkv_bias=True),
    "qwen3": dict(model_type="qwen3", qk_norm=True),
    "all_biases": dict(model_type="llama", qkv_bias=True, o_bias=True, mlp_bias=True),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_parameter_of_every_target_and_drafter_has_a_rule(family):
    """No parameter falls through to an unnamed default: param_shardings (which raises on a parameter that
    neither table names) covers each family's target params and every drafter kind's params built for it."""
    target = dataclasses.replace(target_config(TINY), **FAMILIES[family])
    trees = {"target": jax.eval_shape(lambda: init_params(target, jax.random.key(0)))}
    for kind in DRAFTER_KINDS:
        config = drafter_from_recipe(TINY, kind, target)
        trees[kind] = jax.eval_shape(lambda config=config: init_drafter(config, jax.random.key(1)))
    masked = dataclasses.replace(config, mask_embedding=True)  # a drafter with its own mask-token row
    trees["mask_embedding"] = jax.eval_shape(lambda: init_drafter(masked, jax.random.key(1)))
    assert "mask_embedding" in trees["mask_embedding"]
    mesh = make_mesh("data=1")
    for tree in trees.values():
        for fsdp in (False, True):
            param_shardings(tree, mesh, target.head_dim, fsdp)


def test_an_unmatched_parameter_is_an_error_naming_its_path():
    params = {"layers_0": {"self_attn": {"q_proj": {"kernel": jax.ShapeDtypeStruct((8, 8), "float32")}}}}
    params["layers_0"]["new_gate"] = {"kernel": jax.ShapeDtypeStruct((8, 4), "float32")}
    with pytest.raises(
        ValueError, match=r"no sharding rule for parameter 'layers_0/new_gate/kernel' of shape \(8, 4\)"
    ):
        param_shardings(params, make_mesh("data=1"), head_dim=4)
    with pytest.raises(ValueError, match="REPLICATED_PARAMS"):
        logical_axes("fc/bias", (8,))
    with pytest.raises(ValueError, match="'lm_head' of shape \\(8,\\) does not fit its sharding rule"):
        logical_axes("lm_head", (8,))


@pytest.mark.slow
@pytest.mark.xdist_group("processes")
def test_sharded_decoding_equals_one_device():
    """Greedy plain, H-Spec and DSpark decoding on three 8-device meshes (tests/sharded_run.py) give one device's
    tokens, and the caches and weights are placed as the sharding rules say."""
    script = os.path.join(os.path.dirname(__file__), "sharded_run.py")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, script], capture_output=True, text=True, cwd=root, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    single = results["single"]
    assert set(single) == {"ar", "hspec", "dspark"}
    for method in single:  # each decoder on two meshes, each mesh decoding with two decoders
        assert sum(method in results[mesh] for mesh in MESHES) == 2, method
    for mesh in MESHES:
        decoded = [m for m in single if m in results[mesh]]
        assert len(decoded) == 2, (mesh, decoded)
        for method in decoded:
            assert results[mesh][method] == single[method], (mesh, method)
    assert results["data=8"]["hspec_cache_sharding"] == "P('data',)"
    assert results["data=4,model=2"]["dspark_cache_sharding"] == "P('data', None, 'model')"
    assert results["data=4,model=2"]["q_proj_sharding"] == "P(None, None, 'model')"  # [L, D, N*H]
    assert results["data=2,model=4"]["embedding_sharding"] == "P('model', None)"
    assert jax.device_count() == 1  # the main test process is untouched
