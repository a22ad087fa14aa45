"""Paired bootstrap confidence intervals for the relative gain of one method over another.

Both methods ran on the same units (prompts, or batches of prompts). A statistic of the form
sum(num) / sum(den), pooled over units (tau = emitted tokens / steps, throughput = tokens / seconds), gives
method A a relative gain over B of (sum num_a / sum den_a) / (sum num_b / sum den_b) - 1. Each bootstrap resample
draws n units with replacement and applies the SAME draw to both methods (paired), so the variation between
prompts, which both methods share, cancels out of the interval.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Gain(NamedTuple):
    point: float  # the gain on the units themselves
    low: float  # lower end of the confidence interval
    high: float


def ratio_gains(num_a, den_a, num_b, den_b, index: np.ndarray) -> np.ndarray:
    """Relative gain of A over B for each resample: `index [R, n]` unit indices -> `[R]` gains (nan where a
    resample has no steps or seconds at all)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        a = np.asarray(num_a, np.float64)[index].sum(1) / np.asarray(den_a, np.float64)[index].sum(1)
        b = np.asarray(num_b, np.float64)[index].sum(1) / np.asarray(den_b, np.float64)[index].sum(1)
        return a / b - 1.0


def paired_bootstrap(
    num_a, den_a, num_b, den_b, *, resamples: int = 10000, level: float = 0.95, seed: int = 0, chunk: int = 500
) -> Gain:
    """The gain of A over B (per-unit arrays `[n]`) with its percentile bootstrap interval at `level`."""
    n = len(num_a)
    if not n == len(den_a) == len(num_b) == len(den_b):
        raise ValueError("the two methods must be measured on the same units")
    point = float(ratio_gains(num_a, den_a, num_b, den_b, np.arange(n)[None])[0])
    rng = np.random.default_rng(seed)
    gains = np.concatenate(
        [
            ratio_gains(num_a, den_a, num_b, den_b, rng.integers(0, n, (min(chunk, resamples - start), n)))
            for start in range(0, resamples, chunk)
        ]
    )
    low, high = np.quantile(gains, [(1 - level) / 2, (1 + level) / 2])
    return Gain(point, float(low), float(high))
