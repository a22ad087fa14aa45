"""The task recipe (configs/smollm2_tasks.py) for a drafter of about half the shipped one's step time, cut from it
(`train.init_layers`, train/warm_start.py) instead of trained from scratch: six of its eleven sub-layers (the first
Mamba; attention on target layer 14 and its MLP; the last Mamba; attention on target layer 28 and the last MLP) and
its 8192 most frequent draft tokens among the 16384. Same data, held-out sets and schedule as the task recipe, so a
run of each from the shipped drafter compares the two shapes at equal steps (`train.compare_runs`).
"""

from hspec_jax.recipes import load_config


def get_config():
    c = load_config("smollm2_tasks")
    c.drafter.block_pattern = ("mamba", "attn", "mlp", "mamba", "attn", "mlp")
    c.drafter.attn_kv_layer_ids = (14, 28)
    c.drafter.draft_vocab_size = 8192
    c.train.init_layers = "0,3,4,8,9,10"
    return c
