"""The OpenAI-compatible server (`python -m hspec_jax.serve`) as a real process on a free loopback port, driven by
the official `openai` client and by raw HTTP: chat and text completions, streamed and not, greedy answers equal to
offline decoding under concurrency, a bounded load test, a full queue (429), a client that disconnects mid-stream,
bad requests (4xx JSON, the server serving on), the Prometheus metrics, and SIGTERM (drained, exit 0).

The fast tests run one server on the tiny random target with a random H-Spec drafter (k = 2); the slow ones one on
the embedded SmolLM2 with the shipped drafter, against `eval.generate`."""

from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import httpx
import jax.numpy as jnp
import numpy as np
import openai
import pytest

from hspec_jax.cli import run
from hspec_jax.decoding import generate, pad_batch
from hspec_jax.target_spec import load_target_spec

ROOT = pathlib.Path(__file__).resolve().parent.parent
READY_SECONDS = 600  # loading, compiling and warming up, on two shared cores
MAX_TOKENS = 12  # the answers compared with offline decoding
LONG = 128  # the server's token limit: a long request
PROMPTS = [
    "Why is the sky blue?",
    "Name three prime numbers.",
    "Write a haiku about the sea.",
    "What is 12 times 7?",
    "Translate 'good morning' into French.",
    "Give me a word that rhymes with cat.",
    "Summarise the plot of Hamlet in one sentence.",
    "List two uses of a paperclip.",
]


class Server:
    """`python -m hspec_jax.serve ARGS --port 0` started and read until it listens (its stderr kept)."""

    def __init__(self, *args: str):
        env = dict(os.environ, HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu")
        command = [sys.executable, "-m", "hspec_jax.serve", *args, "--port", "0", "--compile-cache", ""]
        self.process = subprocess.Popen(command, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.url: str | None = None
        listening = threading.Event()

        def read():
            for line in self.process.stderr:
                self.lines.append(line)
                if line.startswith("listening on "):
                    self.url = line.split()[-1]
                    listening.set()
            listening.set()

        threading.Thread(target=read, daemon=True).start()
        if not listening.wait(READY_SECONDS) or self.url is None:
            self.stop()
            raise AssertionError("the server did not start:\n" + "".join(self.lines[-40:]))
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def metrics(self) -> dict[str, float]:
        """Every sample of `GET /metrics`, by its name and labels as written."""
        text = httpx.get(self.url + "/metrics").text
        return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))}

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.terminate()
        return self.process.wait(60)


def sse_events(response: httpx.Response) -> list:
    """The data of each server-sent event (parsed JSON, or the string "[DONE]")."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


@pytest.fixture(scope="module")
def tiny():
    server = Server(
        *("--target", "random:tiny", "--drafter", "random:hspec", "--k", "2", "--slots", "4", "--max-queue", "12"),
        *("--max-tokens", str(LONG), "--max-prompt-tokens", "128", "--steps-per-iteration", "1"),
        *("--drain-seconds", "1"),
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tiny_target():
    return load_target_spec("random:tiny", None, 0)


@pytest.fixture(scope="module")
def greedy(tiny_target):
    """Plain greedy decoding of one prompt alone, in this process (the reference of the tiny server's answers)."""
    t = tiny_target
    answers = {}

    def answer(prompt_ids, max_new=MAX_TOKENS):
        key = (tuple(prompt_ids), max_new)
        if key not in answers:
            tokens, lengths = pad_batch([list(prompt_ids)], t.pad_id, 128)
            out = generate(
                t.params, t.config, jnp.asarray(tokens), jnp.asarray(lengths), max_new_tokens=max_new,
                eos_ids=t.eos_ids, pad_id=t.pad_id, cache_capacity=128 + LONG,
            )  # fmt: skip
            answers[key] = np.asarray(out.tokens[0, : int(out.num_tokens[0])]).tolist()
        return answers[key]

    return answer


@pytest.fixture(scope="module")
def long_prompt(tiny_target, greedy):
    """A chat whose greedy answer never stops before the server's limit: a request that runs for a while."""
    for text in PROMPTS:
        messages = [{"role": "user", "content": text}]
        ids = tiny_target.encoder.encode_chat(messages)
        if len(greedy(ids, LONG)) == LONG:
            return messages
    pytest.fail("no prompt runs to the token limit")


def chat(server: Server, messages, stream: bool, **kw):
    """(text, token ids, finish reason) of one chat request through the openai client."""
    extra = {"extra_body": {"return_token_ids": True}}
    if not stream:
        r = server.client.chat.completions.create(model="random:tiny", messages=messages, **kw, **extra)
        return r.choices[0].message.content, r.choices[0].token_ids, r.choices[0].finish_reason
    chunks = list(
        server.client.chat.completions.create(model="random:tiny", messages=messages, stream=True, **kw, **extra)
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    ids = [i for c in chunks if c.choices for i in (getattr(c.choices[0], "token_ids", None) or [])]
    return text, ids, chunks[-1].choices[0].finish_reason


def complete(server: Server, prompt, stream: bool, **kw):
    extra = {"extra_body": {"return_token_ids": True}}
    if not stream:
        r = server.client.completions.create(model="random:tiny", prompt=prompt, **kw, **extra)
        return r.choices[0].text, r.choices[0].token_ids, r.choices[0].finish_reason
    chunks = list(server.client.completions.create(model="random:tiny", prompt=prompt, stream=True, **kw, **extra))
    ids = [i for c in chunks for i in (getattr(c.choices[0], "token_ids", None) or [])]
    return "".join(c.choices[0].text for c in chunks), ids, chunks[-1].choices[0].finish_reason


def test_models_health_and_metrics(tiny):
    assert [m.id for m in tiny.client.models.list()] == ["random:tiny"]
    health = httpx.get(tiny.url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert health.json()["slots"] == 4 and health.json()["drafter"] == "random:hspec" and health.json()["k"] == 2
    response = httpx.get(tiny.url + "/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    metrics = tiny.metrics()
    assert metrics["hspec_slots"] == 4 and metrics["hspec_kv_pages"] > 0 and metrics["hspec_slots_in_use"] == 0
    assert 'hspec_spec_draft_length_chosen_total{k="2"}' in metrics


def test_openai_client_greedy_answers_equal_offline_decoding(tiny, tiny_target, greedy):
    """Chat and completions, streamed and not: the greedy answer's token ids are those of decoding the prompt alone,
    the streamed text is the whole text, and the usage counts the tokens."""
    messages = [{"role": "user", "content": PROMPTS[0]}]
    ids = tiny_target.encoder.encode_chat(messages)
    expected = greedy(ids)
    whole = tiny.client.chat.completions.create(
        model="random:tiny", messages=messages, temperature=0, max_tokens=MAX_TOKENS,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    assert whole.prompt_token_ids == ids and whole.choices[0].token_ids == expected
    assert whole.usage.prompt_tokens == len(ids) and whole.usage.completion_tokens == len(expected)
    assert whole.choices[0].message.content == tiny_target.encoder.decode(expected)
    assert whole.choices[0].finish_reason == ("stop" if expected[-1] in tiny_target.eos_ids else "length")
    text, streamed, finish = chat(tiny, messages, True, temperature=0, max_tokens=MAX_TOKENS)
    assert (text, streamed, finish) == (whole.choices[0].message.content, expected, whole.choices[0].finish_reason)
    chunks = list(
        tiny.client.chat.completions.create(
            model="random:tiny", messages=messages, temperature=0, max_tokens=MAX_TOKENS, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected)
    for stream in (False, True):
        text, tokens, _ = complete(tiny, ids, stream, temperature=0, max_tokens=MAX_TOKENS)
        assert tokens == expected and text == tiny_target.encoder.decode(expected)
    plain_text = tiny_target.encoder.encode_text(PROMPTS[1])
    _, tokens, _ = complete(tiny, PROMPTS[1], False, temperature=0, max_tokens=5)
    assert tokens == greedy(plain_text, 5)


def test_tools_and_stop_sequences(tiny, tiny_target, greedy):
    """Tools reach the chat template (SmolLM2's takes none: a system message lists them); a stop sequence ends the
    text before it with finish_reason stop, streamed or not."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    r = tiny.client.chat.completions.create(
        model="random:tiny", messages=messages, tools=tools, temperature=0, max_tokens=4,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    assert r.prompt_token_ids == tiny_target.encoder.encode_chat(messages, [tools[0]["function"]])
    assert r.prompt_token_ids != tiny_target.encoder.encode_chat(messages)
    for text in PROMPTS:  # an answer with a two-character piece first found after its start: the stop sequence
        ids = tiny_target.encoder.encode_chat([{"role": "user", "content": text}])
        full = tiny_target.encoder.decode(greedy(ids, MAX_TOKENS))
        starts = [j for j in range(1, len(full) - 2) if full.find(full[j : j + 2]) == j]
        if starts:
            stop = full[starts[0] : starts[0] + 2]
            break
    else:
        pytest.fail("no answer to cut with a stop sequence")
    for stream in (False, True):
        text, _, finish = complete(tiny, ids, stream, temperature=0, max_tokens=MAX_TOKENS, stop=[stop])
        assert (text, finish) == (full[: full.find(stop)], "stop")


def idle(server: Server) -> dict:
    """The server's metrics once it holds no request: an answer cut by a stop sequence reaches the client before the
    engine lets the request go (and counts it), so a count taken right after one may miss it."""
    deadline = time.monotonic() + 60
    while any((m := server.metrics())[g] for g in ("hspec_slots_in_use", "hspec_queue_depth", "hspec_kv_pages_in_use")):
        assert time.monotonic() < deadline, "the server did not become idle"
        time.sleep(0.05)
    return m


def test_load_every_request_completes_and_equals_offline_decoding(tiny, tiny_target, greedy):
    """64 requests from 16 concurrent clients (chat and completions, streamed and not, greedy and sampled): every
    one is answered (no retries, no 429), the greedy ones exactly as decoded alone."""
    before = idle(tiny)
    prompts = [tiny_target.encoder.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]

    def one(i):
        ids = prompts[i % len(prompts)]
        temperature = 0 if i % 4 else 1.0
        kw = dict(temperature=temperature, max_tokens=MAX_TOKENS, seed=i)
        if i % 2:
            _, tokens, _ = chat(tiny, [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], i % 3 == 0, **kw)
        else:
            _, tokens, _ = complete(tiny, ids, i % 3 == 0, **kw)
        return ids, temperature, tokens

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(64)))
    for ids, temperature, tokens in results:
        assert 1 <= len(tokens) <= MAX_TOKENS
        if temperature == 0:
            assert tokens == greedy(ids)
    after = tiny.metrics()
    served = sum(after[f'hspec_requests_total{{outcome="{o}"}}'] - before[f'hspec_requests_total{{outcome="{o}"}}']
                 for o in ("stop", "length"))  # fmt: skip
    assert served == 64 and after['hspec_requests_total{outcome="rejected"}'] == 0
    assert after["hspec_generation_tokens_total"] - before["hspec_generation_tokens_total"] == sum(
        len(t) for _, _, t in results
    )
    assert after["hspec_slots_in_use"] == 0 and after["hspec_kv_pages_in_use"] == 0


def test_a_full_queue_answers_429_and_the_rest_complete(tiny, long_prompt):
    """Four slots and twelve places in the queue: of 20 long requests sent at once, those beyond 16 get a 429 in
    the OpenAI shape with Retry-After, and so does `eval.serving`'s probe while they run; every accepted one
    completes; the server then serves the next request."""
    from eval.serving import FullQueueProbe

    body = {"messages": long_prompt, "temperature": 0, "max_tokens": LONG}
    barrier = threading.Barrier(21)

    def probe():
        barrier.wait()
        with FullQueueProbe(tiny.url, "random:tiny", [5, 6, 7]) as p:
            time.sleep(0.6)
        return p.answers

    def send(_):
        with httpx.Client(timeout=300) as client:
            barrier.wait()
            started = time.perf_counter()
            response = client.post(tiny.url + "/v1/chat/completions", json=body)
            return response, time.perf_counter() - started

    with concurrent.futures.ThreadPoolExecutor(21) as pool:
        probed = pool.submit(probe)
        results = list(pool.map(send, range(20)))
    assert len(probed.result()) >= 3 and {a.status for a in probed.result()} == {429}
    rejected = [(r, s) for r, s in results if r.status_code == 429]
    accepted = [r for r, _ in results if r.status_code == 200]
    assert len(rejected) + len(accepted) == 20 and rejected and len(accepted) >= 16
    for r, seconds in rejected:
        assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_full"
        print(f"429 answered in {seconds * 1000:.1f} ms")
    assert all(r.json()["usage"]["completion_tokens"] == LONG for r in accepted)
    assert tiny.client.completions.create(model="random:tiny", prompt=[5, 6, 7], max_tokens=2).usage
    rejected_total = tiny.metrics()['hspec_requests_total{outcome="rejected"}']
    assert rejected_total == len(rejected) + len(probed.result())


def test_a_client_that_disconnects_mid_stream_frees_its_slot(tiny, long_prompt):
    before = tiny.metrics()
    body = {"messages": long_prompt, "temperature": 0, "max_tokens": LONG, "stream": True}
    with httpx.Client(timeout=60) as client, client.stream("POST", tiny.url + "/v1/chat/completions", json=body) as r:
        data = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                data.append(line)
                if len(data) == 3:
                    break
    assert len(data) == 3
    deadline = time.monotonic() + 60
    while (m := tiny.metrics())['hspec_requests_total{outcome="cancelled"}'] == before[
        'hspec_requests_total{outcome="cancelled"}'
    ]:
        assert time.monotonic() < deadline, "the disconnect was not noticed"
        time.sleep(0.05)
    assert m["hspec_slots_in_use"] == 0 and m["hspec_kv_pages_in_use"] == 0 and m["hspec_queue_depth"] == 0
    assert m["hspec_generation_tokens_total"] - before["hspec_generation_tokens_total"] < LONG


BAD_REQUESTS = [
    # (path, body (bytes: sent as is), status, the field the error names, words of its message)
    ("/v1/chat/completions", b'{"messages": [', 400, None, "not valid JSON"),
    ("/v1/chat/completions", b"[1, 2]", 400, None, "JSON object"),
    ("/v1/chat/completions", {}, 400, "messages", "Field required"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "at least 1"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages", "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages", "content"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "messages",
        "content",
    ),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature", "valid number"),
    ("/v1/completions", {"prompt": "hi", "temperature": 2.5}, 400, "temperature", "less than or equal to 2"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p", "greater than 0"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "greater than or equal to 1"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "10"}, 400, "max_tokens", "valid integer"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 100000}, 400, "max_tokens", "at most 128"),
    ("/v1/completions", {"prompt": "hi", "seed": 1.5}, 400, "seed", "valid integer"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream", "valid boolean"),
    ("/v1/completions", {"prompt": "hi", "n": 2}, 400, "n", "not supported"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 3}, 400, "logprobs", "not supported"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True}, 400, "logprobs", ""),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 0.5}, 400, "presence_penalty", "not supported"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 1}}, 400, "logit_bias", "not supported"),
    ("/v1/completions", {"prompt": "hi", "echo": True}, 400, "echo", "not supported"),
    ("/v1/completions", {"prompt": "hi", "frobnicate": 1}, 400, "frobnicate", "unrecognized"),
    ("/v1/completions", {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, None, "at most 4"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400, None, "must not be empty"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, None, "stream: true"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, None, "one prompt per request"),
    ("/v1/completions", {"prompt": ""}, 400, None, "must not be empty"),
    ("/v1/completions", {"prompt": [5, 1000]}, 400, "prompt", "vocabulary of 96"),
    ("/v1/completions", {"prompt": [5] * 130}, 400, "prompt", "prompt of 130 tokens exceeds the serving limit of 128"),
    ("/v1/completions", {"prompt": [5] * 1000, "max_tokens": 100}, 400, "prompt", "context of 1024"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model", "does not exist"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
        400,
        "tool_choice",
        "",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "max_completion_tokens": 4},
        400,
        None,
        "disagree",
    ),
]


def test_bad_requests_get_4xx_json_errors_and_the_server_keeps_serving(tiny):
    before = tiny.metrics()['hspec_requests_total{outcome="invalid"}']
    with httpx.Client(timeout=30) as client:
        for path, body, status, param, words in BAD_REQUESTS:
            kw = {"content": body} if isinstance(body, bytes) else {"json": body}
            r = client.post(tiny.url + path, headers={"content-type": "application/json"}, **kw)
            error = r.json()["error"]
            assert r.status_code == status, (body, error)
            assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
            assert error["param"] == param and words in error["message"], (body, error)
        r = client.post(tiny.url + "/v1/completions", json={"prompt": "a" * (5 * 1024**2)})
        assert r.status_code == 413 and "bytes" in r.json()["error"]["message"]
        for method, path, status in (("GET", "/v1/chat/completions", 405), ("POST", "/v1/nowhere", 404)):
            r = client.request(method, tiny.url + path)
            assert r.status_code == status and "message" in r.json()["error"]
        r = client.post(tiny.url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    after = tiny.metrics()['hspec_requests_total{outcome="invalid"}']
    assert after - before == len(BAD_REQUESTS) + 1  # and the 413


def test_metrics_report_latencies_and_speculation(tiny):
    m = tiny.metrics()
    assert m["hspec_time_to_first_token_seconds_count"] > 0 and m["hspec_inter_token_latency_seconds_count"] > 0
    assert m["hspec_prompt_tokens_total"] > 0 and m["hspec_spec_steps_total"] > 0
    assert 1 <= m["hspec_spec_tau"] <= 3
    assert m['hspec_spec_draft_reached_total{position="1"}'] >= m['hspec_spec_draft_reached_total{position="2"}']
    assert 0 <= m['hspec_spec_acceptance_rate{position="1"}'] <= 1
    assert m['hspec_spec_draft_length_chosen_total{k="2"}'] == m["hspec_spec_steps_total"]


def test_eval_serving_drives_the_server_over_http(tiny, tmp_path, capsys):
    """`eval.serving --url`: closed-loop clients at two concurrencies, every request answered, the latencies and the
    server's tau reported; settings the server cannot honour are refused before any work."""
    from eval import serving as eval_serving

    out = tmp_path / "http"
    argv = ["--url", tiny.url, "--tasks", "qa,math", "--requests", "6", "--concurrency", "1,3"]
    assert eval_serving.main([*argv, "--max-new-tokens", "8", "--compile-cache", "", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [(r["method"], r["via"], r["clients"], r["slots"]) for r in rows] == [
        ("random:hspec k=2", "HTTP", 1, 4),
        ("random:hspec k=2", "HTTP", 3, 4),
    ]
    for r in rows:
        assert r["answered"] == 6 and r["refused"] == r["queue_full"] == 0 and 6 <= r["tokens"] <= 48
        assert r["throughput"] > 0
        assert r["ttft_p50"] > 0 and r["itl_p50"] > 0 and 1 <= r["tau"] <= 3
    assert f"| {tiny.url} | 0 | random:hspec k=2 | HTTP | 3 | 4 | 6/6 |" in (out / "report.md").read_text()
    assert run(eval_serving.main, [*argv, "--max-new-tokens", "300", "--out", str(out)]) == 1
    assert "gives at most 128" in capsys.readouterr().err
    assert run(eval_serving.main, [*argv, "--in-process", "--max-new-tokens", "8", "--out", str(out)]) == 1
    assert "with --max-tokens 8" in capsys.readouterr().err
    assert run(eval_serving.main, [*argv, "--rounds", "2", "--max-new-tokens", "8", "--out", str(out)]) == 1
    assert "--rounds alternates the HTTP and the in-process runs" in capsys.readouterr().err


def test_eval_serving_alternates_http_and_in_process_runs(tiny, tmp_path):
    """`--in-process --rounds 2`: the same engine in this process first, then over HTTP, then the other way round;
    each HTTP row carries its round's throughput ratio and the report gives their median."""
    from eval import serving as eval_serving

    out = tmp_path / "rounds"
    argv = ["--url", tiny.url, "--in-process", "--rounds", "2", "--tasks", "qa", "--requests", "4"]
    argv += ["--concurrency", "2", "--max-new-tokens", "128", "--compile-cache", "", "--out", str(out)]
    assert eval_serving.main(argv) == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [(r["round"], r["via"]) for r in rows] == [(0, "in-process"), (0, "HTTP"), (1, "HTTP"), (1, "in-process")]
    assert all(r["answered"] == 4 and r["tokens"] > 0 for r in rows)
    ratios = [r["vs_in_process"] for r in rows if r["via"] == "HTTP"]
    for http, local in ((rows[1], rows[0]), (rows[2], rows[3])):
        assert http["vs_in_process"] == pytest.approx(http["throughput"] / local["throughput"])
    median = f"| {tiny.url} | random:hspec k=2 | 2 | {sum(ratios) / 2:.2f} | {ratios[0]:.2f}, {ratios[1]:.2f} |"
    assert median in (out / "report.md").read_text()


def test_an_http_row_times_the_answers_of_a_full_queue():
    """`eval.serving` over HTTP: 429s count as refused and their latencies (sent -> status) are reported p50 / p99;
    another failure counts as refused only; the probe's 429s are reported apart, its other answers not at all."""
    from eval.serving import Refusal, measure_http

    refusals = [Refusal(429, 0.010), Refusal(500, 2.0), Refusal(429, 0.030)]
    row = measure_http([], refusals, 0.0, {}, {}, [Refusal(429, 0.004), Refusal(200, 0.5), Refusal(429, 0.002)])
    assert (row["requests"], row["answered"], row["refused"], row["queue_full"]) == (3, 0, 3, 2)
    assert row["queue_full_p50"] == pytest.approx(0.020) and 0.029 < row["queue_full_p99"] <= 0.030
    assert row["probe_full"] == 2 and row["probe_full_p50"] == pytest.approx(0.003)


def test_sigterm_finishes_or_cancels_in_flight_requests_and_exits_0(tiny, long_prompt):
    """SIGTERM while a long answer streams: the stream still gets a final event and [DONE], new connections are
    refused, and the process exits 0 (the last test of the module: it stops the module's server)."""
    body = {"messages": long_prompt, "temperature": 0, "max_tokens": LONG, "stream": True}
    events = []
    with httpx.Client(timeout=60) as client, client.stream("POST", tiny.url + "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else json.loads(data))
                if len(events) == 2:
                    tiny.process.send_signal(signal.SIGTERM)
    assert events[-1] == "[DONE]"
    last = events[-2]
    assert "error" in last or last["choices"][0]["finish_reason"] in ("stop", "length"), last
    assert tiny.process.wait(60) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(tiny.url + "/health")


def test_bad_arguments_stop_before_anything_loads(capsys):
    from hspec_jax.serve.__main__ import main

    for argv, words in (
        (["--target", "nowhere"], "neither an embedded model"),
        (["--target", "random:tiny", "--k", "3"], "needs --drafter"),
        (["--target", "random:tiny", "--drafter", "random:nope"], "unknown drafter kind 'nope'"),
        (["--target", "random:tiny", "--max-prompt-tokens", "1000", "--max-tokens", "100"], "context of 1024"),
        (["--target", "random:tiny", "--default-temperature", "3"], "0..2"),
    ):
        assert run(main, [*argv, "--max-prompt-tokens", "64"] if "--max-tokens" not in argv else argv) == 1, argv
        assert words in capsys.readouterr().err, argv


# ---------------------------------------------------------------------------------------------------- SmolLM2


SMOLLM2_TOKENS = 16  # per answer: every step of a verification with drafts of 3 decides a few of them


@pytest.fixture(scope="module")
def smollm2_server():
    server = Server(
        *("--target", "smollm2", "--drafter", "smollm2-hspec", "--k", "3", "--slots", "4", "--max-queue", "8"),
        *("--max-tokens", str(SMOLLM2_TOKENS), "--max-prompt-tokens", "128"),
    )
    yield server
    server.stop()


@pytest.mark.slow
def test_smollm2_greedy_answers_equal_eval_generate(smollm2_server, monkeypatch, capsys):
    """The embedded SmolLM2 with the shipped H-Spec drafter behind the server, its real chat template: every greedy
    answer, alone and at twice as many requests as the server has slots (queued ones join as slots free up),
    streamed or not, is token for token `eval.generate`'s for the same prompt."""
    from eval import generate as eval_generate

    shown = {}

    def time_runs(*args, **kwargs):
        runs = real_time_runs(*args, **kwargs)
        shown["result"] = runs["plain"].shown
        return runs

    real_time_runs = eval_generate.time_runs
    monkeypatch.setattr(eval_generate, "time_runs", time_runs)
    argv = ["--target", "smollm2", "--max-new-tokens", str(SMOLLM2_TOKENS), "--repeats", "0"]
    assert eval_generate.main([*argv, *(x for p in PROMPTS for x in ("--prompt", p))]) == 0
    capsys.readouterr()
    result = shown["result"]
    offline = [row[:n].tolist() for row, n in zip(result.tokens, result.num_tokens, strict=True)]
    server = smollm2_server
    server.client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)

    def ask(i, stream):
        messages = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
        kw = dict(model="smollm2", messages=messages, temperature=0, max_tokens=SMOLLM2_TOKENS)
        extra = {"extra_body": {"return_token_ids": True}}
        if not stream:
            r = server.client.chat.completions.create(**kw, **extra)
            return r.choices[0].token_ids, r.choices[0].message.content
        chunks = list(server.client.chat.completions.create(**kw, stream=True, **extra))
        ids = [t for c in chunks if c.choices for t in (getattr(c.choices[0], "token_ids", None) or [])]
        return ids, "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    alone = [ask(i, i % 2 == 1) for i in range(2)]  # concurrency 1
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda i: ask(i, i % 2 == 0), range(8)))
    for i, (ids, text) in enumerate(alone + together):
        expected = offline[i % len(PROMPTS)] if i < 2 else offline[(i - 2) % len(PROMPTS)]
        assert ids == expected, (i, ids, expected)
        assert text and "<|im_end|>" not in text
    assert server.metrics()["hspec_spec_tau"] >= 1
