"""DFlash (block-diffusion drafter with KV injection), DSpark (DFlash + Markov head) and "DFlash + direct
target-KV reuse".

DFlash fuses the target's tapped hidden states of *every* context position, latent = hidden_norm(fc(concat)),
and each of its layers projects that latent with its own k_proj / v_proj (k-norm, RoPE at the context
position) into a drafter-side KV cache: a real buffer that grows with the context, `[B, S, K, H]` per layer
(`KVBuffers`, or the paged pool of `hspec_jax.serving`: layers are read and written through its accessors).
The block [anchor, MASK x k] then attends to that cache (rows < anchor) and bidirectionally to itself.

With `inputs.inject_rows = (taps, positions, first_row)` the call first writes the K/V rows of newly committed context
positions into the cache (the "KV injection" whose cost grows with the number of accepted tokens and
sequences), then drafts. With `kv_source="target"` there is no fusion and no cache: each layer reads one
mapped target layer's KV cache in place, like H-Spec's attention.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from hspec_jax.drafters.config import DFlashConfig, DrafterConfig
from hspec_jax.drafters.family import DrafterFamily, DrafterKind, register_family, register_kind
from hspec_jax.drafters.heads import ConfidenceHead, MarkovHead
from hspec_jax.drafters.inputs import DraftInputs
from hspec_jax.drafters.layers import DraftAttention
from hspec_jax.drafters.output import DraftOutput, apply_heads, draft_logits
from hspec_jax.models.kv_cache import KVBuffers
from hspec_jax.models.layers import MLP, RMSNorm, dense


class DFlashLayer(nn.Module):
    """A Qwen3-style decoder layer whose attention reads a context cache; optionally injects into it first."""

    config: DFlashConfig
    layer_index: int = 0  # which drafter layer (its attention layout)
    inject_only: bool = False  # write new_rows into the context cache and return, h untouched

    @nn.compact
    def __call__(self, h, anchors, doc_starts, context, index, new_rows=None):
        """h `[B, A, T, D]`; anchors, doc_starts `[B, A]`; `context` a cache whose layer `index` (k, v) this layer
        attends to (read through its accessors: the drafter's own cache, or the target's with kv_source="target");
        new_rows (latent `[B, C, D]`, positions `[B, C]`, first row `[B]`) to project and write into that layer
        first -> (h, context)."""
        cfg = self.config
        target = cfg.target
        dtype, pdtype, eps = cfg.compute_dtype, cfg.storage_dtype, target.rms_norm_eps
        attention = target.replace(dtype=dtype, param_dtype=pdtype, qk_norm=cfg.attention_qk_norm)
        window, causal = cfg.attention_layout(self.layer_index, default_causal=cfg.block_causal)
        attn = DraftAttention(attention, window, causal, cfg.window_mode, cfg.attention_impl, name="self_attn")
        if new_rows is not None:
            latent, positions, starts = new_rows
            context = context.write(index, *attn.key_value(latent, positions), starts)
        if self.inject_only:
            return h, context
        h = h + attn(RMSNorm(eps, pdtype, name="input_layernorm")(h), anchors, doc_starts, context.layer(index))
        mlp = MLP(target.hidden_size, cfg.mlp_size, False, dtype, pdtype, name="mlp")
        return h + mlp(RMSNorm(eps, pdtype, name="post_attention_layernorm")(h)), context


class DFlash(nn.Module):
    config: DFlashConfig
    inject_only: bool = False  # only write inputs.inject_rows into the drafter cache (a step that drafts nothing)

    @nn.compact
    def __call__(self, embeds, inputs: DraftInputs) -> DraftOutput:
        """embeds `[B, A, T, D]`; `inputs` (see `DraftInputs`): anchors, doc_starts, prev_tokens, drafter_cache (the
        drafter cache, `KVBuffers` or a paged equivalent: layer i read and written through its accessors) and
        inject_rows (taps `[B, C, F*D]`, positions `[B, C]`, first row `[B]`: context rows to inject first); with
        kv_source="target", layer i reads the target cache's layer `target_kv_layer_ids[i]` in place instead.
        With `inject_only`, embeds may be None: the call only injects inject_rows and returns the cache."""
        cfg = self.config
        target = cfg.target
        dtype, pdtype = cfg.compute_dtype, cfg.storage_dtype
        reads_target = cfg.kv_source == "target"
        inject_rows = None if reads_target else inputs.inject_rows  # nothing to inject into the target's cache
        context = inputs.target_cache if reads_target else inputs.drafter_cache
        layer_ids = cfg.target_kv_layer_ids if reads_target else range(cfg.num_layers)
        new_rows = None
        if inject_rows is not None:
            taps, positions, first_row = inject_rows
            fc = dense(target.hidden_size, "fc", dtype=dtype, param_dtype=pdtype)
            latent = RMSNorm(target.rms_norm_eps, pdtype, name="hidden_norm")(fc(taps.astype(dtype)))
            new_rows = (latent, positions, first_row)
        h = None if self.inject_only else embeds.astype(dtype)
        for i, index in enumerate(layer_ids):
            layer = DFlashLayer(cfg, i, self.inject_only, name=f"layers_{i}")
            h, context = layer(h, inputs.anchors, inputs.doc_starts, context, index, new_rows)
        if self.inject_only:
            return DraftOutput(None, None, None, context)
        hidden, logits = draft_logits(self, cfg, h)
        markov = MarkovHead(target.vocab_size, cfg.vocab_size, cfg.markov_rank, pdtype, name="markov_head")
        confidence = ConfidenceHead(pdtype, name="confidence_head")
        out = apply_heads(cfg, markov, confidence, hidden, logits, inputs.prev_tokens)
        return out._replace(drafter_cache=context if inject_rows is not None else None)


def inject_context(params: dict, config: DFlashConfig, drafter_cache, inject_rows: tuple):
    """DFlash's `DrafterFamily.inject`: write the K/V rows of `inject_rows` (taps `[B, C, F*D]`, positions `[B, C]`,
    first row `[B]`) into the drafter cache without drafting (what `draft_block` injects first) -> the cache."""
    inputs = DraftInputs(
        embedding=None,
        block_tokens=None,
        anchors=None,
        seed_hidden=None,
        target_cache=None,
        drafter_cache=drafter_cache,
        inject_rows=inject_rows,
    )
    return DFlash(config, inject_only=True).apply({"params": params}, None, inputs).drafter_cache


def empty_context(config: DrafterConfig, batch: int, capacity: int, dtype=None) -> KVBuffers:
    """A zeroed drafter-side cache: per layer (`config.cache_layers`) k, v `[B, capacity, K, H]`."""
    shape = (batch, capacity, config.target.num_kv_heads, config.target.head_dim)
    dtype = dtype or config.compute_dtype
    zeros = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(config.cache_layers))
    return KVBuffers(k=zeros(), v=zeros())


def drafter_context(config: DrafterConfig, batch: int, capacity: int) -> KVBuffers | tuple:
    """The drafter-side cache a drafter needs: `empty_context` for DFlash/DSpark, () for drafters without one."""
    return empty_context(config, batch, capacity) if config.owns_kv_cache else ()


def mirrored_layers(config: DFlashConfig) -> dict[str, int]:
    """With kv_source="target" each layer reads (and copies q/k/v from) its mapped target layer; none otherwise."""
    if config.kv_source != "target":
        return {}
    return {f"layers_{i}": layer for i, layer in enumerate(config.target_kv_layer_ids)}


def _plain(fields: dict, target) -> dict:
    return {**fields, "markov_rank": 0, "confidence_head": False}


def _target_kv(fields: dict, target) -> dict:
    """DFlash + direct target-KV reuse: each layer reads one target layer's cache, by default those of its taps."""
    taps, layers = fields["fusion_layer_ids"], fields.get("num_layers", 5)
    if "target_kv_layer_ids" not in fields and len(taps) < layers:
        raise ValueError(f"dflash_target_kv needs {layers} target layers: set target_kv_layer_ids")
    default = tuple(min(t, target.num_layers - 1) for t in taps[:layers])
    return {"target_kv_layer_ids": default, **_plain(fields, target), "kv_source": "target"}


def _markov(anchored: bool):
    """DFlash + Markov head (and confidence head, by default). "dspark" is DSpark as speculators defines it
    (`sample_from_anchor=True`: the block is [anchor, MASK x (k - 1)] and every slot drafts, slot i the token
    i + 1 after the anchor); "dflash_markov" keeps the DFlash block layout (slot 0 = the anchor, predicting nothing)."""

    def fields_of(fields: dict, target) -> dict:
        block_size = fields.get("block_size", 8) - anchored
        return {
            "markov_rank": 256,
            "confidence_head": True,
            **fields,
            "sample_from_anchor": anchored,
            "block_size": block_size,
        }

    return fields_of


FAMILY = register_family(
    DrafterFamily(
        "dflash",
        DFlashConfig,
        DFlash,
        mirrored_layers=mirrored_layers,
        inject=inject_context,
    )
)
CE_ONLY = {"ce": 1.0, "tv": 0.0, "confidence": 0.0}  # DFlash's recipe: cross-entropy alone
# DSpark before DFlash: comparison tables read H-Spec, then the baseline closest to it, then plain DFlash.
register_kind(DrafterKind("dspark", FAMILY, _markov(anchored=True), compared=True))
register_kind(DrafterKind("dflash", FAMILY, _plain, loss=CE_ONLY, compared=True))
register_kind(DrafterKind("dflash_markov", FAMILY, _markov(anchored=False)))
register_kind(DrafterKind("dflash_target_kv", FAMILY, _target_kv, loss=CE_ONLY))
