"""Facts about the machine a measurement ran on, printed beside every absolute time."""

from __future__ import annotations

import os
import platform
import time

import jax
import jax.numpy as jnp


def _cpuinfo_fields(cpuinfo: str) -> dict | None:
    """The first processor's `key: value` lines of a /proc/cpuinfo file, or None where there is none."""
    try:
        with open(cpuinfo) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    fields = {}
    for line in lines:
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The x86 feature flags of /proc/cpuinfo (`avx2`, `fma`, `avx512f`, ...); empty where there is no such file."""
    fields = _cpuinfo_fields(cpuinfo)
    return frozenset(fields.get("flags", "").split()) if fields else frozenset()


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU model name from /proc/cpuinfo with its widest x86 vector extension, e.g. "AMD EPYC (AVX2)": virtual
    machines often name only the vendor line, and the same name covers processors whose multi-row products, hence
    a drafting step's cost over a plain step's, differ by half (benchmarks/results/draft_choices.md). The platform's
    processor string where there is no `cpuinfo` file."""
    fields = _cpuinfo_fields(cpuinfo)
    if fields is None:
        return platform.processor() or platform.machine()
    flags = cpu_flags(cpuinfo)
    vector = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else ""
    name = fields.get("model name", "") or platform.processor() or platform.machine()
    return f"{name} ({vector})" if vector else name


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
