"""Conversations: one message form, text normalisation, and chat rendering with an assistant-only loss mask.

A conversation is a list of messages `{"role": "system" | "user" | "assistant", "content": str}` (the OpenAI
`messages` form). `to_messages` converts a record in either the OpenAI or the ShareGPT form
(`conversations: [{"from": "human" | "gpt" | "system", "value": ...}]`) and cleans it.
"""

from __future__ import annotations

import re
import unicodedata

import numpy as np

ROLES = ("system", "user", "assistant")
# ShareGPT speaker names (and a few aliases found in public dumps) -> role.
ROLE_ALIASES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
}

_SPACES = re.compile(r"\s+")


def normalize_text(text: str) -> str:
    """The form used to compare prompts: Unicode NFKC, casefolded, every whitespace run collapsed to one space,
    and leading/trailing whitespace and punctuation (Unicode categories P*) stripped.

    `normalize_text("  Hello,\\n  World! ") == "hello, world"`."""
    text = _SPACES.sub(" ", unicodedata.normalize("NFKC", text).casefold())
    start, end = 0, len(text)
    while start < end and _is_edge(text[start]):
        start += 1
    while end > start and _is_edge(text[end - 1]):
        end -= 1
    return text[start:end]


def _is_edge(char: str) -> bool:
    return char.isspace() or unicodedata.category(char).startswith("P")


def to_messages(record: dict) -> list[dict] | None:
    """The cleaned messages of a record in OpenAI (`messages`) or ShareGPT (`conversations`) form, or None when
    nothing usable is left. Cleaning: unknown speakers or empty contents drop the message; assistant messages
    before the first user message are dropped (a system message may stay first); a conversation without a user
    message is unusable."""
    if record.get("messages") is not None:
        raw = [(m.get("role"), m.get("content")) for m in record["messages"]]
    elif record.get("conversations") is not None:
        raw = [(m.get("from"), m.get("value")) for m in record["conversations"]]
    else:
        raise ValueError(f"record has neither 'messages' nor 'conversations': keys {sorted(record)}")
    messages = []
    for speaker, content in raw:
        role = ROLE_ALIASES.get(str(speaker).lower())
        if role is None or not isinstance(content, str) or not content.strip():
            continue
        if role == "system" and messages:
            continue
        if role == "assistant" and not any(m["role"] == "user" for m in messages):
            continue
        messages.append({"role": role, "content": content})
    return messages if any(m["role"] == "user" for m in messages) else None


def user_texts(messages: list[dict]) -> list[str]:
    return [m["content"] for m in messages if m["role"] == "user"]


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def tokenize_conversation(tokenizer, messages: list[dict], end_of_turn: int | None = None):
    """(ids `[T]` int32, loss_mask `[T]` bool): the conversation rendered by the tokenizer's chat template, with
    exactly the assistant tokens supervised, each turn's end-of-turn token (`end_of_turn`, default the tokenizer's
    EOS, `<|im_end|>` for ChatML) included.

    For each assistant message i the template renders the prompt `messages[:i]` with the generation prompt and
    the full `messages[:i + 1]`; the text between is the assistant's. Each piece of text is tokenized on its own,
    exactly as at inference, where the prompt is tokenized and the answer's tokens are generated after it. What
    the template appends after the end-of-turn token (ChatML: a newline) is not supervised: generation stops
    at the end-of-turn token, so a drafter never has to predict it. Messages after the last assistant message
    are dropped. Raises ValueError if the template is not prefix-stable or an assistant turn lacks the
    end-of-turn token."""
    end_of_turn = tokenizer.eos_token_id if end_of_turn is None else end_of_turn
    ids, mask, done_text = [], [], ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(tokenizer, messages[:i], add_generation_prompt=True)
        full = render(tokenizer, messages[: i + 1])
        if not prompt.startswith(done_text) or not full.startswith(prompt):
            raise ValueError(f"the chat template does not render message {i} as an extension of the previous ones")
        context = encode(tokenizer, prompt[len(done_text) :])
        answer = encode(tokenizer, full[len(prompt) :])
        if end_of_turn not in answer:
            raise ValueError(f"the chat template closes assistant turns without the end-of-turn token {end_of_turn}")
        supervised = len(answer) - answer[::-1].index(end_of_turn)
        ids += context + answer
        mask += [False] * len(context) + [True] * supervised + [False] * (len(answer) - supervised)
        done_text = full
    return np.asarray(ids, np.int32), np.asarray(mask, bool)
