"""SmolLM2-135M-Instruct, the embedded target (30 layers, hidden 576): the paper's recipe scaled down.

Taps and KV layers follow the paper's spacing (first four evenly from layer 1, the last at L-2); the Mamba
width is 8 heads x 64 (the paper uses 0.75-1.1x the hidden size); the mask token is <empty_output> (id 16),
a special token chat prompts never contain. The vocabulary-sized heads are scaled too, since at this width
they would otherwise dominate the drafter: draft vocabulary 16384 of 49152 tokens (the paper keeps
21-25% of its targets' vocabularies; 33% here) and Markov rank 64 (256 at hidden 4096; 576/4096 * 256 = 36).
"""

import os

from hspec_jax.recipes import recipe

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")

HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}


def get_config():
    c = recipe(
        name="HuggingFaceTB/SmolLM2-135M-Instruct (GGUF Q4_1, embedded)",
        path="smollm2",
        hf_config=HF_CONFIG,
        fusion_layer_ids=(1, 8, 14, 21, 28),
        attn_kv_layer_ids=(14, 21, 28),
        mamba_heads=8,
        fusion_rank=576,
        mask_token_id=16,
        draft_vocab_size=16384,
        markov_rank=64,
    )
    # Target-written text only (data/README.md): the target's own answers to ShareGPT first turns (the growing
    # `smollm2_sharegpt_v2.jsonl`) and to Magpie-style instructions it wrote, weighted about by their sizes (each
    # conversation is drawn about equally often). Held out: 64 more ShareGPT prompts it answered, never trained on
    # (a training conversation sharing a prompt with them is dropped), measured every `eval_every` steps.
    sharegpt = os.path.join(DATA, "smollm2_sharegpt_v2.jsonl")
    magpie = os.path.join(DATA, "smollm2_magpie.jsonl")
    c.data.sources = f"regen={sharegpt}:10,magpie={magpie}:1"
    c.data.held_out = os.path.join(DATA, "smollm2_heldout.jsonl")
    # All 7 packed batches the held-out set fills (64 conversations, 11,517 assistant tokens).
    c.data.held_out_batches = 7
    # Sized for the 2-core CPU machine: 4 packed rows of 1024 tokens and 128 anchors each per step.
    c.data.seq_len = 1024
    c.data.max_anchors = 128
    c.train.batch_size = 4
    c.train.anchors_per_chunk = 32
    c.train.num_steps = 3000
    c.train.checkpoint_every = 50
    c.train.eval_every = 100
    return c
