"""Qwen3-8B (36 layers): the paper's recipe. Values of the model's config.json."""

from hspec_jax.recipes import recipe

HF_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "torch_dtype": "bfloat16",
}


def get_config():
    return recipe(
        name="Qwen/Qwen3-8B",
        hf_config=HF_CONFIG,
        fusion_layer_ids=(1, 9, 17, 25, 34),
        attn_kv_layer_ids=(17, 25, 34),
        mamba_heads=48,
        fusion_rank=4096,
        mask_token_id=151669,
    )
