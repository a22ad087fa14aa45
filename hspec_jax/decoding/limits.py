"""Checks a generation request must pass before any weights are loaded: context length, cache length, memory.

Each check raises `InputError` with the numbers involved, so a request that cannot work is refused in one
line instead of producing garbage (positions past the model's context), stopping short without a word
(a cache too small for the new tokens) or allocating until the machine kills the process.
"""

from __future__ import annotations

import math

import jax

from hspec_jax.errors import InputError
from hspec_jax.models.config import TargetConfig
from hspec_jax.models.decoder import param_shapes
from hspec_jax.models.kv_cache import init_cache

GIB = 1024**3


def check_context(config: TargetConfig, longest_prompt: int, max_new_tokens: int) -> None:
    """The prompt and the new tokens must fit in the model's context (`max_position_embeddings`)."""
    needed = longest_prompt + max_new_tokens
    if needed > config.max_position_embeddings:
        raise InputError(
            f"a prompt of {longest_prompt} tokens plus {max_new_tokens} new tokens needs {needed} positions, more "
            f"than the model's context of {config.max_position_embeddings}; shorten the prompt or lower "
            "--max-new-tokens"
        )


def cache_rows(longest_prompt: int, max_new_tokens: int, lookahead: int) -> int:
    """KV cache rows per sequence that let every sequence reach `max_new_tokens`: the prompt, the new tokens,
    and `lookahead` rows a verification block writes past the committed ones (0 for plain decoding)."""
    return longest_prompt + max_new_tokens + lookahead


def check_cache_length(cache_length: int, longest_prompt: int, max_new_tokens: int, lookahead: int) -> None:
    """A cache too short for the request would stop generation early: refuse it instead."""
    needed = cache_rows(longest_prompt, max_new_tokens, lookahead)
    if cache_length < needed:
        extra = f" + {lookahead} rows for a drafted block" if lookahead else ""
        raise InputError(
            f"a KV cache of {cache_length} rows cannot hold a {longest_prompt}-token prompt + {max_new_tokens} new "
            f"tokens{extra}; use a cache length of at least {needed} or fewer new tokens"
        )


def tree_bytes(tree) -> int:
    """Bytes of a pytree of arrays or `jax.eval_shape` shapes."""
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def memory_needed(
    config: TargetConfig, batch: int, capacity: int, prompt_width: int, extra: dict[str, int] | None = None
) -> dict[str, int]:
    """Bytes by part: target weights, KV cache, prefill activations (the largest of a layer's intermediates
    for the whole prompt), plus `extra` parts (e.g. a drafter's weights and cache)."""
    weights = tree_bytes(param_shapes(config))
    cache = tree_bytes(jax.eval_shape(lambda: init_cache(config, batch, capacity)))
    per_token = 4 * config.hidden_size + 2 * (config.num_heads + config.num_kv_heads) * config.head_dim
    per_token += 3 * config.intermediate_size
    activations = batch * prompt_width * per_token * 4 + batch * config.vocab_size * 4
    return {"weights": weights, "KV cache": cache, "prefill activations": activations, **(extra or {})}


def available_memory(devices) -> tuple[int | None, str]:
    """(bytes free for one device's share, what that is): host RAM on CPU, device memory elsewhere."""
    device = devices[0]
    if device.platform == "cpu":
        try:
            with open("/proc/meminfo") as f:
                info = dict(line.split(":", 1) for line in f)
            return int(info["MemAvailable"].split()[0]) * 1024, "available host memory"
        except (OSError, KeyError, ValueError):
            return None, "host memory"
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:
        return None, "device memory"
    return stats["bytes_limit"] - stats.get("bytes_in_use", 0), f"free memory on {device.device_kind}"


def check_memory(needed: dict[str, int], devices) -> None:
    """Refuse a request whose estimated bytes exceed what is free (split evenly over accelerator devices)."""
    available, what = available_memory(devices)
    if available is None:
        return
    total = sum(needed.values())
    share = total if devices[0].platform == "cpu" else total / len(devices)
    if share > available:
        parts = ", ".join(f"{name} {size / GIB:.2f}" for name, size in needed.items() if size)
        raise InputError(
            f"this request needs about {share / GIB:.1f} GiB ({parts} GiB) but only {available / GIB:.1f} GiB of "
            f"{what} is left; lower --max-new-tokens, --cache-length or the batch"
        )
