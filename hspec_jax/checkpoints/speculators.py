"""Drafters in the speculators format (`vllm-project/speculators`, which vLLM serves; H-Spec's own code is a
patch on it, `mamba_attn_hybrid`), written from and read into this project's drafter checkpoints.

A speculators checkpoint is `config.json` + `model.safetensors` (or shards and an index):

* config: `speculators_model_type` ("mamba_attn_hybrid", "dflash" or "dspark"), `architectures`,
  `transformer_layer_config` (the verifier's HF config with the drafter's attention layer count, MLP width,
  `layer_types` and `sliding_window`), `speculators_config` (`algorithm`, `proposal_methods` with
  `speculative_tokens`, `verifier` with `name_or_path` and `architectures`), `draft_vocab_size`,
  `block_size`, `mask_token_id`, and the family's own fields (`FORMATS`: one `SpeculatorsFormat` per drafter
  family the format can express, naming its model types and mapping its config both ways);
* tensors, torch layout: Linear weights `[out, in]`, the depthwise conv `[C, 1, K]`, norms `.weight`,
  `layers.{i}.*` per flat sub-layer, `seed_projs.{j}`, `markov_head.markov_w{1,2}.weight`,
  `confidence_head.proj.{weight,bias}`, the draft `lm_head.weight` `[Vd, D]`, the verifier's
  `embed_tokens.weight` (with the drafter's own mask-token row, if any), `t2d` (bool `[V]`) and `d2t`
  (int64 offsets: target id = i + d2t[i]). The frozen verifier copies `verifier_lm_head` / `verifier_norm`
  are not written (as the reference) and are ignored when present.

`speculators_name(path)` is the one place that maps our parameter paths to these names. Import is strict:
every tensor is consumed and shape-checked, an unknown model type, config field or tensor, or a missing one,
is a one-line error naming it, and the verifier of the config is checked against the given target.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable

import jax
import numpy as np

from hspec_jax.checkpoints.hf import (
    CheckpointError,
    check_finite,
    read_json,
    read_state_dict,
    staged_directory,
    write_state_dict,
)
from hspec_jax.drafters.api import drafter_param_shapes
from hspec_jax.drafters.config import DFlashConfig, DrafterConfig, HSpecConfig, check_target
from hspec_jax.drafters.family import family_of
from hspec_jax.drafters.mamba2 import MambaConfig
from hspec_jax.drafters.vocab import DraftVocab, d2t_offsets, from_offsets
from hspec_jax.models.config import TargetConfig
from hspec_jax.models.decoder import embedding_matrix

CONFIG = "config.json"
ARCHITECTURES = {
    "mamba_attn_hybrid": "MambaAttnHybridDraftModel",
    "dflash": "DFlashDraftModel",
    "dspark": "DSparkDraftModel",
}
SUBLAYER_TOKENS = {"mamba": "mamba", "attn": "attention", "mlp": "mlp"}
EMBED = "embed_tokens.weight"
IGNORED_TENSORS = ("verifier_lm_head.weight", "verifier_norm.weight")
# Config fields of training (anchors, losses, optimiser, warm start) or bookkeeping: read past, never used.
IGNORED_FIELDS = frozenset(
    {
        "architectures",
        "speculators_version",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "max_anchors",
        "num_anchors",
        "ce_loss_alpha",
        "l1_loss_alpha",
        "confidence_head_alpha",
        "loss_decay_gamma",
        "trainable_q_proj",
        "trainable_kv_proj",
        "trainable_q_norm",
        "trainable_k_norm",
        "init_q_proj",
        "init_kv_proj",
        "init_q_norm",
        "init_k_norm",
        "verifier_layer_prefix",
        "agg_mode",
        "mamba_expand",
        "aux_hidden_state_layer_ids",
    }
)
COMMON_FIELDS = frozenset(
    {
        "speculators_model_type",
        "transformer_layer_config",
        "speculators_config",
        "draft_vocab_size",
        "block_size",
        "mask_token_id",
        "markov_rank",
        "markov_head_type",
        "enable_confidence_head",
        "confidence_head_with_markov",
        "sliding_window_non_causal",
    }
)
HSPEC_FIELDS = frozenset(
    {
        "latent_fusion_layer_ids",
        "attn_kv_layer_ids",
        "block_pattern",
        "attn_rope",
        "mamba_d_state",
        "mamba_num_heads",
        "mamba_head_dim",
        "mamba_n_groups",
        "mamba_conv_kernel",
        "mamba_seed_mode",
        "disable_mamba_init_state_injection",
        "disable_target_kv_reuse",
        "use_qk_norm",
        "fc_norm",
        "sliding_window_prefix",
        "layer_mapping",
        "no_mlp_layer_indices",
    }
)
DFLASH_FIELDS = frozenset({"sample_from_anchor", "target_hidden_size"})
# transformers' defaults for the `transformer_layer_config` fields import reads (a diff dict omits them).
LAYER_DEFAULTS = {
    "qwen3": dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=22016,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
    ),
    "llama": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
    ),
}
# The verifier geometry an imported drafter must share with the target.
LAYER_FIELDS = ("vocab_size", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "rms_norm_eps", "rope_theta")


# ---------------------------------------------------------------- tensor names and layouts


def speculators_name(path: tuple[str, ...]) -> tuple[str, str]:
    """Our parameter path -> (speculators tensor name, layout): "same", "linear" (our `[in, out]` kernel is
    torch's `[out, in]` weight) or "conv" (our `[K, C]` kernel is torch's `[C, 1, K]`)."""
    parts = [p.replace("layers_", "layers.").replace("seed_projs_", "seed_projs.") for p in path]
    *parents, leaf = parts
    if leaf == "kernel":
        return ".".join([*parents, "weight"]), "conv" if parents[-1] == "conv1d" else "linear"
    if leaf == "scale":
        return ".".join([*parents, "weight"]), "same"
    if leaf == "markov_w2":  # our `[r, Vd]`, torch's Linear(r -> Vd) weight `[Vd, r]`
        return ".".join([*parents, "markov_w2.weight"]), "linear"
    if leaf in ("markov_w1", "lm_head", "norm"):  # an embedding table, the draft rows, the gated-norm weight
        return ".".join([*parents, leaf, "weight"]), "same"
    return ".".join(parts), "same"  # biases, A_log, D, dt_bias


def to_torch_layout(value: np.ndarray, layout: str) -> np.ndarray:
    if layout == "linear":
        return value.T
    if layout == "conv":
        return value.T[:, None, :]
    return value


def from_torch_layout(value: np.ndarray, layout: str) -> np.ndarray:
    if layout == "linear":
        return value.T
    if layout == "conv":
        return value[:, 0, :].T if value.ndim == 3 and value.shape[1] == 1 else value
    return value


def _leaves(tree) -> list[tuple[tuple[str, ...], object]]:
    return [(tuple(str(k.key) for k in kp), leaf) for kp, leaf in jax.tree_util.tree_leaves_with_path(tree)]


def _set(tree: dict, path: tuple[str, ...], value) -> None:
    for part in path[:-1]:
        tree = tree.setdefault(part, {})
    tree[path[-1]] = value


# ---------------------------------------------------------------- export


def _layer_types(config: DrafterConfig, num_layers: int, default_causal: bool) -> tuple[list[str], bool]:
    """(`layer_types`, `sliding_window_non_causal`) of the attention layers; an attention layout the format
    cannot express is an error."""
    if config.attn_layer_types:
        return list(config.attn_layer_types), False
    if config.sliding_window is None:
        if default_causal:
            raise CheckpointError("a causal block without a sliding window has no speculators layer type")
        return ["full_attention"] * num_layers, False
    return ["sliding_attention"] * num_layers, not default_causal


def _layer_config(config: DrafterConfig, num_layers: int, default_causal: bool) -> tuple[dict, bool]:
    target = config.target
    layer_types, non_causal = _layer_types(config, num_layers, default_causal)
    tl = target.to_hf()
    tl.update(
        num_hidden_layers=num_layers,
        intermediate_size=config.mlp_size,
        layer_types=layer_types,
        sliding_window=config.sliding_window,
        use_sliding_window="sliding_attention" in layer_types,
        tie_word_embeddings=False,
    )
    if "sliding_attention" not in layer_types:
        tl["sliding_window"] = None
    return tl, non_causal


def _rope_entry(target: TargetConfig) -> dict:
    return {
        "rope_parameters": target.to_hf()["rope_parameters"],
        "sliding_window": None,
        "layer_type": "full_attention",
    }


def _hspec_fields(config: HSpecConfig) -> tuple[str, dict]:
    if config.latent_size != config.target.hidden_size:
        raise CheckpointError(
            f"fusion_rank {config.latent_size} != hidden size {config.target.hidden_size}: the speculators "
            "format fuses into the hidden size"
        )
    num_attn = config.block_pattern.count("attn")
    tl, non_causal = _layer_config(config, num_attn, default_causal=True)
    tl["use_qk_norm"] = config.attention_qk_norm
    mamba = config.mamba or MambaConfig(num_heads=1)
    return "mamba_attn_hybrid", {
        "transformer_layer_config": tl,
        "sliding_window_non_causal": non_causal,
        "latent_fusion_layer_ids": list(config.fusion_layer_ids),
        "attn_kv_layer_ids": list(config.attn_kv_layer_ids),
        "aux_hidden_state_layer_ids": sorted(set(config.attn_kv_layer_ids)),
        "block_pattern": [SUBLAYER_TOKENS[kind] for kind in config.block_pattern],
        "attn_rope": [_rope_entry(config.target) for _ in range(num_attn)],
        "mamba_d_state": mamba.d_state,
        "mamba_num_heads": mamba.num_heads,
        "mamba_head_dim": mamba.head_dim,
        "mamba_n_groups": mamba.n_groups,
        "mamba_conv_kernel": mamba.conv_kernel,
        "mamba_expand": 1,
        "mamba_seed_mode": config.seed_mode,
        "disable_mamba_init_state_injection": not config.use_state_injection,
        "disable_target_kv_reuse": not config.use_target_kv,
        "use_qk_norm": config.attention_qk_norm,
        "fc_norm": False,
        "sliding_window_prefix": 0,
        "layer_mapping": None,
        "no_mlp_layer_indices": None,
    }


def _dflash_fields(config: DFlashConfig) -> tuple[str, dict]:
    if config.kv_source != "inject":
        raise CheckpointError("'DFlash + direct target-KV reuse' has no speculators model type")
    if not config.attention_qk_norm:
        raise CheckpointError("speculators DFlash layers always have q/k norms; this drafter has none")
    tl, non_causal = _layer_config(config, config.num_layers, default_causal=config.block_causal)
    return "dspark" if config.markov_rank else "dflash", {
        "transformer_layer_config": tl,
        "sliding_window_non_causal": non_causal,
        "aux_hidden_state_layer_ids": list(config.fusion_layer_ids),
        "sample_from_anchor": config.sample_from_anchor,
        "target_hidden_size": None,
    }


def speculators_config(config: DrafterConfig, verifier: str | None) -> dict:
    """The speculators `config.json` of a drafter (`verifier`: the verifier's name or path, informational)."""
    family = family_of(config).name
    if family not in FORMATS:
        raise CheckpointError(f"the {family!r} drafter family has no speculators format (only {', '.join(FORMATS)})")
    model_type, fields = FORMATS[family].export(config)
    arch = config.target.to_hf()["architectures"]
    return {
        "speculators_model_type": model_type,
        "architectures": [ARCHITECTURES[model_type]],
        "draft_vocab_size": config.vocab_size,
        "block_size": config.block_size,
        "mask_token_id": config.mask_token_id,
        "markov_rank": config.markov_rank,
        "markov_head_type": "vanilla",
        "enable_confidence_head": config.confidence_head,
        "confidence_head_with_markov": config.confidence_head,
        **fields,
        "speculators_config": {
            "algorithm": model_type,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": config.num_drafts}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": arch},
        },
    }


def speculators_state(
    params: dict, config: DrafterConfig, vocab: DraftVocab, target_params: dict | None = None, dtype=None
) -> dict[str, np.ndarray]:
    """The speculators tensors of a drafter (floats cast to `dtype` if given). `embed_tokens.weight` (the
    target's table, with the drafter's own mask row) is written when `target_params` are given."""
    cast = lambda x: np.ascontiguousarray(x.astype(dtype) if dtype is not None else x)
    state = {}
    for path, leaf in _leaves(params):
        if path == ("mask_embedding",):
            continue
        name, layout = speculators_name(path)
        state[name] = cast(to_torch_layout(np.asarray(leaf), layout))
    if target_params is not None:
        table = np.array(embedding_matrix(target_params))
        if config.mask_embedding:
            table[config.mask_token_id] = np.asarray(params["mask_embedding"], table.dtype)
        state[EMBED] = cast(table)
    elif config.mask_embedding:
        raise CheckpointError(
            "this drafter has its own mask-token embedding row: give the target to write embed_tokens"
        )
    state["t2d"] = np.asarray(vocab.t2d, bool)
    state["d2t"] = d2t_offsets(vocab)
    return state


def export_speculators(
    directory: str,
    params: dict,
    config: DrafterConfig,
    vocab: DraftVocab,
    target_params: dict | None = None,
    *,
    verifier: str | None = None,
    dtype=None,
    max_shard_bytes: int | None = None,
) -> None:
    """Write a speculators checkpoint directory (staged: it appears only when complete). `target_params` supply the
    verifier's `embed_tokens` and, for params saved without it, the draft lm_head rows; `verifier` is the
    `name_or_path` recorded for vLLM; `dtype` (e.g. bfloat16) the stored dtype."""
    spec = speculators_config(config, verifier)
    state = speculators_state(params, config, vocab, target_params, dtype)
    limit = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
    with staged_directory(directory) as staging:
        write_state_dict(state, staging, **limit)
        with open(os.path.join(staging, CONFIG), "w") as f:
            json.dump(spec, f, indent=2)


# ---------------------------------------------------------------- import


def read_speculators_config(source: str) -> tuple[str, dict]:
    """(directory, config dict) of a speculators checkpoint: a directory, or a path to its `config.json` or
    safetensors; a model type other than `MODEL_TYPES` is an error naming it."""
    directory = source if os.path.isdir(source) else os.path.dirname(os.path.abspath(source))
    path = os.path.join(directory, CONFIG)
    if not os.path.isfile(path):
        raise CheckpointError(f"no {CONFIG} in {directory!r}")
    spec = read_json(path)
    model_type = spec.get("speculators_model_type")
    if model_type not in MODEL_TYPES:
        raise CheckpointError(f"{path}: unsupported speculators_model_type {model_type!r}; supported: {MODEL_TYPES}")
    return directory, spec


def _check_fields(spec: dict, model_type: str, path: str) -> None:
    known = COMMON_FIELDS | IGNORED_FIELDS | _format(model_type).fields
    unknown = sorted(set(spec) - known)
    if unknown:
        raise CheckpointError(f"{path}: unknown {model_type} config field {unknown[0]!r}")
    unsupported = {
        "markov_head_type": ("vanilla", None),
        "sliding_window_prefix": (0, None),
        "fc_norm": (False, None),
        "layer_mapping": (None,),
        "no_mlp_layer_indices": (None,),
    }
    for field, allowed in unsupported.items():
        if spec.get(field) not in allowed:
            raise CheckpointError(f"{path}: {field}={spec[field]!r} is not supported (only {allowed[0]!r})")
    if spec.get("enable_confidence_head") and not spec.get("confidence_head_with_markov"):
        raise CheckpointError(f"{path}: a confidence head without the Markov embedding is not supported")


def _layer(spec: dict, target: TargetConfig, path: str) -> dict:
    """The `transformer_layer_config` with transformers' defaults filled in, checked against the target."""
    tl = spec.get("transformer_layer_config")
    if not isinstance(tl, dict):
        raise CheckpointError(f"{path}: no transformer_layer_config")
    merged = {**LAYER_DEFAULTS.get(tl.get("model_type"), LAYER_DEFAULTS["qwen3"]), **tl}
    merged.setdefault("num_key_value_heads", merged["num_attention_heads"])
    merged.setdefault("head_dim", merged["hidden_size"] // merged["num_attention_heads"])
    bare = {k: v for k, v in merged.items() if k not in ("layer_types", "sliding_window", "use_sliding_window")}
    try:
        layer = TargetConfig.from_hf({**bare, "model_type": target.model_type})
    except (ValueError, TypeError, KeyError) as e:
        raise CheckpointError(f"{path}: transformer_layer_config: {e}") from None
    wrong = [
        f"{f}: checkpoint {getattr(layer, f)}, target {getattr(target, f)}"
        for f in (*LAYER_FIELDS, "rope_scaling")
        if getattr(layer, f) != getattr(target, f)
    ]
    verifier = (spec.get("speculators_config") or {}).get("verifier") or {}
    if wrong:
        raise CheckpointError(
            f"{path}: drafter made for verifier {verifier.get('name_or_path')!r} does not match the target ("
            + "; ".join(wrong)
            + ")"
        )
    arch = target.to_hf()["architectures"][0]
    if verifier.get("architectures") and arch not in verifier["architectures"]:
        raise CheckpointError(
            f"{path}: drafter made for verifier {verifier.get('name_or_path')!r} "
            f"({', '.join(verifier['architectures'])}), target is {arch}"
        )
    for entry in spec.get("attn_rope") or ():
        rope = TargetConfig.from_hf({**bare, "model_type": target.model_type, **entry})
        if (rope.rope_theta, rope.rope_scaling) != (target.rope_theta, target.rope_scaling) or entry.get(
            "sliding_window"
        ):
            raise CheckpointError(f"{path}: attn_rope entry {entry} does not match the target's attention")
    return merged


def _attention_fields(spec: dict, merged: dict, target: TargetConfig, num_layers: int, path: str, hspec: bool) -> dict:
    """Our attention layout fields (window, layer types, block causality, MLP width) from the layer config."""
    if merged["num_hidden_layers"] != num_layers:
        raise CheckpointError(
            f"{path}: transformer_layer_config has {merged['num_hidden_layers']} layers, the drafter {num_layers}"
        )
    types = tuple(merged.get("layer_types") or ("full_attention",) * num_layers)
    window = merged.get("sliding_window") if "sliding_attention" in types else None
    fields = {"sliding_window": window}
    if merged["intermediate_size"] != target.intermediate_size:
        fields["intermediate_size"] = merged["intermediate_size"]
    all_sliding = set(types) == {"sliding_attention"}
    if spec.get("sliding_window_non_causal"):
        if hspec or not all_sliding:
            raise CheckpointError(f"{path}: sliding_window_non_causal is supported only for all-sliding DFlash")
        return {**fields, "block_causal": False}
    if hspec and all_sliding:  # H-Spec's default layout: every sub-layer windowed and causal
        return fields
    return {**fields, "attn_layer_types": types}


def speculators_drafter_config(spec: dict, target: TargetConfig, *, window_mode: str, path: str) -> DrafterConfig:
    """Our drafter config for a speculators config (checked against `target`); `window_mode` as for
    `DrafterConfig` (the format does not say: the reference trains "block" and serves "query")."""
    model_type = spec["speculators_model_type"]
    _check_fields(spec, model_type, path)
    merged = _layer(spec, target, path)
    common = dict(
        target=target,
        block_size=spec.get("block_size", 8),
        draft_vocab_size=spec.get("draft_vocab_size", 32000),
        mask_token_id=spec.get("mask_token_id"),
        markov_rank=spec.get("markov_rank", 0),
        confidence_head=bool(spec.get("enable_confidence_head", False)),
        window_mode=window_mode,
    )
    if common["mask_token_id"] is None:
        raise CheckpointError(f"{path}: no mask_token_id")
    try:
        return _format(model_type).config(spec, common, merged, target, path)
    except CheckpointError:
        raise
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: {e}") from None


def _hspec_config(spec: dict, common: dict, merged: dict, target: TargetConfig, path: str) -> HSpecConfig:
    pattern = spec.get("block_pattern") or []
    tokens = {v: k for k, v in SUBLAYER_TOKENS.items()}
    if any(t not in tokens for t in pattern):
        raise CheckpointError(f"{path}: block_pattern {pattern} has an unknown sub-layer")
    block_pattern = tuple(tokens[t] for t in pattern)
    num_attn = block_pattern.count("attn")
    return HSpecConfig(
        **common,
        **_attention_fields(spec, merged, target, num_attn, path, hspec=True),
        fusion_layer_ids=tuple(spec.get("latent_fusion_layer_ids") or ()),
        attn_kv_layer_ids=tuple(spec.get("attn_kv_layer_ids") or ()),
        block_pattern=block_pattern,
        mamba=MambaConfig(
            num_heads=spec.get("mamba_num_heads", 64),
            head_dim=spec.get("mamba_head_dim", 64),
            d_state=spec.get("mamba_d_state", 16),
            n_groups=spec.get("mamba_n_groups", 1),
            conv_kernel=spec.get("mamba_conv_kernel", 4),
        ),
        seed_mode=spec.get("mamba_seed_mode", "per_layer"),
        use_state_injection=not spec.get("disable_mamba_init_state_injection", False),
        use_target_kv=not spec.get("disable_target_kv_reuse", False),
        qk_norm=None if bool(spec.get("use_qk_norm", True)) == target.qk_norm else bool(spec["use_qk_norm"]),
    )


def _dflash_config(spec: dict, common: dict, merged: dict, target: TargetConfig, path: str) -> DFlashConfig:
    if spec.get("target_hidden_size") not in (None, target.hidden_size):
        raise CheckpointError(f"{path}: target_hidden_size {spec['target_hidden_size']} != {target.hidden_size}")
    return DFlashConfig(
        **common,
        **_attention_fields(spec, merged, target, merged["num_hidden_layers"], path, hspec=False),
        fusion_layer_ids=tuple(spec.get("aux_hidden_state_layer_ids") or ()),
        num_layers=merged["num_hidden_layers"],
        sample_from_anchor=bool(spec.get("sample_from_anchor", False)),
    )


@dataclasses.dataclass(frozen=True)
class SpeculatorsFormat:
    """How one drafter family maps to the speculators format: its `model_types`, its own config `fields`,
    `export(config) -> (model type, family fields)` and `config(spec, common fields, layer config, target, path)
    -> our config`."""

    model_types: tuple[str, ...]
    fields: frozenset[str]
    export: Callable[[DrafterConfig], tuple[str, dict]]
    config: Callable[..., DrafterConfig]


# Drafter family name -> its speculators mapping; a family missing here has no speculators format.
FORMATS = {
    "hspec": SpeculatorsFormat(("mamba_attn_hybrid",), HSPEC_FIELDS, _hspec_fields, _hspec_config),
    "dflash": SpeculatorsFormat(("dflash", "dspark"), DFLASH_FIELDS, _dflash_fields, _dflash_config),
}
MODEL_TYPES = tuple(t for f in FORMATS.values() for t in f.model_types)


def _format(model_type: str) -> SpeculatorsFormat:
    return next(f for f in FORMATS.values() if model_type in f.model_types)


def _mask_row(table: np.ndarray, target_params: dict, mask_id: int, source: str) -> np.ndarray | None:
    """The checkpoint's `embed_tokens` row for the mask token when it differs from the target's (None if
    equal); any other differing row means another verifier, an error."""
    ours = np.asarray(embedding_matrix(target_params)).astype(table.dtype)
    if table.shape != ours.shape:
        raise CheckpointError(f"{source}: tensor {EMBED!r} has shape {table.shape}, expected {ours.shape}")
    rows = np.flatnonzero(np.any(table != ours, axis=1))
    others = rows[rows != mask_id]
    if others.size:
        raise CheckpointError(
            f"{source}: {EMBED!r} differs from the target's embedding in {others.size} row(s) besides the mask "
            f"token (first: {others[0]}): the drafter was made for another verifier"
        )
    return table[mask_id] if rows.size else None


def import_speculators(
    source: str, target: TargetConfig, target_params: dict, *, window_mode: str = "query"
) -> tuple[DrafterConfig, dict, DraftVocab]:
    """(config, params, vocab) of a speculators checkpoint, for `target` (whose weights check `embed_tokens`)."""
    directory, spec = read_speculators_config(source)
    path = os.path.join(directory, CONFIG)
    config = speculators_drafter_config(spec, target, window_mode=window_mode, path=path)
    state = read_state_dict(directory)
    for name in ("t2d", "d2t"):
        if name not in state:
            raise CheckpointError(f"{directory}: checkpoint is missing tensor {name!r}")
    try:
        vocab = from_offsets(state.pop("d2t"), state.pop("t2d"))
    except ValueError as e:
        raise CheckpointError(f"{directory}: {e}") from None
    row = _mask_row(state.pop(EMBED), target_params, config.mask_token_id, directory) if EMBED in state else None
    config = dataclasses.replace(config, mask_embedding=row is not None)
    if (vocab.size, vocab.t2d.shape[0]) != (config.vocab_size, target.vocab_size):
        raise CheckpointError(f"{directory}: d2t/t2d describe {vocab.size} of {vocab.t2d.shape[0]} tokens")
    expected = drafter_param_shapes(config)
    params: dict = {}
    for leaf_path, want in _leaves(expected):
        if leaf_path == ("mask_embedding",):
            _set(params, leaf_path, np.asarray(row, want.dtype))
            continue
        name, layout = speculators_name(leaf_path)
        if name not in state:
            raise CheckpointError(f"{directory}: checkpoint is missing tensor {name!r}")
        raw = np.asarray(state.pop(name))
        value = from_torch_layout(raw, layout)
        if tuple(value.shape) != tuple(want.shape):
            shape = to_torch_layout(np.zeros(want.shape, np.int8), layout).shape
            raise CheckpointError(f"{directory}: tensor {name!r} has shape {raw.shape}, expected {shape}")
        _set(params, leaf_path, value.astype(want.dtype))
    unknown = sorted(set(state) - set(IGNORED_TENSORS))
    if unknown:
        raise CheckpointError(f"{directory}: unknown tensor {unknown[0]!r} for a {spec['speculators_model_type']}")
    params = jax.device_put(params)
    check_finite(params, directory)
    try:
        check_target(config, target)
    except ValueError as e:
        raise CheckpointError(f"{directory}: {e}") from None
    return config, params, vocab
