"""The SmolLM2 recipe (configs/smollm2.py) trained on the task-shaped data beside the chat mix (data/README.md):
the committed parts of the eight families' target-written conversations (`smollm2_tasks_v1_part*.jsonl`, every part
present when the config is read, with its number of records: `train.main` refuses to resume a work directory
started before a part was committed or grew, naming `data.sources`; start a new `--workdir`), the ShareGPT
regeneration and the Magpie conversations. Each source is weighted by its number of conversations, so every
conversation is drawn about equally often. Held out: the task-shaped held-out set (40 prompts per family, none
shared with a training prompt), measured overall and per family every `eval_every` steps; its first 8 prompts drive
the real-tau check. Fine-tunes the shipped drafter.
"""

import glob
import os

from hspec_jax.recipes import load_config

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
CHAT = {"regen": "smollm2_sharegpt_v2.jsonl", "magpie": "smollm2_magpie.jsonl"}
TASK_PARTS = "smollm2_tasks_v1_part*.jsonl"


def conversations(path: str) -> int:
    """The number of records (non-empty lines) of a JSONL file. Reading it as text splits lines at line breaks only,
    never inside a record (JSON escapes them in strings); not `train.jsonl`'s splitter, since recipes load with only
    `hspec_jax` installed."""
    with open(path, encoding="utf-8") as f:
        return sum(1 for line in f if line.strip())


def get_config():
    c = load_config("smollm2")
    files = {name: os.path.join(DATA, file) for name, file in CHAT.items()}
    for path in sorted(glob.glob(os.path.join(DATA, TASK_PARTS))):
        files["tasks" + os.path.basename(path).removesuffix(".jsonl").rsplit("part", 1)[1]] = path
    c.data.sources = ",".join(f"{name}={path}:{conversations(path)}" for name, path in files.items())
    c.data.held_out = os.path.join(DATA, "smollm2_tasks_heldout.jsonl")
    # 318 conversations, 96,874 tokens: about 24 packed batches of 4 x 1024; 2 batches per family (~40 conversations).
    c.data.held_out_batches = 24
    c.data.held_out_family_batches = 2
    c.train.init_from = "smollm2-hspec"
    return c
