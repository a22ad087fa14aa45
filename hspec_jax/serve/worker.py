"""The engine thread: the only code that touches the serving engine (and so the device).

HTTP handlers run on the event loop; they hand requests over as `Job`s (`EngineWorker.submit`) and take them back
(`cancel`), both through an inbox the engine thread reads between two scheduling iterations. The thread loops:
apply what the inbox holds, run one `ServingEngine.step` while requests are queued or running (it sleeps on a
condition otherwise), and pass each request's tokens to its job's event queue as the engine commits them. A
request's own token limit is enforced here, between steps: the request is cancelled there and then, so its slot
and pages are free for the next step, like those of a request whose client went away.

A job's events, in order: ("tokens", ids) any number of times, then one ("end", finish_reason, error): finish_reason
"stop" (its last token is a stop id) or "length", or error an `APIError` when the server gave up on it (shutting
down, or the engine failed).
"""

from __future__ import annotations

import asyncio
import threading
import time
import traceback
from collections.abc import Callable

import numpy as np

from hspec_jax.decoding import Bundle
from hspec_jax.serve.metrics import Metrics
from hspec_jax.serve.protocol import APIError
from hspec_jax.serving import Completion, Request, ServingConfig, ServingEngine


class Job:
    """One request on its way through the engine: created on the event loop, fed by the engine thread."""

    def __init__(self, request: Request, max_tokens: int, loop: asyncio.AbstractEventLoop):
        self.request, self.max_tokens, self.loop = request, max_tokens, loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.accepted = time.perf_counter()
        # Engine-thread side.
        self.sent = 0
        self.last_time: float | None = None
        self.last_token: int | None = None

    def put(self, *event) -> None:
        """Hand an event to the handler (from the engine thread)."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class EngineWorker:
    """Owns a `ServingEngine` and the thread that drives it (see the module docstring)."""

    def __init__(self, bundle: Bundle, config: ServingConfig, metrics: Metrics, costs=None):
        self.metrics = metrics
        self.eos_ids = set(config.eos_ids)
        self.engine = ServingEngine(bundle, config, costs=costs, on_tokens=self._on_tokens)
        metrics.kv_pages.set(self.engine.allocator.usable)
        self.jobs: dict[str, Job] = {}
        self.failed: str | None = None  # why the engine thread stopped, if it failed
        self._inbox: list[Callable[[], None]] = []
        self._wake = threading.Condition()
        self._stopping = False
        self._at_limit: list[str] = []
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    # ------------------------------------------------------------------ from any thread

    def warm_up(self, prompt: tuple[int, ...]) -> None:
        """Compile the engine's programs with one request served to its end (before `start`)."""
        if self.engine.submit(Request("warm-up", prompt)) is None:
            while self.engine.busy:
                self.engine.step()
        self.engine.reset_counters()

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        self._post(lambda: self._submit(job))

    def cancel(self, request_id: str, outcome: str, error: APIError | None = None) -> None:
        """Take a request out (at the next scheduling point); `error`: the final event its handler still awaits."""
        self._post(lambda: self._cancel(request_id, outcome, error))

    def cancel_queued(self, outcome: str, error: APIError) -> None:
        """Take out every request still waiting for a slot."""
        self._post(lambda: [self._cancel(r.id, outcome, error) for r, _, _ in list(self.engine.queue)])

    def cancel_all(self, outcome: str, error: APIError) -> None:
        self._post(lambda: [self._cancel(i, outcome, error) for i in list(self.jobs)])

    def stop(self, timeout: float | None = None) -> None:
        """Cancel whatever is left (a final error event each) and end the thread."""
        self.cancel_all("shutdown", APIError(503, "the server is shutting down"))
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ------------------------------------------------------------------ the engine thread

    def _post(self, command: Callable[[], None]) -> None:
        with self._wake:
            self._inbox.append(command)
            self._wake.notify()

    def _run(self) -> None:
        try:
            while True:
                with self._wake:
                    while not self._inbox and not self.engine.busy and not self._stopping:
                        self._wake.wait()
                    commands, self._inbox = self._inbox, []
                for command in commands:
                    command()
                if self._stopping and not self.engine.busy:
                    return
                if self.engine.busy:
                    finished = self.engine.step()
                    for completion in finished:
                        self._finish(completion.request.id, completion)
                    for request_id in self._at_limit:  # reached their own token limit: out before the next step
                        self._finish(request_id, None)
                    self._at_limit.clear()
                self._gauges()
        except Exception:  # a bug: answer every request, and say so on /health
            self.failed = traceback.format_exc(limit=5)
            error = APIError(500, "the engine failed; see the server's log")
            for job in self.jobs.values():
                job.put("end", None, error)
            self.jobs.clear()
            raise

    def _submit(self, job: Job) -> None:
        refused = self.engine.submit(job.request)
        if refused is not None:  # the handler checks first; kept as a guard
            self.metrics.answered("invalid", 0, 0)
            job.put("end", None, APIError(400, refused.refused))
            return
        self.jobs[job.request.id] = job

    def _cancel(self, request_id: str, outcome: str, error: APIError | None) -> None:
        job = self.jobs.pop(request_id, None)
        if job is None:
            return  # already finished
        completion = self.engine.cancel(request_id)
        self._answered(job, outcome, completion)
        if error is not None:
            job.put("end", None, error)

    def _on_tokens(self, request: Request, tokens: np.ndarray) -> None:
        job = self.jobs.get(request.id)
        if job is None:
            return
        tokens = tokens[: job.max_tokens - job.sent]
        if not len(tokens):
            return
        now = time.perf_counter()
        if job.last_time is None:
            self.metrics.ttft.observe(now - job.accepted)
        else:
            for _ in range(len(tokens)):
                self.metrics.itl.observe((now - job.last_time) / len(tokens))
        job.sent += len(tokens)
        job.last_time, job.last_token = now, int(tokens[-1])
        job.put("tokens", tokens)
        if job.sent >= job.max_tokens:
            self._at_limit.append(request.id)

    def _finish(self, request_id: str, completion: Completion | None) -> None:
        """End a request that stopped (EOS, the engine's limit) or reached its own limit (`completion` None: it is
        cancelled now)."""
        job = self.jobs.pop(request_id, None)
        if job is None:
            return
        if completion is None:
            completion = self.engine.cancel(request_id)
        reason = "stop" if job.last_token in self.eos_ids else "length"
        self._answered(job, reason, completion)
        job.put("end", reason, None)

    def _answered(self, job: Job, outcome: str, completion: Completion | None) -> None:
        stats = None if completion is None else completion.stats
        self.metrics.answered(outcome, len(job.request.prompt), job.sent, stats)

    def _gauges(self) -> None:
        m, engine = self.metrics, self.engine
        m.queue_depth.set(len(engine.queue))
        m.slots_in_use.set(engine.running)
        m.kv_pages_in_use.set(engine.allocator.used)
