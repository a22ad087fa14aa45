"""Helpers shared by the benchmarks: the prompt set, robust timing, report writing."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

PROMPTS = [
    "Explain in three sentences why the sky is blue.",
    "Write a short Python function that checks whether a number is prime, and explain it.",
    "Give me a recipe for a simple tomato soup.",
    "What are the main differences between a list and a tuple in Python?",
]


def median_time(fn: Callable[[], object], repeats: int = 5) -> float:
    """Median wall time of `fn()` in seconds over `repeats` calls (call it once before to compile/warm up)."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def write_report(path: str, lines: list[str]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {path}")
