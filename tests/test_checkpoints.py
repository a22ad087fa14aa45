"""Checkpoint import/export: HF round trips, Orbax, GGUF (with llama.cpp's q/k permutation), strict errors."""

import json
import os

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from conftest import hf_logits, tiny_hf_model

from hspec_jax.checkpoints import (
    CheckpointError,
    export_hf_target,
    load_hf_target,
    load_target,
    restore_target,
    save_target,
)
from hspec_jax.checkpoints.gguf import load_gguf_target, read_gguf
from hspec_jax.models import forward, init_cache, init_params, param_shapes
from hspec_jax.recipes import load_config, target_config

TOKENS = np.array([[4, 8, 15, 16, 23, 42, 2, 61, 33, 9, 70, 5]])


def jax_logits(config, params, tokens=TOKENS):
    return np.asarray(forward(params, config, jnp.asarray(tokens), init_cache(config, 1, tokens.shape[1])).logits)


def test_export_loads_in_transformers_with_same_logits(tiny_hf_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    _, model, path = tiny_hf_dir
    config, params = load_hf_target(path)
    export_hf_target(params, config, str(tmp_path / "export"))
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "export")).eval()
    assert type(reloaded) is type(model)
    np.testing.assert_allclose(
        hf_logits(reloaded, TOKENS).logits.numpy(), jax_logits(config, params), atol=1e-4, rtol=0
    )
    config2, params2 = load_hf_target(str(tmp_path / "export"))  # and back into JAX, bit for bit
    assert config2 == config
    jax.tree.map(np.testing.assert_array_equal, params2, params)


def test_sharded_export_round_trip(tmp_path):
    model = tiny_hf_model("qwen3")
    model.save_pretrained(tmp_path / "src")
    config, params = load_hf_target(str(tmp_path / "src"))
    export_hf_target(params, config, str(tmp_path / "sharded"), max_shard_bytes=60_000)
    files = sorted(os.listdir(tmp_path / "sharded"))
    assert "model.safetensors.index.json" in files and "model-00002-of-" in " ".join(files)
    _, params2 = load_hf_target(str(tmp_path / "sharded"))
    jax.tree.map(np.testing.assert_array_equal, params2, params)


def test_bf16_export(tmp_path):
    from transformers import AutoModelForCausalLM

    model = tiny_hf_model("llama")
    model.save_pretrained(tmp_path / "src")
    config, params = load_hf_target(str(tmp_path / "src"), param_dtype="bfloat16")
    assert params["embed_tokens"]["embedding"].dtype == jnp.bfloat16
    export_hf_target(params, config, str(tmp_path / "bf16"))
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16"))
    assert str(next(reloaded.parameters()).dtype) == "torch.bfloat16"
    _, params2 = load_hf_target(str(tmp_path / "bf16"), param_dtype="bfloat16")
    jax.tree.map(np.testing.assert_array_equal, params2, params)


def test_pytorch_bin_checkpoint(tmp_path):
    import torch

    model = tiny_hf_model("llama")
    (tmp_path / "bin").mkdir()
    model.config.save_pretrained(tmp_path / "bin")
    torch.save({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "bin" / "pytorch_model.bin")
    config, params = load_hf_target(str(tmp_path / "bin"))
    np.testing.assert_allclose(jax_logits(config, params), hf_logits(model, TOKENS).logits.numpy(), atol=1e-4, rtol=0)


def test_orbax_round_trip_is_exact(tmp_path):
    model = tiny_hf_model("qwen3")
    model.save_pretrained(tmp_path / "src")
    config, params = load_hf_target(str(tmp_path / "src"))
    save_target(str(tmp_path / "orbax"), params, config)
    config2, params2 = restore_target(str(tmp_path / "orbax"))
    assert config2 == config
    assert jax.tree.structure(params2) == jax.tree.structure(params)
    jax.tree.map(np.testing.assert_array_equal, params2, params)
    config3, _ = load_target(str(tmp_path / "orbax"))  # the generic loader recognises it
    assert config3 == config


def _write_llama_gguf(model, path):
    """A float32 GGUF of a transformers Llama, written the way llama.cpp's converter does (q/k permuted)."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    def permute(w, heads):
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", sd["model.norm.weight"])
    writer.add_tensor("output.weight", sd["lm_head.weight"])
    names = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        writer.add_tensor(f"blk.{i}.attn_q.weight", permute(sd[p + "self_attn.q_proj.weight"], cfg.num_attention_heads))
        writer.add_tensor(f"blk.{i}.attn_k.weight", permute(sd[p + "self_attn.k_proj.weight"], cfg.num_key_value_heads))
        for hf, gg in names.items():
            writer.add_tensor(f"blk.{i}.{gg}.weight", sd[p + hf + ".weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_import_undoes_llama_qk_permutation(tmp_path):
    model = tiny_hf_model("llama", rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    _write_llama_gguf(model, tmp_path / "tiny.gguf")
    config, params = load_gguf_target(str(tmp_path / "tiny.gguf"))
    assert not config.tie_word_embeddings and config.num_kv_heads == 2
    np.testing.assert_allclose(jax_logits(config, params), hf_logits(model, TOKENS).logits.numpy(), atol=1e-4, rtol=0)


def test_a_gguf_file_is_parsed_once_per_process_until_it_changes(tmp_path):
    """Loading the same GGUF again reuses its parsed metadata; a file written anew at that path is read again."""
    path, rope = tmp_path / "tiny.gguf", {"rope_type": "default", "rope_theta": 1e4}
    _write_llama_gguf(tiny_hf_model("llama", rope_parameters=rope), path)
    assert read_gguf(str(path)) is read_gguf(str(path))
    first = load_gguf_target(str(path))[1]
    other = tiny_hf_model("llama", seed=1, rope_parameters=rope)
    path.unlink()
    _write_llama_gguf(other, path)
    reloaded = load_gguf_target(str(path))[1]
    assert not np.array_equal(first["norm"]["scale"], reloaded["norm"]["scale"])
    np.testing.assert_array_equal(reloaded["norm"]["scale"], other.model.norm.weight.detach().numpy())


def test_dequantized_gguf_weights_are_kept_until_the_file_changes(tmp_path, monkeypatch):
    """The first load dequantizes and stores the weights in the user cache; the next reads them back without
    dequantizing; a file rewritten in place, another dtype, or a damaged entry is dequantized again."""
    from hspec_jax.checkpoints import gguf as gguf_io

    path, rope = tmp_path / "tiny.gguf", {"rope_type": "default", "rope_theta": 1e4}
    _write_llama_gguf(tiny_hf_model("llama", rope_parameters=rope), path)
    dequantized = []
    real = gguf_io.state_dict_from_gguf
    monkeypatch.setattr(gguf_io, "state_dict_from_gguf", lambda *a: dequantized.append(1) or real(*a))
    config, first = load_gguf_target(str(path))
    cached = gguf_io.dequantized_cache_path(str(path), config)
    assert cached.is_file() and len(dequantized) == 1
    _, again = load_gguf_target(str(path))
    assert len(dequantized) == 1
    jax.tree.map(np.testing.assert_array_equal, again, first)
    load_gguf_target(str(path), param_dtype="bfloat16")
    assert len(dequantized) == 2
    cached.write_bytes(b"not safetensors")
    jax.tree.map(np.testing.assert_array_equal, load_gguf_target(str(path))[1], first)
    assert len(dequantized) == 3
    other = tiny_hf_model("llama", seed=1, rope_parameters=rope)
    path.unlink()
    _write_llama_gguf(other, path)
    reloaded = load_gguf_target(str(path))[1]
    assert len(dequantized) == 4
    np.testing.assert_array_equal(reloaded["norm"]["scale"], other.model.norm.weight.detach().numpy())


def test_param_shapes_are_the_initialised_shapes_and_a_fresh_dict_each_call():
    """What strict loading checks against: `init_params`' shapes and dtypes (one layer traced, its shapes repeated;
    sliding-window layers too), computed once per config; a caller that edits the returned dict does not change
    the next caller's."""
    config = target_config(load_config("tiny"))
    layer_types = ("full_attention",) + ("sliding_attention",) * (config.num_layers - 1)
    windowed = config.replace(layer_types=layer_types, sliding_window=8)
    for cfg in (config, windowed):
        params = init_params(cfg, jax.random.key(0))
        shapes = param_shapes(cfg)
        assert jax.tree.map(lambda x: (x.shape, x.dtype), shapes) == jax.tree.map(lambda x: (x.shape, x.dtype), params)
    del shapes["norm"]
    assert "norm" in param_shapes(windowed)


# ----- strict loading: clear errors naming the problem ---------------------------------------------------------


@pytest.fixture
def llama_dir(tmp_path):
    tiny_hf_model("llama").save_pretrained(tmp_path / "m")
    return tmp_path / "m"


def _edit_weights(directory, edit):
    path = directory / "model.safetensors"
    state = safetensors.numpy.load_file(str(path))
    edit(state)
    safetensors.numpy.save_file(state, str(path))


def test_missing_key_is_named(llama_dir):
    _edit_weights(llama_dir, lambda s: s.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing .*'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_hf_target(str(llama_dir))


def test_unknown_key_is_named(llama_dir):
    _edit_weights(llama_dir, lambda s: s.update({"model.layers.0.self_attn.extra.weight": np.zeros(3, np.float32)}))
    with pytest.raises(CheckpointError, match=r"unknown tensor 'model\.layers\.0\.self_attn\.extra\.weight'"):
        load_hf_target(str(llama_dir))


def test_wrong_shape_is_named(llama_dir):
    def shrink(s):
        s["model.layers.2.self_attn.k_proj.weight"] = s["model.layers.2.self_attn.k_proj.weight"][:16]

    _edit_weights(llama_dir, shrink)
    with pytest.raises(
        CheckpointError,
        match=r"'model\.layers\.2\.self_attn\.k_proj\.weight' has shape \(16, 64\), "
        r"expected \(32, 64\)",
    ):
        load_hf_target(str(llama_dir))


def test_unknown_architecture(llama_dir):
    cfg = json.loads((llama_dir / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (llama_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unknown architecture model_type='gpt2'"):
        load_hf_target(str(llama_dir))


def test_bad_paths(tmp_path):
    with pytest.raises(CheckpointError, match="neither an embedded model"):
        load_target(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        load_target(str(tmp_path / "empty"))


def test_export_refuses_non_empty_directory_and_leaves_nothing_half_written(tmp_path):
    model = tiny_hf_model("qwen2")
    model.save_pretrained(tmp_path / "src")
    config, params = load_hf_target(str(tmp_path / "src"))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    with pytest.raises(CheckpointError, match="exists and is not empty"):
        export_hf_target(params, config, str(tmp_path / "out"))
    broken = dict(params)
    broken.pop("norm")
    with pytest.raises(KeyError):
        export_hf_target(broken, config, str(tmp_path / "fresh"))
    assert not (tmp_path / "fresh").exists()
    assert [p for p in os.listdir(tmp_path) if p.startswith(".staging")] == []


def test_outputs_get_the_usual_permissions(tmp_path):
    import stat

    model = tiny_hf_model("qwen3")
    model.save_pretrained(tmp_path / "src")
    config, params = load_hf_target(str(tmp_path / "src"))
    export_hf_target(params, config, str(tmp_path / "out"))
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(tmp_path / "out").st_mode) == 0o777 & ~umask
    assert stat.S_IMODE(os.stat(tmp_path / "out" / "model.safetensors").st_mode) == 0o666 & ~umask
