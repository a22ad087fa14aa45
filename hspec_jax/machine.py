"""Facts about the machine a measurement ran on, printed beside every absolute time."""

from __future__ import annotations

import os
import platform
import time

import jax
import jax.numpy as jnp


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo (the platform's processor string where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def read_bandwidth_gbs(repeats: int = 20) -> float:
    """Peak read bandwidth of the default device in GB/s: the fastest of `repeats` XLA reductions over a 512 MiB
    fp32 array (the machine is shared and noisy; the best run is the least disturbed one)."""
    x = jnp.ones((128 * 1024 * 1024,), jnp.float32)
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        total(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return x.nbytes / 1e9 / best


def machine_facts(dtype, bandwidth: bool = True) -> dict:
    """CPU model, core count, backend and its devices, jax version, compute dtype and (optionally, ~1 s) measured
    read bandwidth."""
    facts = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "backend": jax.default_backend(),
        "devices": ", ".join(sorted({d.device_kind for d in jax.devices()})),
        "jax": jax.__version__,
        "dtype": jnp.dtype(dtype).name,
    }
    if bandwidth:
        facts["read_bandwidth_gbs"] = round(read_bandwidth_gbs(), 1)
    return facts
