"""Conversations: one message form and text normalisation (chat-template encoding: `hspec_jax.chat`).

A conversation is a list of messages `{"role": "system" | "user" | "assistant", "content": str}` (the OpenAI
`messages` form). `to_messages` converts a record in either the OpenAI or the ShareGPT form
(`conversations: [{"from": "human" | "gpt" | "system", "value": ...}]`) and cleans it.
"""

from __future__ import annotations

import re
import unicodedata

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
