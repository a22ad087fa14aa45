"""A smaller H-Spec drafter for SmolLM2 (configs/smollm2.py), tried for the CPU where the drafter's step time
counts against its acceptance: two Mamba / attention / MLP rounds instead of the paper's four Mamba, three
attention and four MLP sub-layers; an MLP half as wide (768); a draft vocabulary half as large (8192 tokens);
attention over the target's KV of layers 14 and 28. Everything else (taps, Mamba width, seeding, Markov head,
data and optimiser) is SmolLM2's. Compared with it at an equal budget in benchmarks/results/recipes_smollm2/.
"""

from hspec_jax.recipes import load_config


def get_config():
    c = load_config("smollm2")
    c.drafter.block_pattern = ("mamba", "attn", "mlp", "mamba", "attn", "mlp")
    c.drafter.attn_kv_layer_ids = (14, 28)
    c.drafter.intermediate_size = 768
    c.drafter.draft_vocab_size = 8192
    return c
