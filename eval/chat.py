"""Evaluation prompts as token ids: the target's chat template, turn by turn, with tool definitions.

Turn t of a prompt is the conversation [user 1, assistant 1, ..., user t] where every assistant message is the
model's own earlier answer (as Spec-Bench runs MT-bench), followed by the generation prompt.

Tool definitions go where the chat template expects them: to its `tools=` argument when the template uses one
(Llama 3.1, Qwen3), otherwise (SmolLM2-135M's template ignores tools) into a system message that lists them as JSON
inside <tools></tools> and asks for calls as a JSON list inside <tool_call></tool_call>, the format SmolLM2's
function-calling data uses.

Random targets (`random:<recipe>` in eval.main) have no tokenizer of their own: `ChatEncoder(vocab_size=V)` then
uses the SmolLM2 tokenizer and takes every id modulo V, so the whole pipeline runs on a tiny vocabulary.
"""

from __future__ import annotations

import json

from eval.prompts import Prompt
from hspec_jax.decoding import chat_ids

TOOLS_SYSTEM = (
    "You can call the functions defined below as JSON schemas.\n<tools>{tools}</tools>\n"
    "Reply only with the calls that answer the question, as a JSON list inside <tool_call></tool_call>: "
    '[{{"name": "<function name>", "arguments": {{"<parameter>": <value>}}}}].'
)


def template_takes_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders a `tools=` argument."""
    return "tools" in (tokenizer.chat_template or "")


def conversation(prompt: Prompt, answers: list[str], native_tools: bool) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools for the template) of turn `len(answers)` of `prompt`, answers being the model's own."""
    if len(answers) >= len(prompt.turns):
        raise ValueError(f"prompt {prompt.id} has {len(prompt.turns)} turns; {len(answers)} are answered")
    messages = []
    for user, answer in zip(prompt.turns, answers, strict=False):
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    messages.append({"role": "user", "content": prompt.turns[len(answers)]})
    if prompt.tools is None:
        return messages, None
    functions = json.loads(prompt.tools)
    if native_tools:
        return messages, [{"type": "function", "function": f} for f in functions]
    return [{"role": "system", "content": TOOLS_SYSTEM.format(tools=json.dumps(functions))}, *messages], None


class ChatEncoder:
    """Token ids of evaluation prompts for one target, and the text of its answers."""

    def __init__(self, tokenizer, vocab_size: int | None = None):
        self.tokenizer = tokenizer
        self.fold = vocab_size if vocab_size is not None and vocab_size < len(tokenizer) else None
        self.native_tools = template_takes_tools(tokenizer)

    def encode(self, prompt: Prompt, answers: list[str]) -> list[int]:
        """Ids of turn `len(answers)` (see `conversation`), modulo the vocabulary for a folded tokenizer."""
        ids = chat_ids(self.tokenizer, *conversation(prompt, answers, self.native_tools))
        return [i % self.fold for i in ids] if self.fold else ids

    def decode(self, ids) -> str:
        """The text of an answer, special tokens (EOS) dropped."""
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)
