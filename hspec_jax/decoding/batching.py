"""Turning text prompts into a right-padded token batch with per-sequence lengths."""

from __future__ import annotations

import numpy as np


def chat_prompt_ids(tokenizer, text: str, system: str | None = None) -> list[int]:
    """Token ids of a one-turn chat prompt, formatted with the tokenizer's chat template."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    formatted = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(formatted, add_special_tokens=False)["input_ids"])


def pad_batch(sequences: list[list[int]], pad_id: int = 0, length: int | None = None):
    """(tokens `[B, T]` int32 right-padded with `pad_id`, lengths `[B]` int32); T = longest unless given."""
    if not sequences or any(len(s) == 0 for s in sequences):
        raise ValueError("every prompt must have at least one token")
    width = length or max(len(s) for s in sequences)
    if width < max(len(s) for s in sequences):
        raise ValueError(f"a prompt of {max(len(s) for s in sequences)} tokens does not fit in width {width}")
    tokens = np.full((len(sequences), width), pad_id, np.int32)
    for i, seq in enumerate(sequences):
        tokens[i, : len(seq)] = seq
    return tokens, np.asarray([len(s) for s in sequences], np.int32)
