"""The adaptive policy's cost model: T(k) / T(0) per draft-length choice, measured on this device.

A step's cost depends on the machine (CPU model or accelerator kind), the target, the drafter and its k, the
batch and, a little, the cache size. `step_costs` measures it the first time that shape runs (timing a few steps
of the compiled loop pinned to each choice, `policy.pinned_costs`) and caches the table as JSON under
`$XDG_CACHE_HOME/hspec_jax/costs/` (default `~/.cache/...`), one file per machine and shape, cache sizes bucketed
to powers of two (one table serves every prompt length of a run, not one each).

A table is a measurement: the choices are timed in interleaved rounds (every round visits every choice, the order
rotated), each round gives every choice's time over the plain step's time of the same round, and each choice keeps
the median of its rounds' ratios. A slow spell of the machine then moves both terms of a ratio, a burst of noise
(another process, a page-fault storm after compiling) spoils one round's ratio, which the median drops, and the
estimate does not depend on the number of rounds (a minimum over rounds falls as rounds are added). The readings are
short (`MEASURED_STEPS`) and taken in one running generation (`speculative.measure_costs`), so those of a round are
milliseconds apart: on a 2-core machine whose plain step wandered between 19 and 40 ms from one reading to the
next, 10 rounds of 4 steps kept 5 of 5 first-use tables within 6% of a 30-round reference, where 5 rounds of 8
steps, each reading after its own prefill, had one of 5 28% high (results/cost_tables.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from hspec_jax.kernels import cpu_matmul
from hspec_jax.machine import cpu_model
from hspec_jax.user_cache import user_cache_dir


def machine() -> str:
    """The device the costs hold for: the accelerator kind, or the CPU model on CPU."""
    device = jax.devices()[0]
    if device.platform != "cpu":
        return f"{device.platform}:{device.device_kind}:{jax.device_count()}"
    return f"cpu:{cpu_model()}:{os.cpu_count()}"


# How a table is measured and what the steps it times do (part of its cache key: tables of an earlier method are
# measured again). 4: no reading times a generation that its untimed width-changing step ended
# (speculative.measure_costs).
METHOD = 4


def cache_path(shape: dict) -> Path:
    """The JSON file for this machine, `shape` (plain JSON-able values naming target, drafter, batch, ...) and
    measuring `METHOD`."""
    key = json.dumps({"machine": machine(), "method": METHOD, **shape}, sort_keys=True)
    return user_cache_dir("costs") / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"


def engine_shape(target, drafter, sampling, batch: int, capacity: int, params) -> dict:
    """What a step's cost depends on besides the machine: the configs (by digest), the layout of the placed
    `params` (their tree's structure: fused, per-layer or packed for the CPU kernel run at different speeds), the
    packed kernel's path on this CPU (`cpu_matmul.kernel_path`), batch and cache rows."""
    digest = lambda config: hashlib.sha256(repr(config).encode()).hexdigest()[:16]
    return {
        "target": digest(target),
        "drafter": digest(drafter),
        "layout": digest(jax.tree.structure(params)),
        "matmul_kernel": cpu_matmul.kernel_path() if jax.default_backend() == "cpu" else None,
        "sampling": repr(sampling),
        "batch": batch,
        "capacity_bucket": 1 << max(capacity - 1, 1).bit_length(),
    }


def relative(seconds) -> np.ndarray:
    """Seconds per step `[R, C]` (R rounds, each a time for every increasing choice; choice 0 = a plain step) ->
    costs `[C]`: per choice the median over rounds of its time over the same round's plain step. A longer draft
    never costs less than a shorter one (it verifies more rows, after drafting): a measurement that says otherwise
    is noise and is raised to the shorter draft's cost."""
    seconds = np.asarray(seconds, np.float64)
    if seconds.ndim != 2 or seconds.shape[1] < 2 or not np.all(seconds > 0):
        raise ValueError(f"need a positive time per round and choice, got {seconds}")
    ratios = np.median(seconds / seconds[:, :1], axis=0)
    return np.maximum.accumulate(ratios).astype(np.float32)


ROUNDS = 10  # interleaved rounds of a measurement (results/cost_tables.md)


def interleaved(count: int, measure: Callable[[int], float], rounds: int) -> list[list[float]]:
    """`[rounds][count]` readings `measure(i) -> seconds` of every choice, the rounds interleaved (round r visits the
    choices starting from r mod count)."""
    readings = [[0.0] * count for _ in range(rounds)]
    for r in range(rounds):
        for i in (*range(r % count, count), *range(r % count)):
            readings[r][i] = measure(i)
    return readings


def step_costs(shape: dict, choices: tuple[int, ...], measure: Callable[[int], float]) -> np.ndarray:
    """The cost table `[C]` for `choices` on this machine and `shape`: read from the cache, else measured with
    `measure(choice_index) -> seconds per step` in `ROUNDS` interleaved rounds (`interleaved`, `relative`) and
    written there."""
    path = cache_path({**shape, "choices": list(choices)})
    if path.exists():
        record = json.loads(path.read_text())
        return np.asarray(record["costs"], np.float32)
    seconds = interleaved(len(choices), measure, ROUNDS)  # read at call time: eval.cost_tables sets it
    costs = relative(seconds)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"machine": machine(), **shape, "choices": list(choices), "seconds": seconds, "costs": costs.tolist()}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(path)
    return costs


MEASURED_STEPS = 4  # steps per timed run (fewer than a policy's probe_every, so a pinned plain run never probes)


def time_steps(
    start: Callable[[], tuple], run: Callable[[tuple], tuple], repeats: int = 2, warm_up: bool = True
) -> float:
    """Seconds per loop step: the fastest of `repeats` runs of `run(start())` (start untimed; the carry's first
    element is the loop state, whose `step` counts the steps run), after one untimed warm-up if `warm_up`."""
    best = float("inf")
    for attempt in range(repeats + warm_up):
        carry = jax.block_until_ready(start())
        first = int(carry[0].step)
        began = time.perf_counter()
        carry = jax.block_until_ready(run(carry))
        elapsed = time.perf_counter() - began
        if attempt or not warm_up:
            best = min(best, elapsed / max(int(carry[0].step) - first, 1))
    return best
