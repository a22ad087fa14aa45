"""An OpenAI-compatible HTTP server over the continuous-batching serving engine.

    python -m hspec_jax.serve --target smollm2 --drafter smollm2-hspec --k auto --host 127.0.0.1 --port 8000

Endpoints: `POST /v1/chat/completions` and `POST /v1/completions` (streamed as server-sent events with `"stream":
true`, ending in `data: [DONE]`), `GET /v1/models`, `GET /health` (the engine's settings; 503 while shutting down),
`GET /metrics` (Prometheus). Any OpenAI client works against it, e.g. `openai.OpenAI(base_url=
"http://127.0.0.1:8000/v1", api_key="none")`.

`--target`, `--drafter` and `--k` take what `eval.generate` takes (and `--target random:<recipe>`, as `eval.main`):
one engine of `--slots` sequences serves every connection, its jitted steps on a thread of their own; a request joins
a free slot between two steps and streams its tokens as they are committed. Each request brings its own
`temperature` (default `--default-temperature`, OpenAI's 1), `top_p`, `seed` (it seeds the first token; later draws
also depend on the batch a request shares, as OpenAI's own "best effort") and `max_tokens` (at most `--max-tokens`);
a request at temperature 0 gets exactly the greedy answer of `eval.generate`. Every slot has room for its longest
request (`--max-prompt-tokens` + `--max-tokens`), so no request is ever preempted. Beyond the slots, `--max-queue`
requests wait; more get a 429 with `Retry-After`. A client that disconnects has its request cancelled, its slot and
pages free for the next step. SIGTERM stops accepting requests, cancels the queued ones, lets the running ones
finish for up to `--drain-seconds`, cancels the rest (each with a final error event) and exits 0.

The engine's programs are compiled (and, with `--k auto`, its step costs measured or read from the cache) before the
server listens; it then prints `listening on http://HOST:PORT` on stderr (with `--port 0`, the port it got).
"""

from __future__ import annotations

import contextlib
import signal
import sys

from hspec_jax.checkpoints import resolve
from hspec_jax.cli import (
    AUTO,
    DEFAULT_COMPILE_CACHE,
    MAX_K,
    ArgumentParser,
    add_drafter_arguments,
    non_negative_float,
    non_negative_int,
    positive_int,
    run,
    use_compile_cache,
)
from hspec_jax.errors import InputError
from hspec_jax.target_spec import RANDOM

DEFAULT_WARM_UP = "Hello!"


def parse_args(argv: list[str] | None = None):
    parser = ArgumentParser(prog="python -m hspec_jax.serve", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--target", default="smollm2", help="smollm2, an HF dir, a .gguf, an Orbax dir, random:<recipe>"
    )
    add_drafter_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    parser.add_argument("--port", type=non_negative_int, default=8000, help="port (0: any free one)")
    parser.add_argument("--model-name", default=None, help="the model id clients name (default: --target)")
    parser.add_argument("--slots", type=positive_int, default=8, help="sequences decoded together")
    parser.add_argument("--max-queue", type=non_negative_int, default=64, help="requests waiting beyond the slots")
    parser.add_argument("--max-tokens", type=positive_int, default=256, help="most new tokens per request")
    parser.add_argument("--max-prompt-tokens", type=positive_int, default=1024, help="longest prompt accepted")
    parser.add_argument("--page-size", type=positive_int, default=16, help="rows per KV page")
    parser.add_argument("--prefill-chunk", type=positive_int, default=128, help="prompt tokens per prefill call")
    parser.add_argument("--steps-per-iteration", type=positive_int, default=4, help="decoding steps per scheduling")
    parser.add_argument(
        "--default-temperature", type=non_negative_float, default=1.0, help="for requests without one (OpenAI's: 1)"
    )
    parser.add_argument("--seed", type=int, default=0, help="engine sampling seed (and random weights)")
    parser.add_argument("--drain-seconds", type=non_negative_float, default=30.0, help="SIGTERM: time to finish")
    parser.add_argument(
        "--compile-cache", default=DEFAULT_COMPILE_CACHE, help="persistent XLA compilation cache directory, '' for none"
    )
    parser.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))
    return parser.parse_args(argv)


def check_args(args) -> None:
    """Every check that needs no weights: the target and drafter specs, argument combinations."""
    from hspec_jax.drafter_spec import check_drafter_spec
    from hspec_jax.target_spec import read_target_spec_config

    if args.k is not None and args.drafter is None:
        raise InputError("--k sets the drafted tokens per step: it needs --drafter")
    if isinstance(args.k, int) and args.k > MAX_K:
        raise InputError(f"--k must be in 1..{MAX_K}, got {args.k}")
    if args.recipe is not None and args.drafter is None:
        raise InputError("--recipe builds random:<kind> drafters: it needs --drafter random:<kind>")
    if args.default_temperature > 2:
        raise InputError(
            f"--default-temperature must be in 0..2 (as the API's temperature), got {args.default_temperature}"
        )
    if not args.target.startswith(RANDOM):
        resolve(args.target)
    context = read_target_spec_config(args.target).max_position_embeddings
    if args.max_prompt_tokens + args.max_tokens > context:
        raise InputError(
            f"--max-prompt-tokens {args.max_prompt_tokens} plus --max-tokens {args.max_tokens} is "
            f"{args.max_prompt_tokens + args.max_tokens} positions, more than the model's context of {context}"
        )
    if args.drafter is not None:
        check_drafter_spec(args.drafter, args.target, args.recipe)


def build(args):
    """Load the model(s), build and warm up the engine -> (worker, frontend)."""
    from hspec_jax.decoding import Bundle, SamplingConfig
    from hspec_jax.decoding.policy import drafting
    from hspec_jax.drafter_spec import drafter_config, load_drafter
    from hspec_jax.serve.app import Frontend, Served
    from hspec_jax.serve.metrics import Metrics
    from hspec_jax.serve.worker import EngineWorker
    from hspec_jax.serving import ServingConfig, engine_costs
    from hspec_jax.target_spec import load_target_spec

    target = load_target_spec(args.target, args.recipe, args.seed)
    warm = target.encoder.encode_chat([{"role": "user", "content": DEFAULT_WARM_UP}])
    policy, draft_lengths, bundle = None, None, Bundle(target.params, target.config)
    if args.drafter is not None:
        k = args.k if isinstance(args.k, int) else AUTO
        drafter, policy = drafting(drafter_config(args.drafter, target.config, target.recipe), k)
        params, vocab = load_drafter(args.drafter, drafter, target.params, [warm])
        bundle = Bundle(target.params, target.config, params, drafter, vocab)
        draft_lengths = policy.choices if policy else (drafter.num_drafts,)
    config = ServingConfig(
        slots=args.slots,
        page_size=args.page_size,
        max_prompt_tokens=args.max_prompt_tokens,
        max_new_tokens=args.max_tokens,
        prefill_chunk=args.prefill_chunk,
        steps_per_iteration=args.steps_per_iteration,
        eos_ids=tuple(target.eos_ids),
        pad_id=target.pad_id,
        seed=args.seed,
        policy=policy,
        per_request_sampling=True,
    )
    costs = None
    if policy is not None:
        costs = engine_costs(bundle, policy, args.slots, warm, args.max_tokens, SamplingConfig(), args.seed)
    metrics = Metrics(args.slots, draft_lengths)
    worker = EngineWorker(bundle, config, metrics, costs)
    worker.warm_up(tuple(warm))
    info = {
        "model": args.model_name or args.target,
        "target": args.target,
        "drafter": args.drafter,
        "k": None if args.drafter is None else (args.k if isinstance(args.k, int) else AUTO),
        "slots": args.slots,
        "max_queue": args.max_queue,
        "max_tokens": args.max_tokens,
        "max_prompt_tokens": args.max_prompt_tokens,
        "page_size": args.page_size,
        "prefill_chunk": args.prefill_chunk,
        "steps_per_iteration": args.steps_per_iteration,
        "kv_pages": worker.engine.allocator.usable,
        "costs": None if costs is None else [round(float(c), 4) for c in costs],  # --k auto: T(k) / T(0) per choice
        "seed": args.seed,
    }
    served = Served(
        model=info["model"],
        encoder=target.encoder,
        context=target.config.max_position_embeddings,
        max_tokens=args.max_tokens,
        default_temperature=args.default_temperature,
        max_waiting=args.max_queue,
        info=info,
    )
    return worker, Frontend(worker, served, metrics)


def serve(args, worker, frontend) -> None:
    """Listen until SIGTERM (drained, then a clean return) or Ctrl-C."""
    import asyncio

    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if sig == signal.SIGTERM and not self.should_exit:  # runs on the event loop's thread, between two steps
                asyncio.get_running_loop().call_soon_threadsafe(frontend.drain, args.drain_seconds)
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            """uvicorn's, except that a SIGTERM it shut down for is not raised again afterwards: exit status 0."""
            handled = (signal.SIGINT, signal.SIGTERM)
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
            if signal.SIGINT in self._captured_signals:
                signal.raise_signal(signal.SIGINT)

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                host, port = self.servers[0].sockets[0].getsockname()[:2]
                print(f"listening on http://{host}:{port}", file=sys.stderr, flush=True)

    config = uvicorn.Config(
        frontend.app(),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        timeout_graceful_shutdown=int(args.drain_seconds) + 10,
        lifespan="off",
    )
    worker.start()
    try:
        Server(config).run()
    finally:
        worker.stop(timeout=60)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_args(args)
    use_compile_cache(args.compile_cache)
    worker, frontend = build(args)
    serve(args, worker, frontend)
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
