"""The drafters as pure functions: build, initialise (randomly and from the target), draft one block.

    params = init_drafter(config, rng)                           # random init, plain nested dict
    params = init_from_target(params, config, target_params, vocab)   # copy the target layers it mirrors
    out = draft_block(params, config, embedding, block_tokens, anchors, target_cache=cache, seed_hidden=h)

`jax.eval_shape(lambda: init_drafter(config, rng))` gives every parameter's shape without allocating.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hspec_jax.drafters.config import DFlashConfig, DrafterConfig, HSpecConfig
from hspec_jax.drafters.dflash import DFlash, empty_context
from hspec_jax.drafters.hspec import HSpec
from hspec_jax.drafters.output import DraftOutput
from hspec_jax.drafters.vocab import DraftVocab, draft_rows
from hspec_jax.models.decoder import lm_head_matrix
from hspec_jax.models.kv_cache import KVCache

_INIT_CONTEXT_ROWS = 8


def drafter_module(config: DrafterConfig):
    if isinstance(config, HSpecConfig):
        return HSpec(config)
    if isinstance(config, DFlashConfig):
        return DFlash(config)
    raise TypeError(f"not a drafter config: {type(config).__name__}")


def _dummy_kv(config: DrafterConfig, count: int, rows: int):
    shape = (1, rows, config.target.num_kv_heads, config.target.head_dim)
    return tuple((jnp.zeros(shape, config.compute_dtype),) * 2 for _ in range(count))


def init_drafter(config: DrafterConfig, rng: jax.Array) -> dict:
    """Randomly initialised drafter parameters (the frozen pieces get real values from `init_from_target`)."""
    t = config.block_size
    embeds = jnp.zeros((1, 1, t, config.target.hidden_size), config.compute_dtype)
    anchors = jnp.full((1, 1), _INIT_CONTEXT_ROWS // 2, jnp.int32)
    prev = jnp.zeros((1, 1, t), jnp.int32)
    taps = jnp.zeros((1, 1, len(config.fusion_layer_ids) * config.target.hidden_size), config.compute_dtype)
    module = drafter_module(config)
    if isinstance(config, HSpecConfig):
        kv = _dummy_kv(config, len(config.attn_kv_layer_ids), _INIT_CONTEXT_ROWS)
        return module.init(rng, embeds, anchors, taps, kv, prev)["params"]
    if config.kv_source == "target":
        return module.init(rng, embeds, anchors, _dummy_kv(config, config.num_layers, _INIT_CONTEXT_ROWS), prev)[
            "params"
        ]
    context = empty_context(config, 1, _INIT_CONTEXT_ROWS)
    new_context = (jnp.tile(taps, (1, 2, 1)), jnp.arange(2, dtype=jnp.int32)[None])
    return module.init(rng, embeds, anchors, context, prev, new_context)["params"]


def mirrored_target_layers(config: DrafterConfig) -> dict[str, int]:
    """Drafter attention layer name -> the target decoder layer whose KV it reads (and whose q/k/v it copies)."""
    if isinstance(config, HSpecConfig):
        attn = [i for i, kind in enumerate(config.block_pattern) if kind == "attn"]
        return {f"layers_{i}": layer for i, layer in zip(attn, config.attn_kv_layer_ids, strict=True)}
    if config.kv_source == "target":
        return {f"layers_{i}": layer for i, layer in enumerate(config.target_kv_layer_ids)}
    return {}


def target_kv(config: DrafterConfig, cache: KVCache) -> tuple[tuple[jax.Array, jax.Array], ...]:
    """The (k, v) buffers, straight from the target's cache, of the layers the drafter's attention reads."""
    return tuple(cache.layer(i) for i in mirrored_target_layers(config).values())


COPIED_FROM_TARGET = ("q_proj", "k_proj", "v_proj", "q_norm", "k_norm")


def init_from_target(params: dict, config: DrafterConfig, target_params: dict, vocab: DraftVocab) -> dict:
    """Copy what the drafter takes from the target: the draft lm_head rows, and for every attention layer that
    reads a target layer's KV cache, that layer's q/k/v projections (and q/k norms) so block keys match."""
    if vocab.size != config.vocab_size or vocab.t2d.shape[0] != config.target.vocab_size:
        raise ValueError(
            f"draft vocabulary of {vocab.size} tokens over {vocab.t2d.shape[0]} does not match the config "
            f"({config.vocab_size} over {config.target.vocab_size})"
        )
    out = jax.tree.map(lambda x: x, params)
    dtype = params["lm_head"].dtype
    out["lm_head"] = draft_rows(lm_head_matrix(target_params, config.target), vocab).astype(dtype)
    for name, layer in mirrored_target_layers(config).items():
        source = target_params[f"layers_{layer}"]["self_attn"]
        attn = out[name]["self_attn"]
        for key in COPIED_FROM_TARGET:
            if key in attn:
                attn[key] = jax.tree.map(lambda x, ref: x.astype(ref.dtype), source[key], attn[key])
    return out


def draft_block(
    params: dict,
    config: DrafterConfig,
    embedding: jax.Array,
    block_tokens: jax.Array,
    anchors: jax.Array,
    *,
    target_cache: KVCache | None = None,
    seed_hidden: jax.Array | None = None,
    context_kv: tuple | None = None,
    new_context: tuple | None = None,
    prev_tokens: jax.Array | None = None,
) -> DraftOutput:
    """One block per sequence. block_tokens `[B, T]` ([anchor, MASK...]); anchors `[B]` (slot-0 positions);
    embedding `[V, D]` (the target's, frozen). H-Spec needs `seed_hidden [B, F*D]` (taps at anchor - 1) and
    `target_cache`; DFlash needs its own `context_kv` (+ optional `new_context` rows to inject) or, with
    kv_source="target", `target_cache`. Inputs a kind does not use are ignored, so a caller may pass them all.
    Returns a `DraftOutput` with the block axis A removed ([B, T, ...])."""
    embeds = embedding[block_tokens][:, None]
    anchors = anchors[:, None]
    prev = None if prev_tokens is None else prev_tokens[:, None]
    module = drafter_module(config)
    if isinstance(config, HSpecConfig):
        taps = None if seed_hidden is None else seed_hidden[:, None]
        kv = target_kv(config, target_cache) if config.use_target_kv else None
        out = module.apply({"params": params}, embeds, anchors, taps, kv, prev)
    elif config.kv_source == "target":
        out = module.apply({"params": params}, embeds, anchors, target_kv(config, target_cache), prev)
    else:
        out = module.apply({"params": params}, embeds, anchors, context_kv, prev, new_context)
    squeeze = lambda x: None if x is None else x[:, 0]
    return DraftOutput(squeeze(out.hidden), squeeze(out.logits), squeeze(out.confidence), out.context_kv)


def block_inputs(tokens: jax.Array, anchors: jax.Array, block_size: int, mask_token_id: int):
    """Training blocks from whole sequences. tokens `[B, S]`, anchors `[B, A]` ->
    (block_tokens `[B, A, T]` = [x_a, MASK...], prev_tokens `[B, A, T]` with prev of slot i = x_{a+i-1}
    (teacher forcing; slot 0 gets x_a and predicts nothing), labels `[B, A, T]` = x_{a+i})."""
    offsets = jnp.arange(block_size)
    rows = jnp.arange(tokens.shape[0])[:, None, None]
    at = lambda idx: tokens[rows, jnp.clip(idx, 0, tokens.shape[1] - 1)]
    labels = at(anchors[..., None] + offsets)
    prev = at(anchors[..., None] + jnp.maximum(offsets - 1, 0))
    block = jnp.where(offsets == 0, labels, mask_token_id)
    return block, prev, labels


def seed_hidden_at(taps: jax.Array, anchors: jax.Array) -> jax.Array:
    """taps `[B, S, F*D]` -> `[B, A, F*D]` at position anchor - 1 (clamped at 0), H-Spec's seed position."""
    rows = jnp.arange(taps.shape[0])[:, None]
    return taps[rows, jnp.maximum(anchors - 1, 0)]
