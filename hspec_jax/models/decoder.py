"""The target decoder (Llama-3.x, SmolLM2, Qwen2, Qwen3) as a Flax Linen module, one call for every use.

`forward(params, config, tokens, cache, taps=...)` serves prefill, single-token decoding and
multi-token verification alike: tokens `[B, T]` are placed at each sequence's own start position
`cache.lengths[b]`, their K/V rows are written into the cache (not committed), and the call returns
logits, the tapped hidden states and the updated cache.

Tap ids follow the H-Spec reference convention: **tap i is the residual stream entering decoder layer
i**, i.e. Hugging Face `output_hidden_states[i]` (tap 0 = the embeddings, tap L = the last layer's
output before the final norm). The output of decoder layer i is therefore tap i + 1.

Parameter names mirror the Hugging Face module tree with the layers stacked on a leading axis
(`layers/self_attn/q_proj/kernel[3]` is `model.layers.3.self_attn.q_proj.weight` transposed), so checkpoint
conversion is a plain table (`hspec_jax.checkpoints.hf`). Every layer runs through one function,
`decoder_layer`: under `jax.lax.scan` on TPU and on CPU with the packed matmul kernel (one layer traced and
compiled whatever the depth; on CPU the kernel reads each layer's weights inside the stacks and attention its
cache rows, so the scan copies neither), or called once per layer on GPU, where XLA was measured to copy each
layer's weights out of the stacked arrays (`TargetConfig.scan_layers`, `scan_layers_default`; placement hands
that path one tree per layer, `unstack_layers`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from hspec_jax.kernels import cpu_matmul
from hspec_jax.models.blocked_attention import blocked_attention
from hspec_jax.models.config import TargetConfig
from hspec_jax.models.kv_cache import KVCache, init_cache, layer_view, put_layer
from hspec_jax.models.layers import INIT_STD, MLP, RMSNorm, dense, rms_norm
from hspec_jax.models.rope import apply_rope, inverse_frequencies

# Attention is `blocked_attention` for every input: a prompt (more than LONG_INPUT tokens) in its default tiles;
# a decoding or verification step in key blocks of DECODE_BLOCK_K rows, so a step reads only the key blocks up to
# the batch's longest sequence, not the whole cache (the data engine's SmolLM2 generation on 2 CPU cores, static
# batches of 16: 199.9 tokens/s instead of 149.8 with the dense `[B, N, T, S]` form;
# benchmarks/results/data_engine_dense_attention.md).
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
            k, v = jnp.split(self.qkv_proj.columns(x, self.splits[0]), 2, axis=-1)
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
        k_buf, v_buf, layer = cache.in_place(index)
        rows = starts[:, None] + jnp.arange(x.shape[1])[None, :]
        first = doc_starts
        if self.window is not None:
            lowest = rows - self.window + 1
            first = lowest if first is None else jnp.maximum(first, lowest)
        block_k = {} if x.shape[1] > LONG_INPUT else {"block_k": DECODE_BLOCK_K}
        out = blocked_attention(q, k_buf, v_buf, rows, first, layer=layer, **block_k)
        return self.output(out), cache


class DecoderLayer(nn.Module):
    """One pre-norm decoder layer. `window`: None (full attention), a static int, or a traced `[]` int32 when the
    decoder scans layers of different windows (`FULL_ATTENTION` for a full-attention layer)."""

    config: TargetConfig
    window: int | jax.Array | None = None

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


# The window of a full-attention layer when windows are scanned data: more rows than any cache holds.
FULL_ATTENTION = 1 << 30


def decoder_layer(layer_params: dict, config: TargetConfig, window, x, positions, cache, starts, doc_starts, index=0):
    """Decoder layer `layer_params` (one layer's tree, no layer axis) as a pure function, the one unit every layer
    runs through: x `[B, T, D]`, positions `[B, T]`, `cache` the cache this layer writes and reads as its layer
    `index` (a one-layer cache, `kv_cache.layer_view`, and 0; or a scan's stacked cache and the traced layer
    index), starts `[B]`, doc_starts `[B, T]` or None -> (x `[B, T, D]`, cache)."""
    return DecoderLayer(config, window).apply({"params": layer_params}, x, positions, cache, index, starts, doc_starts)


# Called once per layer when layers are not scanned: traced and lowered once per (config, window, shapes) and
# called L times, so tracing and lowering cost one layer; XLA compiles the calls inlined, as if unrolled.
_layer_call = jax.jit(decoder_layer, static_argnames=("config", "window"))


def stacked_layers(layers) -> bool:
    """Whether `params["layers"]` holds every layer stacked on a leading axis (a dict), not one tree per layer."""
    return isinstance(layers, dict)


def unstack_layers(layers: dict, num_layers: int) -> tuple[dict, ...]:
    """The stacked layer tree `{...: [L, ...]}` as a tuple of per-layer trees (new arrays, one per layer)."""
    return tuple(jax.tree.map(lambda a, i=i: a[i], layers) for i in range(num_layers))


def split_packed(layers: dict) -> tuple[dict, dict]:
    """A stacked layer tree as (the tree without its packed kernels, the packed kernels alone `[L, N / 16, K, 16]`,
    at the same paths): a scan slices the first per layer and leaves the second whole."""
    sliced, packed = {}, {}
    for name, value in layers.items():
        if isinstance(value, dict):
            sliced[name], packed[name] = split_packed(value)
        elif name == "packed_kernel":
            packed[name] = value
        else:
            sliced[name] = value
    return sliced, packed


def with_packed(layer: dict, packed: dict, index: jax.Array) -> dict:
    """One layer's tree (`layer`, sliced by a scan) with the packed kernels of `split_packed` put back as layer
    `index` of their stacks (`cpu_matmul.StackedLayer`: the kernel reads them in place, nothing is copied)."""
    out = dict(layer)
    for name, value in packed.items():
        if isinstance(value, dict):
            out[name] = with_packed(layer.get(name, {}), value, index)
        else:
            out[name] = cpu_matmul.StackedLayer(value, index)
    return out


def run_layers(params: dict, config: TargetConfig, x, positions, cache, starts, doc_starts, taps):
    """Every decoder layer over x `[B, T, D]` -> (x after the last layer, the requested taps, cache).

    Scanned (`config.scans_layers`, stacked params and cache): one `jax.lax.scan` step per layer over the stacked
    parameters and each layer's window, the stacked cache carried along and written and read at the step's layer
    index in place; packed kernels (`split_packed`) are not sliced but read by the kernel at that index. The
    tapped streams go into a `[len(taps) + 1, B, T, D]` buffer carried along (one extra row takes every untapped
    layer), so no layer's activations are kept otherwise. Otherwise: the same layer function called once per layer
    (`_layer_call`), on per-layer parameter trees (`unstack_layers`, which placement does once where the decoder
    does not scan; stacked params are sliced here)."""
    layers, num = params["layers"], config.num_layers
    if config.scans_layers and stacked_layers(layers):
        if isinstance(cache.k, tuple):
            raise ValueError("a decoder that scans its layers needs a stacked cache: build it with init_cache(config)")
        slot = np.full(num + 1, len(taps), np.int32)
        for j, tap in enumerate(taps):
            slot[tap] = j
        streams = jnp.zeros((len(taps) + 1, *x.shape), x.dtype).at[slot[0]].set(x)
        windows = jnp.asarray([config.layer_window(i) or FULL_ATTENTION for i in range(num)], jnp.int32)

        sliced, packed = split_packed(layers)

        def step(carry, scanned):
            x, streams, cache = carry
            layer, window, out_slot, index = scanned
            layer = with_packed(layer, packed, index)
            x, cache = decoder_layer(layer, config, window, x, positions, cache, starts, doc_starts, index)
            return (x, streams.at[out_slot].set(x), cache), None

        scanned = (sliced, windows, slot[1:], jnp.arange(num, dtype=jnp.int32))
        (x, streams, cache), _ = jax.lax.scan(step, (x, streams, cache), scanned)
        return x, tuple(streams[j] for j in range(len(taps))), cache
    per_layer = unstack_layers(layers, num) if stacked_layers(layers) else layers
    streams = [x]
    for i in range(num):
        x, view = _layer_call(
            per_layer[i], config, config.layer_window(i), x, positions, layer_view(cache, i), starts, doc_starts
        )
        cache = cache.replace(k=put_layer(cache.k, i, view.k[0]), v=put_layer(cache.v, i, view.v[0]))
        streams.append(x)
    return x, tuple(streams[i] for i in taps), cache


def forward(
    params: dict,
    config: TargetConfig,
    tokens: jax.Array,
    cache: KVCache,
    taps: tuple[int, ...] = (),
    logit_indices: jax.Array | None = None,
    positions: jax.Array | None = None,
) -> DecoderOutput:
    """The decoder (module docstring): tokens `[B, T]` placed at rows `cache.lengths[b]..`, their K/V rows written
    into `cache` (not committed) -> `DecoderOutput`: fp32 logits `[B, T, V]` (or `[B, P, V]` at `logit_indices
    [B, P]`), `hidden` one `[B, T, D]` per tap id in `taps`, and the cache. `positions [B, T]` (optional, training
    on packed rows): each token's position within its document, which starts at row `row - position`: RoPE uses
    it and no token attends across documents. `params["layers"]` is the stacked layer tree (or, as placement
    gives it where the decoder does not scan, a tuple of per-layer trees)."""
    for tap in taps:
        if not 0 <= tap <= config.num_layers:
            raise ValueError(f"tap id {tap} out of range 0..{config.num_layers}")
    with jax.named_scope("Decoder"):  # op names for profiles: `Decoder/...`, each layer's `DecoderLayer/...`
        return _forward(params, config, tokens, cache, tuple(taps), logit_indices, positions)


def _forward(params, config, tokens, cache, taps, logit_indices, positions) -> DecoderOutput:
    starts = cache.lengths
    rows = starts[:, None] + jnp.arange(tokens.shape[1])[None, :]
    doc_starts = None if positions is None else rows - positions
    positions = rows if positions is None else positions
    x = jnp.take(embedding_matrix(params), tokens, axis=0).astype(config.dtype)
    x, hidden, cache = run_layers(params, config, x, positions, cache, starts, doc_starts, taps)
    if logit_indices is not None:
        x = jnp.take_along_axis(x, logit_indices[:, :, None], axis=1)
    return DecoderOutput(output_logits(params, config, x), hidden, cache)


class _InitTree(nn.Module):
    """The parameter tree of a target with one subtree per layer (`layers_0`, ...), each drawn from the random
    stream of its name, so that a seed gives the same weights whatever the layers' in-memory layout."""

    config: TargetConfig

    @nn.compact
    def __call__(self):
        cfg = self.config
        kw = dict(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        x = nn.Embed(
            cfg.vocab_size, cfg.hidden_size, embedding_init=nn.initializers.normal(INIT_STD), **kw, name="embed_tokens"
        )(jnp.zeros((1, 1), jnp.int32))
        cache = init_cache(cfg.replace(num_layers=1, layer_types=cfg.layer_types[:1], scan_layers=False), 1, 1)
        zero = jnp.zeros((1, 1), jnp.int32)
        for i in range(cfg.num_layers):
            DecoderLayer(cfg, name=f"layers_{i}")(x, zero, cache, 0, zero[:, 0])
        RMSNorm(cfg.rms_norm_eps, cfg.param_dtype, name="norm")(x)
        if not cfg.tie_word_embeddings:
            self.param("lm_head", nn.initializers.normal(INIT_STD), (cfg.vocab_size, cfg.hidden_size), cfg.param_dtype)


@functools.partial(jax.jit, static_argnums=0)
def init_params(config: TargetConfig, rng: jax.Array) -> dict:
    """Randomly initialised target parameters (HF-style N(0, 0.02) linears and embeddings, unit norms), the
    layers stacked on a leading axis: `{"embed_tokens", "layers", "norm"[, "lm_head"]}`. One compiled program per
    config (the example forward the init traces is dead code to XLA), not op-by-op dispatch."""
    return stack_layers(_InitTree(config).init(rng)["params"], config.num_layers)


def param_shapes(config: TargetConfig) -> dict:
    """Every parameter's `jax.ShapeDtypeStruct`, nested as `init_params` nests them (layers stacked), without
    allocating: what a checkpoint is checked against. Computed once per config; a fresh dict each call."""
    return jax.tree.map(lambda x: x, _param_shapes(config))


@functools.lru_cache(maxsize=16)
def _param_shapes(config: TargetConfig) -> dict:
    """Every decoder layer has the same parameters (a sliding window changes none), so one layer is traced and its
    shapes given a leading layer axis: SmolLM2's in 0.1 s instead of 1.5 s for all 30."""
    one = config.replace(num_layers=1, layer_types=config.layer_types[:1])
    shapes = jax.eval_shape(lambda: init_params(one, jax.random.key(0)))
    stack = lambda x: jax.ShapeDtypeStruct((config.num_layers, *x.shape[1:]), x.dtype)
    return {**shapes, "layers": jax.tree.map(stack, shapes["layers"])}


def per_layer_names(params: dict, num_layers: int) -> dict:
    """`params` with the stacked `layers` tree split into `layers_0`, `layers_1`, ... (the layout before the layers
    were stacked, kept by older converted targets); works on arrays and on shapes alike."""
    rest = {key: value for key, value in params.items() if key != "layers"}
    row = lambda i: (
        lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype) if isinstance(a, jax.ShapeDtypeStruct) else a[i]
    )
    return {**rest, **{f"layers_{i}": jax.tree.map(row(i), params["layers"]) for i in range(num_layers)}}


def stack_layers(params: dict, num_layers: int) -> dict:
    """The inverse of `per_layer_names`: `layers_0` .. `layers_{L-1}` stacked into one `layers` tree."""
    rest = {key: value for key, value in params.items() if not key.startswith("layers_")}
    layers = [params[f"layers_{i}"] for i in range(num_layers)]
    return {**rest, "layers": jax.tree.map(lambda *rows: jnp.stack(rows), *layers)}


def layer_params(params: dict, i: int) -> dict:
    """Decoder layer i's parameter tree (no layer axis), from stacked or per-layer `params["layers"]`."""
    layers = params["layers"]
    return jax.tree.map(lambda a: a[i], layers) if stacked_layers(layers) else layers[i]


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
    normed = rms_norm(hidden.astype(config.dtype), params["norm"]["scale"], config.rms_norm_eps)
    if vocab_ids is None and "packed_lm_head" in params:  # placed for the packed CPU kernel (`for_backend`)
        return cpu_matmul.packed_matmul(normed, params["packed_lm_head"])
    head = lm_head_matrix(params, config)
    if vocab_ids is not None:
        head = head[vocab_ids]
    return jnp.einsum("...d,vd->...v", normed, head.astype(config.dtype), preferred_element_type=jnp.float32)
