"""The HTTP layer: a Starlette app whose handlers check a request, hand it to the engine thread and stream its
tokens back; they never touch the device.

Per generation request: parse and check the body (`protocol`: 400 for malformed JSON, wrong types, out-of-range
values, unsupported fields), encode the prompt (chat template with tools, plain text, or token ids), check it fits
(the model's context, the engine's prompt limit and KV pool: 400 naming the limit and the numbers), refuse it with a
429 and `Retry-After` when the queue is full (counted here, without waiting for the engine), then submit it and
either stream server-sent events (one chunk per burst of committed tokens, `data: [DONE]` last) or answer once.
A client that goes away has its request cancelled: its slot and pages are free for the engine's next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Callable
from typing import NamedTuple

import anyio
from jinja2 import TemplateError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from hspec_jax.chat import ChatEncoder
from hspec_jax.serve.metrics import Metrics
from hspec_jax.serve.protocol import (
    DONE,
    APIError,
    ChatRequest,
    CompletionRequest,
    parse_json,
    parse_request,
    sse,
    usage,
)
from hspec_jax.serve.protocol import (
    Response as Answer,
)
from hspec_jax.serve.worker import EngineWorker, Job
from hspec_jax.serving import Request

log = logging.getLogger("hspec_jax.serve")
SEED_MODULUS = 2**32  # request seeds are taken modulo this (a PRNG key holds 32 bits of seed)
MAX_BODY_BYTES = 4 * 1024**2  # larger request bodies get a 413


class Served(NamedTuple):
    """What the handlers need to know about the model and the engine."""

    model: str  # the model id clients name
    encoder: ChatEncoder  # tokenizer and chat template (ids folded into a random target's vocabulary)
    context: int  # the model's context (positions)
    max_tokens: int  # the most new tokens per request (the engine's)
    default_temperature: float  # for requests that give none (OpenAI's default: 1)
    max_waiting: int  # requests accepted beyond the engine's slots before a 429
    info: dict  # settings shown on /health


class TextStream:
    """A request's text as its tokens arrive: the new text of each burst, holding back an incomplete character
    and any tail that may be the start of a stop sequence; `stopped` once a stop sequence appears (the text ends
    before it)."""

    def __init__(self, decode: Callable[[list[int]], str], stops: tuple[str, ...]):
        self.decode, self.stops = decode, stops
        self.ids: list[int] = []
        self.text, self.sent, self.stopped = "", 0, False

    def add(self, ids) -> str:
        self.ids += [int(i) for i in ids]
        text = self.decode(self.ids)
        if not text.startswith(self.text[: self.sent]):
            return ""  # a later token changed how earlier ones read: wait until it settles
        self.text = text
        for stop in self.stops:
            at = text.find(stop, max(0, self.sent - len(stop)))
            if at != -1:
                self.text, self.stopped = text[:at], True
        ready = len(self.text) if self.stopped else self._settled()
        delta, self.sent = self.text[self.sent : ready], max(self.sent, ready)
        return delta

    def finish(self) -> str:
        """The text held back, at the end."""
        delta, self.sent = self.text[self.sent :], len(self.text)
        return delta

    def _settled(self) -> int:
        """How much of the text can be sent: not a trailing replacement character (half a UTF-8 sequence), nor a
        tail that begins a stop sequence."""
        end = len(self.text.rstrip("\ufffd"))
        for stop in self.stops:
            for n in range(min(len(stop) - 1, end), 0, -1):
                if self.text[:end].endswith(stop[:n]):
                    end -= n
                    break
        return max(end, self.sent)


class EventStream(StreamingResponse):
    """A streamed response that notices a client going away whatever the ASGI version (it listens for the
    disconnect while it streams) and always runs `on_close` at the end, however it ends."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream():
                    with contextlib.suppress(OSError):
                        await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            self.on_close()


class Frontend:
    """The handlers and their shared state (in-flight count, draining), around one `EngineWorker`."""

    def __init__(self, worker: EngineWorker, served: Served, metrics: Metrics):
        self.worker, self.served, self.metrics = worker, served, metrics
        self.in_flight = 0
        self.draining = False
        self.capacity = worker.engine.config.slots + served.max_waiting
        self._ids = itertools.count()

    # ------------------------------------------------------------------ routes

    def app(self) -> Starlette:
        routes = [
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics_text, methods=["GET"]),
        ]
        handlers = {APIError: self._api_error, HTTPException: self._http_error, Exception: self._server_error}
        return Starlette(routes=routes, exception_handlers=handlers)

    async def chat_completions(self, request: HTTPRequest) -> Response:
        return await self._generate(request, "chat")

    async def completions(self, request: HTTPRequest) -> Response:
        return await self._generate(request, "completion")

    async def models(self, request: HTTPRequest) -> Response:
        card = {"id": self.served.model, "object": "model", "created": 0, "owned_by": "hspec-jax"}
        return JSONResponse({"object": "list", "data": [card]})

    async def health(self, request: HTTPRequest) -> Response:
        if self.worker.failed:
            return JSONResponse({"status": "failed", "error": self.worker.failed}, status_code=500)
        status = "draining" if self.draining else "ok"
        return JSONResponse({"status": status} | self.served.info, status_code=503 if self.draining else 200)

    async def metrics_text(self, request: HTTPRequest) -> Response:
        self.metrics.in_flight.set(self.in_flight)
        body, content_type = self.metrics.exposition()
        return Response(body, media_type=content_type)

    # ------------------------------------------------------------------ shutting down (SIGTERM)

    def drain(self, grace: float) -> None:
        """Stop accepting requests, cancel the queued ones now and the running ones after `grace` seconds, each
        with a final error event (runs on the event loop)."""
        if self.draining:
            return
        self.draining = True
        error = APIError(503, "the server is shutting down")
        self.worker.cancel_queued("shutdown", error)
        asyncio.get_running_loop().call_later(grace, self.worker.cancel_all, "shutdown", error)

    # ------------------------------------------------------------------ generation

    async def _generate(self, request: HTTPRequest, kind: str) -> Response:
        try:
            if self.draining or self.worker.failed:
                raise APIError(503, "the server is shutting down" if self.draining else "the engine failed")
            params = parse_request(
                parse_json(await self._body(request)), ChatRequest if kind == "chat" else CompletionRequest
            )
            if params.model is not None and params.model != self.served.model:
                raise APIError(
                    404,
                    f"the model {params.model!r} does not exist; this server serves {self.served.model!r}",
                    param="model",
                    code="model_not_found",
                )
            if self.in_flight >= self.capacity:
                raise APIError(
                    429,
                    f"the queue is full ({self.served.max_waiting} requests waiting beyond "
                    f"{self.worker.engine.config.slots} slots); retry later",
                    code="queue_full",
                    headers={"Retry-After": "1"},
                )
            prompt = self._prompt(params, kind)
            job = self._job(params, prompt, "messages" if kind == "chat" else "prompt")
        except APIError as e:
            self.metrics.refused("rejected" if e.status == 429 else "invalid" if e.status < 500 else "error")
            raise
        self.in_flight += 1
        self.worker.submit(job)
        answer = Answer(kind, self.served.model)
        text = TextStream(self.served.encoder.decode, params.stops())
        closed = []

        def close(outcome: str = "cancelled") -> None:
            """The request's end on this side: cancel it if the engine still holds it (once)."""
            if not closed:
                closed.append(outcome)
                self.in_flight -= 1
                if outcome != "done":
                    self.worker.cancel(job.request.id, outcome)

        if params.stream:
            return EventStream(self._events(job, params, answer, text, close), on_close=close)
        try:
            return await self._whole(request, job, params, answer, text, close)
        finally:
            close()

    async def _body(self, request: HTTPRequest) -> bytes:
        """The request body, refused with a 413 past `MAX_BODY_BYTES` (read no further: tokenizing megabytes would
        hold up the event loop, and no prompt the engine takes is that long)."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            raise APIError(413, f"the request body has {declared} bytes, more than this server's {MAX_BODY_BYTES}")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_BODY_BYTES:
                raise APIError(413, f"the request body is over this server's {MAX_BODY_BYTES} bytes")
        return bytes(body)

    def _prompt(self, params, kind: str) -> list[int]:
        """The prompt's token ids, checked against the context, the engine's limits and the vocabulary."""
        encoder, limit = self.served.encoder, self.served.max_tokens
        max_tokens = params.max_tokens or getattr(params, "max_completion_tokens", None) or limit
        if max_tokens > limit:
            raise APIError(
                400,
                f"max_tokens is {max_tokens}; this server generates at most {limit} tokens per request",
                param="max_tokens",
            )
        if kind == "chat":
            try:
                ids = encoder.encode_chat([m.for_template() for m in params.messages], params.functions())
            except (TemplateError, ValueError, TypeError) as e:  # e.g. roles out of the order the template wants
                raise APIError(400, f"messages: the model's chat template refused them: {e}", param="messages") from e
        elif isinstance(params.prompt, str):
            ids = encoder.encode_text(params.prompt)
        else:
            ids = list(params.prompt)
        if len(ids) + max_tokens > self.served.context:
            raise APIError(
                400,
                f"the prompt has {len(ids)} tokens and max_tokens is {max_tokens}: {len(ids) + max_tokens} positions, "
                f"more than the model's context of {self.served.context}",
                param="messages" if kind == "chat" else "prompt",
                code="context_length_exceeded",
            )
        params.max_tokens = max_tokens
        return ids

    def _job(self, params, prompt: list[int], prompt_field: str) -> Job:
        temperature = self.served.default_temperature if params.temperature is None else params.temperature
        number = next(self._ids)
        seed = (number if params.seed is None else params.seed) % SEED_MODULUS
        request = Request(f"r{number}", tuple(prompt), seed, temperature, params.top_p)
        reason = self.worker.engine.refusal(request)
        if reason is not None:
            raise APIError(400, f"cannot serve this request: {reason}", param=prompt_field)
        return Job(request, params.max_tokens, asyncio.get_running_loop())

    async def _events(self, job: Job, params, answer: Answer, text: TextStream, close) -> AsyncIterator[bytes]:
        """The server-sent events of a streamed request; a failure on the way (a bug) ends them with an error
        event instead of a broken connection."""
        try:
            async for event in self._stream(job, params, answer, text, close):
                yield event
        except Exception as e:
            log.exception("error while streaming %s", job.request.id)
            self.metrics.refused("error")
            yield sse(APIError(500, f"internal error: {type(e).__name__}").body())
            yield DONE

    async def _stream(self, job: Job, params, answer: Answer, text: TextStream, close) -> AsyncIterator[bytes]:
        options = params.stream_options
        continuous = options is not None and options.continuous_usage_stats
        prompt_tokens, sent = len(job.request.prompt), 0
        if answer.kind == "chat":
            yield sse(answer.chunk("", role=True))
        while True:
            event = await job.events.get()
            if event[0] == "tokens":
                ids = event[1]
                sent += len(ids)
                delta = text.add(ids)
                counts = usage(prompt_tokens, sent) if continuous else None
                token_ids = ids if params.return_token_ids else None
                if delta or continuous or token_ids is not None:
                    yield sse(answer.chunk(delta, counts=counts, token_ids=token_ids))
                if not text.stopped:
                    continue
                close("stop")
                finish = "stop"
            else:
                _, finish, error = event
                if error is not None:
                    close("done")
                    yield sse(error.body())
                    yield DONE
                    return
                close("done")
            rest = text.finish()
            counts = usage(prompt_tokens, sent)
            yield sse(answer.chunk(rest or None, finish, counts=counts if continuous else None))
            if options is not None and options.include_usage:
                yield sse(answer.usage_chunk(counts))
            yield DONE
            return

    async def _whole(self, request: HTTPRequest, job: Job, params, answer: Answer, text: TextStream, close):
        """Wait for the whole answer (a client that goes away meanwhile cancels it)."""
        gone = asyncio.ensure_future(_disconnected(request))
        ids: list[int] = []
        try:
            while True:
                event = asyncio.ensure_future(job.events.get())
                await asyncio.wait({event, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not event.done():
                    event.cancel()
                    return Response(status_code=499)  # nobody reads it: the client went away
                event = event.result()
                if event[0] == "tokens":
                    ids += [int(i) for i in event[1]]
                    text.add(event[1])
                    if text.stopped:
                        close("stop")
                        finish = "stop"
                        break
                    continue
                _, finish, error = event
                close("done")
                if error is not None:
                    raise error
                break
        finally:
            gone.cancel()
        token_ids = (job.request.prompt, ids) if params.return_token_ids else None
        counts = usage(len(job.request.prompt), len(ids))
        return JSONResponse(
            answer.whole(text.text if text.stopped else text.text + text.finish(), finish, counts, token_ids)
        )

    # ------------------------------------------------------------------ errors

    async def _api_error(self, request: HTTPRequest, e: APIError) -> Response:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    async def _http_error(self, request: HTTPRequest, e: HTTPException) -> Response:
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    async def _server_error(self, request: HTTPRequest, e: Exception) -> Response:
        log.exception("error while answering %s", request.url.path)
        self.metrics.refused("error")
        return JSONResponse(APIError(500, f"internal error: {type(e).__name__}").body(), status_code=500)


async def _disconnected(request: HTTPRequest) -> None:
    """Returns when the client goes away (the body has been read: what comes next is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
