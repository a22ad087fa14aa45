"""KV-cache bytes per token: the target's, each drafter's own, and the inflation the drafter causes.

    python -m eval.memory                                   # the paper's three targets
    python -m eval.memory --target qwen3_8b --target path/to/config.json --dtype bfloat16

`--target` takes a recipe name from configs/ (llama, qwen3_4b, qwen3_8b, smollm2, tiny) or any Hugging Face
`config.json` (nested `text_config` included). Only attention layers (full or sliding) hold per-token KV;
other layer types (linear attention, Mamba, ...) hold O(1) state and count 0. Drafter caches:
H-Spec and "DFlash + target-KV reuse" read the target's cache and hold none; DFlash/DSpark hold K and V
for every context token in each of their layers (target KV geometry, `--dflash-layers`, default 5).
"""

from __future__ import annotations

import os
import sys

import jax.numpy as jnp

from hspec_jax.checkpoints.hf import read_json
from hspec_jax.cli import ArgumentParser, float_dtype, positive_int, run
from hspec_jax.errors import InputError
from hspec_jax.models.config import hf_size
from hspec_jax.recipes import load_config, recipe_names

PAPER_TARGETS = ("llama", "qwen3_4b", "qwen3_8b")
KV_LAYER_TYPES = ("full_attention", "sliding_attention", "attention")


def text_config(hf: dict) -> dict:
    """The language-model part of a (possibly multimodal) config.json."""
    return hf.get("text_config", hf)


def attention_geometry(hf: dict) -> tuple[int, int]:
    """(KV heads, head dim) of the attention layers."""
    hf = text_config(hf)
    heads = hf_size(hf, "num_attention_heads")
    kv_heads = hf_size(hf, "num_key_value_heads", required=False) or heads
    return kv_heads, hf_size(hf, "head_dim", required=False) or hf_size(hf, "hidden_size") // heads


def kv_layers(hf: dict) -> int:
    """How many of the target's layers keep per-token K/V."""
    hf = text_config(hf)
    layers = hf_size(hf, "num_hidden_layers")
    types = hf.get("layer_types")
    if types is None:
        return layers
    if not isinstance(types, list) or len(types) != layers:
        raise ValueError(f"layer_types must list one type per layer ({layers})")
    return sum(t in KV_LAYER_TYPES for t in types)


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    return layers * 2 * kv_heads * head_dim * dtype_bytes


def load_hf_config(spec: str) -> tuple[str, dict]:
    """(display name, config.json dict) for a recipe name or file, or a config.json path."""
    if os.path.isfile(spec) and not spec.endswith(".py"):
        return spec, read_json(spec)
    if not os.path.exists(spec) and spec not in recipe_names():
        raise InputError(f"--target {spec!r} is neither a config.json file nor a recipe ({', '.join(recipe_names())})")
    recipe = load_config(spec)
    return recipe.target.name, recipe.target.hf_config.to_dict()


def memory_rows(hf: dict, dtype_bytes: int, dflash_layers: int) -> list[tuple[str, int, int]]:
    """[(method, target bytes/token, drafter bytes/token)] for one target."""
    kv_heads, head_dim = attention_geometry(hf)
    target = kv_bytes_per_token(kv_layers(hf), kv_heads, head_dim, dtype_bytes)
    dflash = kv_bytes_per_token(dflash_layers, kv_heads, head_dim, dtype_bytes)
    return [
        ("H-Spec (all variants)", target, 0),
        ("DFlash + target-KV reuse", target, 0),
        ("DFlash", target, dflash),
        ("DSpark", target, dflash),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m eval.memory", description=__doc__.split("\n")[0])
    parser.add_argument("--target", action="append", help="recipe name or config.json path (repeatable)")
    parser.add_argument(
        "--dtype", type=float_dtype, default="bfloat16", help="KV cache dtype (default bfloat16, as the paper)"
    )
    parser.add_argument("--dflash-layers", type=positive_int, default=5, help="DFlash/DSpark drafter layers")
    args = parser.parse_args(argv)
    dtype_bytes = jnp.dtype(args.dtype).itemsize
    tables = []
    for spec in args.target or PAPER_TARGETS:
        name, hf = load_hf_config(spec)
        try:
            tables.append((name, hf, memory_rows(hf, dtype_bytes, args.dflash_layers)))
        except (ValueError, TypeError) as e:
            raise InputError(f"{spec}: {e}") from None
    print(f"KV cache per token ({args.dtype}); inflation = (target + drafter) / target\n")
    print("| target | KV layers | method | target KiB/token | drafter KiB/token | inflation |")
    print("|---|---|---|---|---|---|")
    for name, hf, rows in tables:
        for method, target, drafter in rows:
            inflation = f"{(target + drafter) / target:.3f}x" if target else "-"
            print(
                f"| {name} | {kv_layers(hf)}/{text_config(hf)['num_hidden_layers']} | {method} | {target / 1024:.2f} | "
                f"{drafter / 1024:.2f} | {inflation} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
