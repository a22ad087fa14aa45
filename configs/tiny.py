"""A tiny random Qwen3-style target and drafters, for tests and quick CPU runs (no weights needed; training
reads text through a character tokenizer)."""

from hspec_jax.recipes import recipe

HF_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def get_config():
    c = recipe(
        name="tiny random qwen3",
        hf_config=HF_CONFIG,
        fusion_layer_ids=(1, 2, 3, 4, 5),
        attn_kv_layer_ids=(2, 3, 4),
        mamba_heads=4,
        fusion_rank=64,
        mask_token_id=3,
        draft_vocab_size=64,
    )
    c.drafter.mamba.head_dim = 16
    c.drafter.mamba.n_groups = 2
    c.drafter.markov_rank = 16
    c.drafter.sliding_window = 32
    c.target.path = "tiny"  # the random tiny target with a character tokenizer (train/targets.py)
    c.data.seq_len = 256
    c.data.max_anchors = 32
    c.data.held_out_prompts = 4
    c.train.num_steps = 50
    c.train.batch_size = 4
    c.train.anchors_per_chunk = 16
    c.train.learning_rate = 3e-3
    c.train.checkpoint_every = 25
    c.train.eval_every = 25
    c.train.eval_max_new_tokens = 16
    return c
