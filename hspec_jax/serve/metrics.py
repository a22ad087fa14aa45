"""The server's Prometheus metrics (`GET /metrics`, text format): requests by outcome, tokens in and out, queue
depth, slots and KV pages in use, time to first token and inter-token latency, and the speculative figures: tau,
acceptance by draft position, the draft lengths chosen. One registry per server, so tests can run several."""

from __future__ import annotations

import numpy as np
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

# Outcomes of a request: how its answer ended, or why it got none.
OUTCOMES = ("stop", "length", "cancelled", "shutdown", "invalid", "rejected", "error")
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    """`draft_lengths`: the draft lengths a step may verify (the adaptive policy's choices, 0 a plain step, or the
    fixed k); None for plain decoding (no speculative figures)."""

    def __init__(self, slots: int, draft_lengths: tuple[int, ...] | None):
        disable_created_metrics()  # no `*_created` timestamp beside each counter: the process start says as much
        r = self.registry = CollectorRegistry()
        self.requests = Counter("hspec_requests", "Requests by outcome", ["outcome"], registry=r)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.prompt_tokens = Counter("hspec_prompt_tokens", "Prompt tokens of the requests served", registry=r)
        self.generation_tokens = Counter("hspec_generation_tokens", "Tokens generated and sent", registry=r)
        self.in_flight = Gauge("hspec_requests_in_flight", "Requests accepted and not yet answered", registry=r)
        self.queue_depth = Gauge("hspec_queue_depth", "Requests waiting for a slot", registry=r)
        self.slots_in_use = Gauge("hspec_slots_in_use", "Engine slots holding a request", registry=r)
        Gauge("hspec_slots", "Engine slots (sequences decoded together)", registry=r).set(slots)
        self.kv_pages_in_use = Gauge("hspec_kv_pages_in_use", "KV pool pages held by requests", registry=r)
        self.kv_pages = Gauge("hspec_kv_pages", "KV pool pages (the null page excluded)", registry=r)
        self.ttft = Histogram(
            "hspec_time_to_first_token_seconds", "Request accepted -> first token", buckets=TTFT_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "hspec_inter_token_latency_seconds",
            "Time between tokens (tokens arriving together share the time since the previous ones)",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.draft_lengths = draft_lengths
        if draft_lengths is None:
            return
        self.spec_steps = Counter("hspec_spec_steps", "Verification steps (plain ones included)", registry=r)
        self.spec_accepted = Counter("hspec_spec_accepted_drafts", "Drafted tokens accepted", registry=r)
        self.tau = Gauge("hspec_spec_tau", "Tokens per verification step: (accepted + steps) / steps", registry=r)
        position = ["position"]
        self.reached = Counter(
            "hspec_spec_draft_reached",
            "Steps verifying draft i with every earlier draft accepted",
            position,
            registry=r,
        )
        self.accepted = Counter("hspec_spec_draft_accepted", "Steps accepting draft i", position, registry=r)
        self.acceptance = Gauge(
            "hspec_spec_acceptance_rate", "Acceptance of draft i given every earlier one was", position, registry=r
        )
        self.chosen = Counter(
            "hspec_spec_draft_length_chosen",
            "Steps that verified each draft length (0: a plain step)",
            ["k"],
            registry=r,
        )
        self._totals = {"steps": 0, "accepted": 0}
        self._by_position = np.zeros((2, max(draft_lengths)), np.int64)
        for k in draft_lengths:
            self.chosen.labels(str(k))

    def answered(self, outcome: str, prompt_tokens: int, tokens: int, stats=None) -> None:
        """A request that reached the engine left it: its outcome, tokens, and (draft-and-verify) its statistics
        (`hspec_jax.decoding.speculative.SpecStats`, one row)."""
        self.requests.labels(outcome).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(tokens)
        if stats is None or self.draft_lengths is None:
            return
        steps, accepted = int(stats.steps.sum()), int(stats.accepted.sum())
        self.spec_steps.inc(steps)
        self.spec_accepted.inc(accepted)
        self._totals["steps"] += steps
        self._totals["accepted"] += accepted
        if self._totals["steps"]:
            self.tau.set((self._totals["accepted"] + self._totals["steps"]) / self._totals["steps"])
        reached, accepted_at = stats.reached_at.sum(0), stats.accepted_at.sum(0)
        self._by_position[0, : len(reached)] += reached
        self._by_position[1, : len(accepted_at)] += accepted_at
        for i, (r, a) in enumerate(zip(reached, accepted_at, strict=True)):
            label = str(i + 1)
            self.reached.labels(label).inc(int(r))
            self.accepted.labels(label).inc(int(a))
            if self._by_position[0, i]:
                self.acceptance.labels(label).set(self._by_position[1, i] / self._by_position[0, i])
        for k, n in zip(self.draft_lengths, stats.chosen.sum(0), strict=True):
            self.chosen.labels(str(k)).inc(int(n))

    def refused(self, outcome: str) -> None:
        """A request answered with an error before it reached the engine (`invalid`, `rejected`, `error`)."""
        self.requests.labels(outcome).inc()

    def exposition(self) -> tuple[bytes, str]:
        """(body, content type) of `GET /metrics`."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
