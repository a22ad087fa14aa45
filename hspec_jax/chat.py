"""Chat-template encoding, the one place a conversation becomes token ids with the target's chat template.

Generation prompts (`chat_ids`, `chat_prompt_ids`) end with the assistant generation prompt. Training rows
(`tokenize_conversation`) carry an assistant-only loss mask. Evaluation prompts (`ChatEncoder`) are encoded turn
by turn: turn t of a prompt is the conversation [user 1, assistant 1, ..., user t] where every assistant message is
the model's own earlier answer (as Spec-Bench runs MT-bench), followed by the generation prompt.

Tool definitions go where the chat template expects them: to its `tools=` argument when the template uses one
(Llama 3.1, Qwen3), otherwise (SmolLM2-135M's template ignores tools) into a system message that lists them as JSON
inside <tools></tools> and asks for calls as a JSON list inside <tool_call></tool_call>, the format SmolLM2's
function-calling data uses.

Random targets (`random:<recipe>` in eval.main) have no tokenizer of their own: `ChatEncoder(vocab_size=V)` then
uses the SmolLM2 tokenizer and takes every id modulo V, so the whole pipeline runs on a tiny vocabulary.
"""

from __future__ import annotations

import json

import numpy as np

from hspec_jax.prompts import Prompt

TOOLS_SYSTEM = (
    "You can call the functions defined below as JSON schemas.\n<tools>{tools}</tools>\n"
    "Reply only with the calls that answer the question, as a JSON list inside <tool_call></tool_call>: "
    '[{{"name": "<function name>", "arguments": {{"<parameter>": <value>}}}}].'
)


def render(
    tokenizer, messages: list[dict], add_generation_prompt: bool = False, tools: list[dict] | None = None
) -> str:
    """The text of `messages` (`[{"role", "content"}, ...]`) under the tokenizer's chat template; `tools` (function
    definitions) go to the template's `tools=`."""
    kwargs = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of already-templated text (no special tokens added)."""
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


def chat_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """Token ids of a chat formatted with the tokenizer's chat template, ending with the assistant generation
    prompt (see `render`)."""
    return encode(tokenizer, render(tokenizer, messages, add_generation_prompt=True, tools=tools))


def text_ids(tokenizer, text: str) -> list[int]:
    """Token ids of plain text, with the special tokens the tokenizer adds itself (a prompt without a template)."""
    return list(tokenizer(text)["input_ids"])


def chat_prompt_ids(tokenizer, text: str, system: str | None = None) -> list[int]:
    """Token ids of a one-turn chat prompt, formatted with the tokenizer's chat template."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    return chat_ids(tokenizer, messages)


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
    return with_tools(messages, None if prompt.tools is None else json.loads(prompt.tools), native_tools)


def with_tools(
    messages: list[dict], functions: list[dict] | None, native_tools: bool
) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools for the template) offering `functions` (JSON schemas of functions; None or [] for none):
    to the template's `tools=` when it takes them, else in a system message put first (module docstring)."""
    if not functions:
        return messages, None
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
        return self._folded(chat_ids(self.tokenizer, *conversation(prompt, answers, self.native_tools)))

    def encode_chat(self, messages: list[dict], functions: list[dict] | None = None) -> list[int]:
        """Ids of a chat (`[{"role", "content"}, ...]`, offering `functions`, see `with_tools`) ending with the
        generation prompt, modulo the vocabulary for a folded tokenizer."""
        return self._folded(chat_ids(self.tokenizer, *with_tools(messages, functions, self.native_tools)))

    def encode_text(self, text: str) -> list[int]:
        """Ids of plain text (no chat template; the tokenizer's own special tokens, as `eval.generate --no-chat`)."""
        return self._folded(text_ids(self.tokenizer, text))

    def _folded(self, ids: list[int]) -> list[int]:
        return [i % self.fold for i in ids] if self.fold else ids

    def decode(self, ids) -> str:
        """The text of an answer, special tokens (EOS) dropped."""
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)
