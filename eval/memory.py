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

import argparse
import json
import os
import sys

import jax.numpy as jnp

PAPER_TARGETS = ("llama", "qwen3_4b", "qwen3_8b")
KV_LAYER_TYPES = ("full_attention", "sliding_attention", "attention")


def text_config(hf: dict) -> dict:
    """The language-model part of a (possibly multimodal) config.json."""
    return hf.get("text_config", hf)


def attention_geometry(hf: dict) -> tuple[int, int]:
    """(KV heads, head dim) of the attention layers."""
    hf = text_config(hf)
    heads = hf["num_attention_heads"]
    return hf.get("num_key_value_heads") or heads, hf.get("head_dim") or hf["hidden_size"] // heads


def kv_layers(hf: dict) -> int:
    """How many of the target's layers keep per-token K/V."""
    hf = text_config(hf)
    types = hf.get("layer_types")
    if types is None:
        return hf["num_hidden_layers"]
    return sum(t in KV_LAYER_TYPES for t in types)


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    return layers * 2 * kv_heads * head_dim * dtype_bytes


def load_hf_config(spec: str) -> tuple[str, dict]:
    """(display name, config.json dict) for a recipe name or a config.json path."""
    if os.path.isfile(spec):
        with open(spec) as f:
            return spec, json.load(f)
    recipe_path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", f"{spec}.py")
    if not os.path.isfile(recipe_path):
        raise ValueError(f"--target {spec!r} is neither a config.json file nor a recipe in configs/")
    from hspec_jax.recipes import load_config

    recipe = load_config(recipe_path)
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
    parser = argparse.ArgumentParser(prog="python -m eval.memory", description=__doc__.split("\n")[0])
    parser.add_argument("--target", action="append", help="recipe name or config.json path (repeatable)")
    parser.add_argument("--dtype", default="bfloat16", help="KV cache dtype (default bfloat16, as the paper)")
    parser.add_argument("--dflash-layers", type=int, default=5)
    args = parser.parse_args(argv)
    dtype_bytes = jnp.dtype(args.dtype).itemsize
    print(f"KV cache per token ({args.dtype}); inflation = (target + drafter) / target\n")
    print("| target | KV layers | method | target KiB/token | drafter KiB/token | inflation |")
    print("|---|---|---|---|---|---|")
    for spec in args.target or PAPER_TARGETS:
        try:
            name, hf = load_hf_config(spec)
            rows = memory_rows(hf, dtype_bytes, args.dflash_layers)
        except (OSError, ValueError, KeyError) as e:
            print(f"error: {spec}: {e}", file=sys.stderr)
            return 1
        for method, target, drafter in rows:
            print(
                f"| {name} | {kv_layers(hf)}/{text_config(hf)['num_hidden_layers']} | {method} | {target / 1024:.2f} | "
                f"{drafter / 1024:.2f} | {(target + drafter) / target:.3f}x |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
