"""The OpenAI API's request and response shapes, as far as this server implements them.

A request body is checked in three passes, each failure a 400 in the OpenAI error shape that names the field:
JSON that does not parse; fields the API has and this server does not implement (`n > 1`, `logprobs`, penalties,
...; `UNSUPPORTED`: accepted only at their neutral value, never silently ignored); then types and ranges
(`ChatRequest`, `CompletionRequest`: strict pydantic models, an unknown field is an error too). What passes becomes
a `Generation`: the prompt still as messages or text, the sampling settings and the token limit.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

# API fields this server does not implement -> the values that mean "not used" (accepted, and then without effect).
UNSUPPORTED: dict[str, tuple] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "suffix": (None, ""),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}),
    "parallel_tool_calls": (None, True),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "functions": (None, []),
    "function_call": (None, "auto"),
    "store": (None, False),
    "service_tier": (None, "auto", "default"),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
}
MAX_STOP = 4  # stop sequences per request (the OpenAI API's limit)
MAX_TEMPERATURE = 2.0
# Parts of a pydantic error location that name a union member's type, not a field.
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


class APIError(Exception):
    """An error answered in the OpenAI shape: `{"error": {"message", "type", "param", "code"}}`."""

    TYPES: ClassVar[dict[int, str]] = {
        400: "invalid_request_error",
        404: "invalid_request_error",
        413: "invalid_request_error",
        429: "rate_limit_error",
        503: "server_error",
    }

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None, headers=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        kind = self.TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's extension: the usage so far in every chunk


class _Sampling(_Strict):
    """The fields both endpoints share."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user identifier: no effect here
    return_token_ids: bool = False  # vLLM's extension: the prompt's and the answer's token ids in the response

    @model_validator(mode="after")
    def _check(self):
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > MAX_STOP:
            raise ValueError(f"stop: at most {MAX_STOP} sequences, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop: sequences must not be empty")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed with stream: true")
        return self

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def for_template(self) -> dict:
        """The message as chat templates take it (text parts joined, `developer` as `system`)."""
        content = self.content if not isinstance(self.content, list) else "".join(p.text for p in self.content)
        message = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        for extra in ("name", "tool_calls", "tool_call_id"):
            if getattr(self, extra) is not None:
                message[extra] = getattr(self, extra)
        return message


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none"] | None = None

    @model_validator(mode="after")
    def _one_limit(self):
        a, b = self.max_tokens, self.max_completion_tokens
        if a is not None and b is not None and a != b:
            raise ValueError(f"max_tokens ({a}) and max_completion_tokens ({b}) disagree: give one of them")
        return self

    def functions(self) -> list[dict] | None:
        """The tools' function schemas for the chat template (none with `tool_choice: none`)."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.function.model_dump(exclude_none=True) for t in self.tools]


class CompletionRequest(_Sampling):
    # One prompt: text or token ids (a list holding one of them is taken too; several prompts are not).
    prompt: str | list[int] | list[str] | list[list[int]]

    @model_validator(mode="after")
    def _one_prompt(self):
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            if len(p) != 1:
                raise ValueError(f"prompt: one prompt per request is supported, got {len(p)}")
            self.prompt = p[0]
        if isinstance(self.prompt, str | list) and not self.prompt:
            raise ValueError("prompt: must not be empty")
        return self


def parse_json(body: bytes) -> dict:
    """The request body as a JSON object (400 otherwise)."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    return data


def _is_neutral(value, neutral: tuple) -> bool:
    """Whether `value` is one of `neutral` (a boolean only as itself: true is not 1)."""
    same = lambda v: value is v if isinstance(value, bool) or isinstance(v, bool) else value == v
    return any(same(v) for v in neutral)


def _without_neutral(data: dict) -> dict:
    """`data` minus the unimplemented fields at their neutral values; 400 naming any other use of them."""
    for name, neutral in UNSUPPORTED.items():
        if name in data and not _is_neutral(data[name], neutral):
            shown = json.dumps(data[name])[:80]
            raise APIError(400, f"{name} is not supported by this server (got {shown}); leave it out", param=name)
    return {k: v for k, v in data.items() if k not in UNSUPPORTED}


def _validation_error(e: ValidationError) -> APIError:
    error = e.errors()[0]
    loc = [str(x) for x in error["loc"] if not (isinstance(x, str) and (x in _TYPE_TAGS or "[" in x))]
    field = ".".join(loc)
    if error["type"] == "extra_forbidden":
        return APIError(400, f"unrecognized request field {field!r}", param=field or None)
    message = error["msg"].removeprefix("Value error, ")
    return APIError(400, f"{field}: {message}" if field else message, param=loc[0] if loc else None)


def parse_request(data: dict, schema: type[_Sampling]) -> _Sampling:
    """A checked `ChatRequest` or `CompletionRequest` from a JSON object (400 with the first problem otherwise)."""
    try:
        return schema.model_validate(_without_neutral(data))
    except ValidationError as e:
        raise _validation_error(e) from None


# ---------------------------------------------------------------------------------------------------- responses


def new_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class Response:
    """The response objects of one request (`kind` "chat" or "completion"), whole or as stream chunks."""

    def __init__(self, kind: str, model: str):
        self.kind, self.model = kind, model
        self.id, self.created = new_id(kind), int(time.time())

    def _envelope(self, chunk: bool) -> dict:
        obj = "text_completion"
        if self.kind == "chat":
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _choice(self, text: str | None, finish_reason: str | None, chunk: bool, role: bool = False) -> dict:
        if self.kind == "chat":
            if chunk:
                delta = {"role": "assistant"} if role else {}
                if text is not None:
                    delta["content"] = text
                return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            message = {"role": "assistant", "content": text}
            return {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}

    def whole(self, text: str, finish_reason: str, counts: dict, token_ids=None) -> dict:
        """The non-streamed response (`token_ids`: (prompt ids, answer ids) when asked for)."""
        body = self._envelope(False) | {"choices": [self._choice(text, finish_reason, False)], "usage": counts}
        if token_ids is not None:
            body["prompt_token_ids"] = [int(t) for t in token_ids[0]]
            body["choices"][0]["token_ids"] = [int(t) for t in token_ids[1]]
        return body

    def chunk(self, text: str | None, finish_reason: str | None = None, counts=None, role=False, token_ids=None):
        """One stream chunk (`counts`: the usage so far, `token_ids`: this chunk's answer ids, when asked for)."""
        body = self._envelope(True) | {"choices": [self._choice(text, finish_reason, True, role)]}
        if counts is not None:
            body["usage"] = counts
        if token_ids is not None:
            body["choices"][0]["token_ids"] = [int(t) for t in token_ids]
        return body

    def usage_chunk(self, counts: dict) -> dict:
        """The last chunk with `stream_options.include_usage`: no choices, the usage."""
        return self._envelope(True) | {"choices": [], "usage": counts}


def sse(data: dict | str) -> bytes:
    """One server-sent event."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


DONE = sse("[DONE]")
