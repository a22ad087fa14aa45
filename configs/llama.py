"""Llama-3.1-8B-Instruct (32 layers, llama3 RoPE scaling): the paper's recipe. Values of its config.json."""

from hspec_jax.recipes import recipe

HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "torch_dtype": "bfloat16",
}


def get_config():
    # The tokenizer fills the whole vocabulary, so the mask token is a reserved special token
    # (<|reserved_special_token_0|>), as the reference's fallback order allows.
    return recipe(
        name="meta-llama/Llama-3.1-8B-Instruct",
        hf_config=HF_CONFIG,
        fusion_layer_ids=(1, 8, 15, 22, 30),
        attn_kv_layer_ids=(15, 22, 30),
        mamba_heads=56,
        fusion_rank=4096,
        mask_token_id=128002,
    )
