"""The drafters as pure functions: build, initialise (randomly and from the target), draft one block.

    params = init_drafter(config, rng)                           # random init, plain nested dict
    params = init_from_target(params, config, target_params, vocab)   # copy the target layers it mirrors
    out = draft_block(params, config, embedding, block_tokens, anchors, target_cache=cache, seed_hidden=h)
    out = draft_blocks(params, config, DraftInputs(...))     # A blocks per sequence: training and inference

`drafter_param_shapes(config)` gives every parameter's shape without allocating.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from hspec_jax.drafters.config import DrafterConfig
from hspec_jax.drafters.dflash import drafter_context
from hspec_jax.drafters.family import family_of
from hspec_jax.drafters.inputs import DraftInputs
from hspec_jax.drafters.output import DraftOutput
from hspec_jax.drafters.vocab import DraftVocab, draft_rows
from hspec_jax.models.decoder import embedding_matrix, layer_params, lm_head_matrix
from hspec_jax.models.kv_cache import KVCache, init_cache

_INIT_CONTEXT_ROWS = 8


def drafter_module(config: DrafterConfig):
    """The Linen module of `config`'s family."""
    return family_of(config).module(config)


def _example_inputs(config: DrafterConfig) -> DraftInputs:
    """One block over a few context rows, with every input any family reads (for `init`)."""
    target = config.target
    rows, t = _INIT_CONTEXT_ROWS, config.block_size
    dtype = config.compute_dtype
    taps = jnp.zeros((1, 2, len(config.fusion_layer_ids) * target.hidden_size), dtype)
    return DraftInputs(
        embedding=jnp.zeros((target.vocab_size, target.hidden_size), dtype),
        block_tokens=jnp.zeros((1, 1, t), jnp.int32),
        anchors=jnp.full((1, 1), rows // 2, jnp.int32),
        seed_hidden=taps[:, :1],
        target_cache=init_cache(target, 1, rows, dtype),
        drafter_cache=drafter_context(config, 1, rows),
        inject_rows=(taps, jnp.arange(2, dtype=jnp.int32)[None], jnp.zeros((1,), jnp.int32))
        if config.owns_kv_cache
        else None,
        prev_tokens=jnp.zeros((1, 1, t), jnp.int32),
    )


@functools.partial(jax.jit, static_argnums=0)
def init_drafter(config: DrafterConfig, rng: jax.Array) -> dict:
    """Randomly initialised drafter parameters, a nested dict (the frozen pieces get real values from
    `init_from_target`). `rng`: a `jax.random.key`. One compiled program per config (the example forward the init
    traces is dead code to XLA), not op-by-op dispatch."""
    inputs = _example_inputs(config)
    embeds = inputs.embedding[inputs.block_tokens]
    params = drafter_module(config).init(rng, embeds, inputs)["params"]
    if config.mask_embedding:
        params["mask_embedding"] = jnp.zeros((config.target.hidden_size,), config.storage_dtype)
    return params


def drafter_param_shapes(config: DrafterConfig) -> dict:
    """Every parameter's `jax.ShapeDtypeStruct`, nested as `init_drafter` nests them, without allocating (traced
    once per config; a fresh dict each call)."""
    return jax.tree.map(lambda x: x, _drafter_param_shapes(config))


@functools.lru_cache(maxsize=16)
def _drafter_param_shapes(config: DrafterConfig) -> dict:
    return jax.eval_shape(lambda: init_drafter(config, jax.random.key(0)))


def block_embeddings(params: dict, config: DrafterConfig, embedding: jax.Array, block_tokens: jax.Array) -> jax.Array:
    """block_tokens `[..., T]` -> `[..., T, D]`: rows of the target's embedding `[V, D]`, except that a drafter
    with its own `mask_embedding` row uses it for `mask_token_id`."""
    embeds = embedding[block_tokens]
    if not config.mask_embedding:
        return embeds
    row = params["mask_embedding"].astype(embeds.dtype)
    return jnp.where((block_tokens == config.mask_token_id)[..., None], row, embeds)


def mirrored_target_layers(config: DrafterConfig) -> dict[str, int]:
    """Drafter attention layer name -> the target decoder layer whose KV it reads (and whose q/k/v it copies)."""
    return family_of(config).mirrored_layers(config)


COPIED_FROM_TARGET = ("q_proj", "k_proj", "v_proj", "q_norm", "k_norm")


def init_from_target(params: dict, config: DrafterConfig, target_params: dict, vocab: DraftVocab) -> dict:
    """Copy what the drafter takes from the target: the draft lm_head rows (`[Vd, D]`, the target's lm_head rows of
    `vocab`'s tokens), and for every attention layer that reads a target layer's KV cache, that layer's q/k/v
    projections (and q/k norms) so block keys match. Returns new params (copies: the target's buffers are not
    shared); `vocab` must have the config's Vd tokens over the target's V."""
    if vocab.size != config.vocab_size or vocab.t2d.shape[0] != config.target.vocab_size:
        raise ValueError(
            f"draft vocabulary of {vocab.size} tokens over {vocab.t2d.shape[0]} does not match the config "
            f"({config.vocab_size} over {config.target.vocab_size})"
        )
    out = jax.tree.map(lambda x: x, params)
    dtype = params["lm_head"].dtype
    out["lm_head"] = draft_rows(lm_head_matrix(target_params, config.target), vocab).astype(dtype)
    # Copies, never the target's own buffers: donating the drafter's params must not free the target's.
    copy = lambda x, ref: jnp.array(x, dtype=ref.dtype, copy=True)
    if config.mask_embedding:
        row = embedding_matrix(target_params)[config.mask_token_id]
        out["mask_embedding"] = copy(row, params["mask_embedding"])
    for name, layer in mirrored_target_layers(config).items():
        source = layer_params(target_params, layer)["self_attn"]
        attn = out[name]["self_attn"]
        for key in COPIED_FROM_TARGET:
            if key in attn and key in source:  # q/k norms the target lacks keep their init (ones) and train
                attn[key] = jax.tree.map(copy, source[key], attn[key])
    return out


def draft_blocks(params: dict, config: DrafterConfig, inputs: DraftInputs) -> DraftOutput:
    """The one drafter entry point, for training and inference alike: A blocks per sequence `[B, A, T]`.

    Every family takes the same `DraftInputs` and ignores what it does not use: H-Spec reads `seed_hidden`
    and the target cache; DFlash/DSpark their `drafter_cache` (after injecting `inject_rows`); "DFlash + target
    KV" the target cache. Returns a `DraftOutput` `[B, A, T, ...]` (logits over the draft vocabulary, fp32)."""
    embeds = block_embeddings(params, config, inputs.embedding, inputs.block_tokens)
    return drafter_module(config).apply({"params": params}, embeds, inputs)


def inject_context(params: dict, config: DrafterConfig, drafter_cache, inject_rows: tuple):
    """Write the K/V rows of `inject_rows` (taps `[B, C, F*D]`, positions `[B, C]`, first row `[B]`) into the
    drafter's own cache without drafting (what `draft_blocks` injects first) -> the cache. Only for drafters that
    keep one (`config.owns_kv_cache`)."""
    inject = family_of(config).inject
    if inject is None:
        raise TypeError(f"the {family_of(config).name!r} drafter family keeps no cache to inject into")
    return inject(params, config, drafter_cache, inject_rows)


def draft_block(
    params: dict,
    config: DrafterConfig,
    embedding: jax.Array,
    block_tokens: jax.Array,
    anchors: jax.Array,
    *,
    target_cache: KVCache | None = None,
    seed_hidden: jax.Array | None = None,
    drafter_cache: tuple | None = None,
    inject_rows: tuple | None = None,
    prev_tokens: jax.Array | None = None,
) -> DraftOutput:
    """`draft_blocks` with one block per sequence (A = 1), as the engine drafts. embedding `[V, D]` (the target's
    table); block_tokens `[B, T]` ([anchor, MASK...]); anchors `[B]` (slot-0 rows = committed lengths);
    seed_hidden `[B, F*D]` (fused taps of row anchor - 1); prev_tokens
    `[B, T]`; the caches and `inject_rows` as in `DraftInputs`. Returns a `DraftOutput` `[B, T, ...]`."""
    add_block_axis = lambda x: None if x is None else x[:, None]
    inputs = DraftInputs(
        embedding=embedding,
        block_tokens=block_tokens[:, None],
        anchors=anchors[:, None],
        seed_hidden=add_block_axis(seed_hidden),
        target_cache=target_cache,
        drafter_cache=drafter_cache,
        inject_rows=inject_rows,
        prev_tokens=add_block_axis(prev_tokens),
    )
    out = draft_blocks(params, config, inputs)
    squeeze = lambda x: None if x is None else x[:, 0]
    return DraftOutput(squeeze(out.hidden), squeeze(out.logits), squeeze(out.confidence), out.drafter_cache)


def block_inputs(tokens: jax.Array, anchors: jax.Array, block_size: int, mask_token_id: int, shift: int = 1):
    """Training blocks from whole sequences. tokens `[B, S]`, anchors `[B, A]` ->
    (block_tokens `[B, A, T]` = [x_a, MASK...], prev_tokens `[B, A, T]`, labels `[B, A, T]`). With `shift` = 1
    (DFlash layout) slot i predicts x_{a+i} and its prev is x_{a+i-1} (teacher forcing; slot 0 gets x_a and
    predicts nothing); with `shift` = 0 (`sample_from_anchor`) slot i predicts x_{a+i+1} and its prev is x_{a+i}."""
    offsets = jnp.arange(block_size)
    rows = jnp.arange(tokens.shape[0])[:, None, None]
    at = lambda idx: tokens[rows, jnp.clip(idx, 0, tokens.shape[1] - 1)]
    start = anchors[..., None]
    labels = at(start + offsets + 1 - shift)
    prev = at(start + jnp.maximum(offsets - shift, 0))
    return anchor_blocks(at(start)[..., 0], block_size, mask_token_id), prev, labels


def anchor_blocks(anchor_tokens: jax.Array, block_size: int, mask_token_id: int) -> jax.Array:
    """anchor tokens `[...]` -> blocks `[..., T]` = [anchor, MASK x (T - 1)]."""
    masks = jnp.full((*anchor_tokens.shape, block_size - 1), mask_token_id, anchor_tokens.dtype)
    return jnp.concatenate([anchor_tokens[..., None], masks], axis=-1)


def seed_hidden_at(taps: jax.Array, anchors: jax.Array, first_row: jax.Array | int = 0) -> jax.Array:
    """H-Spec's seed: the fused taps of the row before each block's anchor row (the last committed row).
    taps `[B, C, F*D]` hold context rows first_row .. first_row + C - 1 (first_row `[B]` or 0), anchors `[B, A]`
    -> `[B, A, F*D]` (the index clamped into taps)."""
    index = anchors - 1 - jnp.reshape(jnp.asarray(first_row), (-1, 1))
    return jnp.take_along_axis(taps, jnp.clip(index, 0, taps.shape[1] - 1)[..., None], axis=1)


def training_inputs(
    config: DrafterConfig, embedding: jax.Array, tokens, positions, anchors, taps, target_cache: KVCache
) -> DraftInputs:
    """The inputs of A training blocks per packed row. tokens, positions `[B, L]` (positions restart at 0 in each
    document), anchors `[B, A]`, taps `[B, L, F*D]` the target's fused taps of every row, `target_cache` its KV
    cache of the whole row. A drafter that keeps its own cache gets every row of the batch injected."""
    block, prev, _ = block_inputs(tokens, anchors, config.block_size, config.mask_token_id, config.first_draft_slot)
    batch, length = tokens.shape
    rows = jnp.arange(batch)[:, None]
    return DraftInputs(
        embedding=embedding,
        block_tokens=block,
        anchors=anchors,
        doc_starts=anchors - positions[rows, anchors],
        seed_hidden=seed_hidden_at(taps, anchors),
        target_cache=target_cache,
        drafter_cache=drafter_context(config, batch, length),
        inject_rows=(taps, positions, jnp.zeros((batch,), jnp.int32)),
        prev_tokens=prev,
    )


def decoding_inputs(
    config: DrafterConfig,
    embedding: jax.Array,
    anchor_tokens,
    target_cache: KVCache,
    taps,
    first_row,
    drafter_cache=None,
) -> DraftInputs:
    """The inputs of the next block while decoding (A = 1): anchor_tokens `[B]` sit at row `target_cache.lengths`
    (the committed lengths); taps `[B, C, F*D]` are the target's fused taps of the rows it has just written,
    first_row .. first_row + C - 1 (first_row `[B]`). A drafter that keeps its own cache (`drafter_cache`) gets
    those rows to inject."""
    anchors = target_cache.lengths[:, None]
    rows = first_row[:, None] + jnp.arange(taps.shape[1], dtype=jnp.int32)
    return DraftInputs(
        embedding=embedding,
        block_tokens=anchor_blocks(anchor_tokens, config.block_size, config.mask_token_id)[:, None],
        anchors=anchors,
        seed_hidden=seed_hidden_at(taps, anchors, first_row),
        target_cache=target_cache,
        drafter_cache=drafter_cache,
        inject_rows=(taps, rows, first_row) if config.owns_kv_cache else None,
    )
