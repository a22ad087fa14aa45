"""The target decoder (Llama-3.x, SmolLM2, Qwen2, Qwen3) as a Flax Linen module, one call for every use.

`forward(params, config, tokens, cache, taps=...)` serves prefill, single-token decoding and
multi-token verification alike: tokens `[B, T]` are placed at each sequence's own start position
`cache.lengths[b]`, their K/V rows are written into the cache (not committed), and the call returns
logits, the tapped hidden states and the updated cache.

Tap ids follow the H-Spec reference convention: **tap i is the residual stream entering decoder layer
i**, i.e. Hugging Face `output_hidden_states[i]` (tap 0 = the embeddings, tap L = the last layer's
output before the final norm). The output of decoder layer i is therefore tap i + 1.

Parameter names mirror the Hugging Face module tree (`layers_3/self_attn/q_proj/kernel` is
`model.layers.3.self_attn.q_proj.weight` transposed), so checkpoint conversion is a plain table.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from hspec_jax.models.blocked_attention import blocked_attention
from hspec_jax.models.config import TargetConfig
from hspec_jax.models.kv_cache import KVCache, init_cache
from hspec_jax.models.layers import INIT_STD, MLP, RMSNorm, dense, rms_norm
from hspec_jax.models.rope import apply_rope, inverse_frequencies

# Attention is `blocked_attention` for every input: a prompt (more than LONG_INPUT tokens) in its default tiles;
# a decoding or verification step in key blocks of DECODE_BLOCK_K rows, so a step reads only the key blocks up to
# the batch's longest sequence, not the whole cache (at batch 16 and 768 cache rows on 2 CPU cores: 60 ms per
# SmolLM2 step instead of 132 ms with the dense `[B, N, T, S]` form, the same at batch 1;
# benchmarks/results/data_engine.md).
LONG_INPUT = 256
DECODE_BLOCK_K = 128


class DecoderOutput(NamedTuple):
    logits: jax.Array  # [B, T, V] float32 (or [B, P, V] at `logit_indices`)
    hidden: tuple[jax.Array, ...]  # one [B, T, D] per requested tap, in request order
    cache: KVCache  # with this call's rows written at lengths[b] + t; lengths unchanged


class AttentionProjections(nn.Module):
    """The projections of a target-style attention layer: q/k/v/o (+ per-head q/k norms), RoPE the HF way.

    Shared by the target's `SelfAttention` and the drafters' attention layers, so both have the same
    parameter names and layout (and a drafter layer can be initialised from a target layer by copying).
    """

    config: TargetConfig

    def setup(self):
        cfg = self.config
        kw = dict(bias=cfg.qkv_bias, dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.splits = (q_size, q_size + kv_size)
        self.fused = self.has_variable("params", "qkv_proj")  # params from `fuse_projections`
        if self.fused:
            self.qkv_proj = dense(q_size + 2 * kv_size, **kw)
        else:
            self.q_proj = dense(q_size, **kw)
            self.k_proj = dense(kv_size, **kw)
            self.v_proj = dense(kv_size, **kw)
        self.o_proj = dense(cfg.hidden_size, bias=cfg.o_bias, dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.rms_norm_eps, cfg.param_dtype)
            self.k_norm = RMSNorm(cfg.rms_norm_eps, cfg.param_dtype)
        self.inv_freq = inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)

    def query_key_value(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x `[B, T, D]`, positions `[B, T]` -> q `[B, T, N, H]`, k, v `[B, T, K, H]` (one matmul when fused)."""
        if self.fused:
            q, k, v = jnp.split(self.qkv_proj(x), self.splits, axis=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return self._query(q, positions), *self._key_value(k, v, positions)

    def key_value(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x `[B, T, D]`, positions `[B, T]` -> k, v `[B, T, K, H]`; k normed (Qwen3) and rotated, as cached."""
        if self.fused:  # only the k/v columns of the fused kernel
            kernel = self.qkv_proj.variables["params"]["kernel"][:, self.splits[0] :]
            kv = jnp.einsum("btd,df->btf", x.astype(self.config.dtype), kernel.astype(self.config.dtype))
            if self.config.qkv_bias:
                kv = kv + self.qkv_proj.variables["params"]["bias"][self.splits[0] :].astype(kv.dtype)
            k, v = jnp.split(kv, 2, axis=-1)
        else:
            k, v = self.k_proj(x), self.v_proj(x)
        return self._key_value(k, v, positions)

    def _query(self, q: jax.Array, positions: jax.Array) -> jax.Array:
        """Projected q `[B, T, N*H]` -> `[B, T, N, H]`, normed (Qwen3) and rotated."""
        q = q.reshape(*q.shape[:2], self.config.num_heads, self.config.head_dim)
        if self.config.qk_norm:
            q = self.q_norm(q)
        return apply_rope(q, positions, self.inv_freq)

    def _key_value(self, k: jax.Array, v: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Projected k, v `[B, T, K*H]` -> `[B, T, K, H]` each, k normed (Qwen3) and rotated."""
        shape = (*k.shape[:2], self.config.num_kv_heads, self.config.head_dim)
        k = k.reshape(shape)
        if self.config.qk_norm:
            k = self.k_norm(k)
        return apply_rope(k, positions, self.inv_freq), v.reshape(shape)

    def output(self, o: jax.Array) -> jax.Array:
        """o `[B, T, N, H]` -> `[B, T, D]`."""
        return self.o_proj(o.reshape(*o.shape[:2], -1))


class SelfAttention(AttentionProjections):
    """Causal (optionally sliding-window) attention that writes its new K/V rows into the cache first."""

    window: int | None = None

    def __call__(self, x, positions, cache, index, starts, doc_starts=None):
        """x `[B, T, D]`, positions `[B, T]` (RoPE), `cache` (written and read as layer `index` through its
        accessors), starts `[B]` (first row written), doc_starts `[B, T]` or None -> (out `[B, T, D]`, cache)."""
        q, k, v = self.query_key_value(x, positions)
        cache = cache.write(index, k, v, starts)
        k_buf, v_buf = cache.layer(index)
        rows = starts[:, None] + jnp.arange(x.shape[1])[None, :]
        first = doc_starts
        if self.window is not None:
            lowest = rows - self.window + 1
            first = lowest if first is None else jnp.maximum(first, lowest)
        block_k = {} if x.shape[1] > LONG_INPUT else {"block_k": DECODE_BLOCK_K}
        out = blocked_attention(q, k_buf, v_buf, rows, first, **block_k)
        return self.output(out), cache


class DecoderLayer(nn.Module):
    config: TargetConfig
    window: int | None = None

    @nn.compact
    def __call__(self, x, positions, cache, index, starts, doc_starts=None):
        cfg = self.config
        norm = dict(eps=cfg.rms_norm_eps, param_dtype=cfg.param_dtype)
        attn, cache = SelfAttention(cfg, self.window, name="self_attn")(
            RMSNorm(**norm, name="input_layernorm")(x), positions, cache, index, starts, doc_starts
        )
        x = x + attn
        mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, cfg.dtype, cfg.param_dtype, name="mlp")
        x = x + mlp(RMSNorm(**norm, name="post_attention_layernorm")(x))
        return x, cache


class Decoder(nn.Module):
    """Decoder-only LM. See the module docstring for the call contract and tap convention."""

    config: TargetConfig

    @nn.compact
    def __call__(
        self,
        tokens: jax.Array,
        cache: KVCache,
        taps: tuple[int, ...] = (),
        logit_indices: jax.Array | None = None,
        positions: jax.Array | None = None,
    ) -> DecoderOutput:
        """tokens `[B, T]` int; `logit_indices [B, P]` (optional) picks the positions to compute logits at;
        `positions [B, T]` (optional, training on packed rows): each token's position within its document,
        which starts at row `row - position`: RoPE uses it and no token attends across documents."""
        cfg = self.config
        for tap in taps:
            if not 0 <= tap <= cfg.num_layers:
                raise ValueError(f"tap id {tap} out of range 0..{cfg.num_layers}")
        embed = nn.Embed(
            cfg.vocab_size,
            cfg.hidden_size,
            embedding_init=nn.initializers.normal(INIT_STD),
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            name="embed_tokens",
        )
        starts = cache.lengths
        rows = starts[:, None] + jnp.arange(tokens.shape[1])[None, :]
        doc_starts = None if positions is None else rows - positions
        positions = rows if positions is None else positions
        x = embed(tokens)
        streams = [x]
        for i in range(cfg.num_layers):
            layer = DecoderLayer(cfg, cfg.layer_window(i), name=f"layers_{i}")
            x, cache = layer(x, positions, cache, i, starts, doc_starts)
            streams.append(x)
        hidden = tuple(streams[i] for i in taps)
        if logit_indices is not None:
            x = jnp.take_along_axis(x, logit_indices[:, :, None], axis=1)
        x = RMSNorm(cfg.rms_norm_eps, cfg.param_dtype, name="norm")(x)
        if cfg.tie_word_embeddings:
            head = embed.embedding
        else:
            head = self.param(
                "lm_head",
                nn.initializers.normal(INIT_STD),
                (cfg.vocab_size, cfg.hidden_size),
                cfg.param_dtype,
            )
        logits = jnp.einsum("btd,vd->btv", x, head.astype(cfg.dtype), preferred_element_type=jnp.float32)
        return DecoderOutput(logits, hidden, cache)


def forward(
    params: dict,
    config: TargetConfig,
    tokens: jax.Array,
    cache: KVCache,
    taps: tuple[int, ...] = (),
    logit_indices: jax.Array | None = None,
    positions: jax.Array | None = None,
) -> DecoderOutput:
    """Pure-function form of `Decoder(config)` (module docstring): tokens `[B, T]` placed at rows
    `cache.lengths[b]..` (or at `positions [B, T]`), their K/V rows written into `cache` (not committed) ->
    `DecoderOutput`: fp32 logits `[B, T, V]` (or `[B, len(logit_indices), V]`), `hidden` one `[B, T, D]` per tap id
    in `taps`, and the cache."""
    return Decoder(config).apply({"params": params}, tokens, cache, taps, logit_indices, positions)


def init_params(config: TargetConfig, rng: jax.Array) -> dict:
    """Randomly initialised target parameters, a nested dict (HF-style N(0, 0.02) linears, unit norms)."""
    cache = init_cache(config, 1, 1)
    return Decoder(config).init(rng, jnp.zeros((1, 1), jnp.int32), cache)["params"]


def param_shapes(config: TargetConfig) -> dict:
    """Every parameter's `jax.ShapeDtypeStruct`, nested as `init_params` nests them, without allocating: what a
    checkpoint is checked against. Computed once per config; a fresh dict each call."""
    return jax.tree.map(lambda x: x, _param_shapes(config))


@functools.lru_cache(maxsize=16)
def _param_shapes(config: TargetConfig) -> dict:
    """Every decoder layer has the same parameters (a sliding window changes none), so one layer is traced and its
    shapes repeated: SmolLM2's in 0.1 s instead of 1.5 s for all 30."""
    one = config.replace(num_layers=1, layer_types=config.layer_types[:1])
    shapes = jax.eval_shape(lambda: init_params(one, jax.random.key(0)))
    layer = shapes.pop("layers_0")
    return {**shapes, **{f"layers_{i}": layer for i in range(config.num_layers)}}


def embedding_matrix(params: dict) -> jax.Array:
    """The token embedding table `[V, D]`."""
    return params["embed_tokens"]["embedding"]


def lm_head_matrix(params: dict, config: TargetConfig) -> jax.Array:
    """The output projection `[V, D]` (the embedding table when tied)."""
    return embedding_matrix(params) if config.tie_word_embeddings else params["lm_head"]


def output_logits(params: dict, config: TargetConfig, hidden: jax.Array, vocab_ids: jax.Array | None = None):
    """The target's last step outside the module: final norm and lm_head of pre-norm hidden states `[..., D]`
    (tap L) -> fp32 logits `[..., V]`, or `[..., len(vocab_ids)]` over the chosen vocabulary rows only (the
    draft vocabulary in training: a full `[..., V]` never exists)."""
    head = lm_head_matrix(params, config)
    if vocab_ids is not None:
        head = head[vocab_ids]
    normed = rms_norm(hidden.astype(config.dtype), params["norm"]["scale"], config.rms_norm_eps)
    return jnp.einsum("...d,vd->...v", normed, head.astype(config.dtype), preferred_element_type=jnp.float32)
