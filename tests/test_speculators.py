"""Drafters in and out of the speculators format (H-Spec `mamba_attn_hybrid`, DFlash, DSpark).

The parity test feeds a checkpoint written here in the reference layout (by `write_reference_checkpoint`,
not by our exporter) to an independent numpy float64 forward of H-Spec, written from the reference notes
(`reference_hspec`), and to our importer + drafter: same logits (fp32, 1e-5) and same greedy drafts, on a
tiny Qwen3-like and a tiny Llama-like target. Round trips go ours -> speculators -> ours.
"""

import functools
import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from hspec_jax.checkpoints.convert import main as convert_main
from hspec_jax.checkpoints.drafter_io import restore_drafter, save_drafter
from hspec_jax.checkpoints.hf import CheckpointError, export_hf_target
from hspec_jax.checkpoints.speculators import export_speculators, import_speculators
from hspec_jax.decoding import SamplingConfig
from hspec_jax.decoding.proposal import propose
from hspec_jax.drafters import draft_block, drafter_config, init_drafter, init_from_target
from hspec_jax.drafters.api import block_inputs
from hspec_jax.drafters.dflash import drafter_context
from hspec_jax.drafters.mamba2 import DepthwiseConv, MambaConfig, causal_depthwise_conv
from hspec_jax.drafters.params import trainable_mask
from hspec_jax.drafters.vocab import vocab_from_ids
from hspec_jax.kernels.target_kv_attention import KernelSettings, pallas_attention, reference
from hspec_jax.models import TargetConfig, commit, forward, init_cache, init_params
from hspec_jax.models.config import RopeScaling

COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=5, num_heads=4, num_kv_heads=2)
QWEN3 = TargetConfig(model_type="qwen3", head_dim=8, qk_norm=True, rope_theta=10000.0, **COMMON)
LLAMA = TargetConfig(
    model_type="llama",
    head_dim=8,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64),
    **COMMON,
)
LENGTHS = (14, 9)
WINDOW, BLOCK, MASK = 6, 4, 5
PATTERN = ["mamba", "mlp", "mamba", "attention", "mlp", "mamba", "attention", "mlp", "mamba", "attention", "mlp"]
FUSION, ATTN_KV = (1, 2, 4), (1, 3, 4)
MAMBA = dict(num_heads=4, head_dim=8, d_state=4, n_groups=2, conv_kernel=4)
DRAFT_VOCAB, RANK = 40, 8
# One H-Spec drafter shared by the export tests (so its compiled init is shared): own mask row, mixed layer types,
# the writer's MLP width.
HSPEC_FIELDS = dict(
    mask_embedding=True,
    attn_layer_types=("sliding_attention", "full_attention", "sliding_attention"),
    intermediate_size=40,
)


@functools.cache
def target_setup(target):
    """Target params and a ragged prefill: (params, cache, taps at every position [B, S, F*D], anchor tokens)."""
    params = init_params(target, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 6, target.vocab_size)
    out = jax.jit(forward, static_argnums=(1, 4))(params, target, tokens, init_cache(target, 2, 24), FUSION)
    return params, commit(out.cache, jnp.array(LENGTHS)), jnp.concatenate(out.hidden, -1), jnp.array([7, 11])


@pytest.fixture(scope="module", params=[QWEN3, LLAMA], ids=["qwen3", "llama"])
def setup(request):
    return request.param, *target_setup(request.param)


# ---------------------------------------------------------------- a writer following the reference layout


def reference_config(target, layer_types, **overrides):
    """A speculators `mamba_attn_hybrid` config.json, field by field from the reference notes (section 4)."""
    arch = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}[target.model_type]
    rope = {"rope_theta": target.rope_theta, "rope_type": "default"}
    if target.rope_scaling is not None:
        s = target.rope_scaling
        rope = {
            "rope_theta": target.rope_theta,
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
    layer = {
        "model_type": target.model_type,
        "vocab_size": target.vocab_size,
        "hidden_size": target.hidden_size,
        "intermediate_size": 40,
        "num_hidden_layers": 3,
        "num_attention_heads": target.num_heads,
        "num_key_value_heads": target.num_kv_heads,
        "head_dim": target.head_dim,
        "rms_norm_eps": target.rms_norm_eps,
        "sliding_window": WINDOW,
        "layer_types": layer_types,
        "rope_parameters": rope,
        "use_qk_norm": True,
    }
    return {
        "speculators_model_type": "mamba_attn_hybrid",
        "architectures": ["MambaAttnHybridDraftModel"],
        "speculators_version": "0.0.test",
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "mamba_attn_hybrid",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": BLOCK - 1}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": "tiny/verifier", "architectures": [arch]},
        },
        "draft_vocab_size": DRAFT_VOCAB,
        "block_size": BLOCK,
        "max_anchors": 16,
        "mask_token_id": MASK,
        "aux_hidden_state_layer_ids": sorted(set(ATTN_KV)),
        "attn_kv_layer_ids": list(ATTN_KV),
        "latent_fusion_layer_ids": list(FUSION),
        "block_pattern": PATTERN,
        "attn_rope": [{"rope_parameters": rope, "sliding_window": None, "layer_type": "full_attention"}] * 3,
        "mamba_d_state": MAMBA["d_state"],
        "mamba_num_heads": MAMBA["num_heads"],
        "mamba_head_dim": MAMBA["head_dim"],
        "mamba_n_groups": MAMBA["n_groups"],
        "mamba_conv_kernel": MAMBA["conv_kernel"],
        "mamba_expand": 1,
        "mamba_seed_mode": "shared",
        "disable_mamba_init_state_injection": False,
        "disable_target_kv_reuse": False,
        "use_qk_norm": True,
        "fc_norm": False,
        "verifier_layer_prefix": "model.layers",
        "markov_rank": RANK,
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "sliding_window_non_causal": False,
        "sliding_window_prefix": 0,
        "trainable_q_proj": True,
        "trainable_kv_proj": True,
        "layer_mapping": None,
        "agg_mode": "avg",
        "no_mlp_layer_indices": None,
        **overrides,
    }


def reference_tensors(target, target_params, rng, *, new_mask_row=True):
    """Random weights under the reference's names and torch layouts ([out, in] linears, conv [C, 1, K])."""
    d, hd, heads, kv = target.hidden_size, target.head_dim, target.num_heads, target.num_kv_heads
    h, p, n, g, k = (MAMBA[x] for x in ("num_heads", "head_dim", "d_state", "n_groups", "conv_kernel"))
    inner, conv = h * p, h * p + 2 * g * n
    w = lambda *shape: (rng.standard_normal(shape) * 0.3).astype(np.float32)
    scale = lambda size: (1.0 + 0.2 * rng.standard_normal(size)).astype(np.float32)
    ids = np.sort(rng.choice(target.vocab_size, DRAFT_VOCAB, replace=False))
    t2d = np.zeros(target.vocab_size, bool)
    t2d[ids] = True
    embed = np.array(target_params["embed_tokens"]["embedding"], np.float32)
    if new_mask_row:
        embed[MASK] = w(d)
    tensors = {
        "embed_tokens.weight": embed,
        "lm_head.weight": w(DRAFT_VOCAB, d),
        "norm.weight": scale(d),
        "fc.weight": w(d, len(FUSION) * d) / 2,
        "hidden_norm.weight": scale(d),
        "seed_projs.0.weight": w(h * p * n, d),
        "markov_head.markov_w1.weight": w(target.vocab_size, RANK),
        "markov_head.markov_w2.weight": w(DRAFT_VOCAB, RANK),
        "confidence_head.proj.weight": w(1, d + RANK),
        "confidence_head.proj.bias": w(1),
        "t2d": t2d,
        "d2t": (ids - np.arange(DRAFT_VOCAB)).astype(np.int64),
    }
    for i, kind in enumerate(PATTERN):
        pre = f"layers.{i}."
        if kind == "mamba":
            tensors.update(
                {
                    pre + "ssm_norm.weight": scale(d),
                    pre + "ssm.in_proj.weight": w(inner + conv + h, d),
                    pre + "ssm.conv1d.weight": w(conv, 1, k),
                    pre + "ssm.conv1d.bias": w(conv),
                    pre + "ssm.A_log": np.log(np.arange(1, h + 1)).astype(np.float32) + w(h),
                    pre + "ssm.D": scale(h),
                    pre + "ssm.dt_bias": w(h),
                    pre + "ssm.norm.weight": scale(inner),
                    pre + "ssm.out_proj.weight": w(d, inner),
                }
            )
        elif kind == "attention":
            tensors.update(
                {
                    pre + "input_layernorm.weight": scale(d),
                    pre + "self_attn.q_proj.weight": w(heads * hd, d),
                    pre + "self_attn.k_proj.weight": w(kv * hd, d),
                    pre + "self_attn.v_proj.weight": w(kv * hd, d),
                    pre + "self_attn.o_proj.weight": w(d, heads * hd),
                    pre + "self_attn.q_norm.weight": scale(hd),
                    pre + "self_attn.k_norm.weight": scale(hd),
                }
            )
        else:
            tensors.update(
                {
                    pre + "mlp_norm.weight": scale(d),
                    pre + "mlp.gate_proj.weight": w(40, d),
                    pre + "mlp.up_proj.weight": w(40, d),
                    pre + "mlp.down_proj.weight": w(d, 40),
                }
            )
    return tensors


def write_reference_checkpoint(directory, config: dict, tensors: dict) -> str:
    os.makedirs(directory, exist_ok=True)
    safetensors.numpy.save_file(tensors, os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return str(directory)


# ---------------------------------------------------------------- an independent numpy float64 H-Spec forward


def np_rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def np_silu(x):
    return x / (1.0 + np.exp(-x))


def np_inv_freq(head_dim, rope):
    inv = 1.0 / rope["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim)
    if rope["rope_type"] != "llama3":
        return inv
    orig, low, high, factor = (
        rope[k] for k in ("original_max_position_embeddings", "low_freq_factor", "high_freq_factor", "factor")
    )
    wavelen = 2 * np.pi / inv
    smooth = (orig / wavelen - low) / (high - low)
    mid = (1 - smooth) * inv / factor + smooth * inv
    return np.where(wavelen < orig / high, inv, np.where(wavelen > orig / low, inv / factor, mid))


def np_rope(x, positions, inv):
    """x [T, heads, hd], rotate-half."""
    angles = positions[:, None] * inv[None, :]
    cos, sin = np.cos(np.concatenate([angles] * 2, -1))[:, None], np.sin(np.concatenate([angles] * 2, -1))[:, None]
    half = x.shape[-1] // 2
    return x * cos + np.concatenate([-x[..., half:], x[..., :half]], -1) * sin


def np_mamba(x, s, pre, state0):
    h, p, n, g, k = (MAMBA[x] for x in ("num_heads", "head_dim", "d_state", "n_groups", "conv_kernel"))
    inner, t = h * p, x.shape[0]
    zxbcdt = x @ s[pre + "in_proj.weight"].T
    z, xbc, dt = zxbcdt[:, :inner], zxbcdt[:, inner:-h], zxbcdt[:, -h:]
    kernel = s[pre + "conv1d.weight"][:, 0, :]  # [C, K]
    padded = np.concatenate([np.zeros((k - 1, xbc.shape[1])), xbc])
    conv = s[pre + "conv1d.bias"] + sum(kernel[:, j] * padded[j : j + t] for j in range(k))
    xbc = np_silu(conv)
    xs, bs, cs = xbc[:, :inner].reshape(t, h, p), xbc[:, inner : inner + g * n], xbc[:, inner + g * n :]
    group = np.arange(h) // (h // g)
    bh, ch = bs.reshape(t, g, n)[:, group], cs.reshape(t, g, n)[:, group]
    dt = np.log1p(np.exp(dt + s[pre + "dt_bias"]))
    a = -np.exp(s[pre + "A_log"])
    state, ys = state0, []
    for i in range(t):
        state = np.exp(dt[i] * a)[:, None, None] * state + dt[i][:, None, None] * xs[i][:, :, None] * bh[i][:, None]
        ys.append((state * ch[i][:, None, :]).sum(-1) + s[pre + "D"][:, None] * xs[i])
    u = np.stack(ys).reshape(t, inner) * np_silu(z)
    return np_rms(u, s[pre + "norm.weight"], 1e-5) @ s[pre + "out_proj.weight"].T


def np_attention(x, s, pre, layer, k_ctx, v_ctx, anchor, sliding, rope_inv):
    t, hd = x.shape[0], layer["head_dim"]
    heads, kv, eps = layer["num_attention_heads"], layer["num_key_value_heads"], layer["rms_norm_eps"]
    q = (x @ s[pre + "q_proj.weight"].T).reshape(t, heads, hd)
    k = (x @ s[pre + "k_proj.weight"].T).reshape(t, kv, hd)
    v = (x @ s[pre + "v_proj.weight"].T).reshape(t, kv, hd)
    q, k = np_rms(q, s[pre + "q_norm.weight"], eps), np_rms(k, s[pre + "k_norm.weight"], eps)
    positions = anchor + np.arange(t)
    q, k = np_rope(q, positions, rope_inv), np_rope(k, positions, rope_inv)
    keys = np.concatenate([k_ctx[:anchor], k])  # the target's cached keys as stored, then the block's
    values = np.concatenate([v_ctx[:anchor], v])
    rows = np.arange(anchor + t)
    out = np.zeros((t, heads, hd))
    for slot in range(t):
        # sliding: a per-query window ending at the query, causal inside the block; full: everything before the
        # anchor and the whole block
        full = np.ones(anchor + t, bool)
        seen = (rows >= anchor + slot - WINDOW + 1) & (rows <= anchor + slot) if sliding else full
        for head in range(heads):
            scores = keys[seen, head // (heads // kv)] @ q[slot, head] / np.sqrt(hd)
            prob = np.exp(scores - scores.max())
            out[slot, head] = prob @ values[seen, head // (heads // kv)] / prob.sum()
    return out.reshape(t, -1) @ s[pre + "o_proj.weight"].T


def reference_hspec(s, spec, block, anchor, seed, target_kv):
    """Base logits [T, Vd] of one block. s: the reference tensors (float64); target_kv: per attention
    sub-layer the target's cached (k, v) [S, K, H] of its mapped layer; seed: taps at anchor - 1 [F*D]."""
    layer = spec["transformer_layer_config"]
    eps = layer["rms_norm_eps"]
    rope_inv = np_inv_freq(layer["head_dim"], spec["attn_rope"][0]["rope_parameters"])
    z = np_rms(s["fc.weight"] @ seed, s["hidden_norm.weight"], eps)
    state0 = (s["seed_projs.0.weight"] @ z).reshape(MAMBA["num_heads"], MAMBA["head_dim"], MAMBA["d_state"])
    h = s["embed_tokens.weight"][block]
    attn = 0
    for i, kind in enumerate(spec["block_pattern"]):
        pre = f"layers.{i}."
        if kind == "mamba":
            h = h + np_mamba(np_rms(h, s[pre + "ssm_norm.weight"], eps), s, pre + "ssm.", state0)
        elif kind == "attention":
            sliding = layer["layer_types"][attn] == "sliding_attention"
            k_ctx, v_ctx = target_kv[attn]
            normed = np_rms(h, s[pre + "input_layernorm.weight"], eps)
            h = h + np_attention(normed, s, pre + "self_attn.", layer, k_ctx, v_ctx, anchor, sliding, rope_inv)
            attn += 1
        else:
            x = np_rms(h, s[pre + "mlp_norm.weight"], eps)
            gate, up = x @ s[pre + "mlp.gate_proj.weight"].T, x @ s[pre + "mlp.up_proj.weight"].T
            h = h + (np_silu(gate) * up) @ s[pre + "mlp.down_proj.weight"].T
    return np_rms(h, s["norm.weight"], eps) @ s["lm_head.weight"].T


def reference_drafts(s, logits, anchor_token):
    """Greedy sequential Markov drafting (target ids) from base logits [T, Vd] (slots 1..T-1 draft)."""
    prev, drafts = anchor_token, []
    for i in range(1, logits.shape[0]):
        bias = s["markov_head.markov_w2.weight"] @ s["markov_head.markov_w1.weight"][prev]
        d = int(np.argmax(logits[i] + bias))
        prev = d + int(s["d2t"][d])
        drafts.append(prev)
    return drafts


# ---------------------------------------------------------------- helpers on our side


def our_drafts(config, params, vocab, target_params, cache, taps, anchors):
    """(base logits [B, T, Vd], greedy drafts [B, k]) of our drafter for a block after each prompt."""
    masks = jnp.full((2, config.block_size - 1), config.mask_token_id)
    block = jnp.concatenate([anchors[:, None], masks], 1)
    positions = jnp.broadcast_to(jnp.arange(taps.shape[1]), taps.shape[:2])
    kw = dict(  # every input; each family reads what it uses
        target_cache=cache,
        seed_hidden=taps[jnp.arange(2), cache.lengths - 1],
        drafter_cache=drafter_context(config, 2, cache.capacity),
        inject_rows=(taps, positions, positions[:, 0]),
    )
    embedding = target_params["embed_tokens"]["embedding"]
    out = jax.jit(draft_block, static_argnums=1)(params, config, embedding, block, cache.lengths, **kw)
    logits = out.logits[:, config.first_draft_slot :]
    proposal = propose(logits, anchors, vocab, SamplingConfig(), jax.random.key(0), params.get("markov_head"))
    return np.asarray(out.logits), np.asarray(proposal.tokens)


def perturbed(params, seed=3):
    """Every parameter moved off its initial value (so a wrongly mapped tensor shows)."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noisy = [x + 0.1 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys, strict=True)]
    return jax.tree.unflatten(tree, noisy)


def our_drafter(kind, target, target_params, **fields):
    fields = dict(
        fusion_layer_ids=FUSION,
        attn_kv_layer_ids=ATTN_KV,
        mamba=MambaConfig(**MAMBA),
        block_size=BLOCK,
        draft_vocab_size=DRAFT_VOCAB,
        mask_token_id=MASK,
        sliding_window=WINDOW,
        markov_rank=RANK,
        confidence_head=True,
        num_layers=2,
        **fields,
    )
    config = drafter_config(kind, target, **fields)
    vocab = vocab_from_ids(np.arange(3, 3 + DRAFT_VOCAB), target.vocab_size)
    params = init_drafter(config, jax.random.key(2))
    params = perturbed(init_from_target(params, config, target_params, vocab))
    return config, params, vocab


def assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y))


# ---------------------------------------------------------------- tests


def test_reference_checkpoint_matches_numpy_forward(setup, tmp_path):
    """Parity, reference details 1, 2, 4, 5: the imported drafter's logits equal the float64 reference (mask row
    from the checkpoint, q/k norms on the block even for Llama, causal sliding / bidirectional full sub-layers,
    per-query window) and the greedy drafts are identical."""
    target, target_params, cache, taps, anchors = setup
    spec = reference_config(target, ["sliding_attention", "full_attention", "sliding_attention"])
    tensors = reference_tensors(target, target_params, np.random.default_rng(0))
    source = write_reference_checkpoint(tmp_path / "ref", spec, tensors)
    config, params, vocab = import_speculators(source, target, target_params)
    assert config.mask_embedding and config.window_mode == "query" and config.attention_qk_norm
    logits, drafts = our_drafts(config, params, vocab, target_params, cache, taps, anchors)
    s = {k: v.astype(np.float64) if v.dtype == np.float32 else v for k, v in tensors.items()}
    for b, anchor in enumerate(LENGTHS):
        block = np.array([int(anchors[b])] + [MASK] * (BLOCK - 1))
        kv = [
            (np.asarray(cache.k[layer][b], np.float64), np.asarray(cache.v[layer][b], np.float64)) for layer in ATTN_KV
        ]
        seed = np.asarray(taps[b, anchor - 1], np.float64)
        ref = reference_hspec(s, spec, block, anchor, seed, kv)
        np.testing.assert_allclose(logits[b], ref, atol=1e-5, rtol=1e-5)
        assert list(drafts[b]) == reference_drafts(s, ref, int(anchors[b]))


def test_mask_row_and_verifier_checks(tmp_path):
    """Detail 1: an unchanged mask row is the target's (no own row); a checkpoint whose embedding differs
    elsewhere, or names another verifier architecture, is refused with a one-line error."""
    target_params = target_setup(QWEN3)[0]
    spec = reference_config(QWEN3, ["sliding_attention"] * 3)
    tensors = reference_tensors(QWEN3, target_params, np.random.default_rng(1), new_mask_row=False)
    config, _, _ = import_speculators(write_reference_checkpoint(tmp_path / "a", spec, tensors), QWEN3, target_params)
    assert not config.mask_embedding
    tensors["embed_tokens.weight"][9] += 1.0
    with pytest.raises(CheckpointError, match="another verifier"):
        import_speculators(write_reference_checkpoint(tmp_path / "b", spec, tensors), QWEN3, target_params)
    tensors["embed_tokens.weight"][9] -= 1.0
    spec["speculators_config"]["verifier"]["architectures"] = ["LlamaForCausalLM"]
    with pytest.raises(CheckpointError, match="LlamaForCausalLM"):
        import_speculators(write_reference_checkpoint(tmp_path / "c", spec, tensors), QWEN3, target_params)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda spec, t: spec.update(speculators_model_type="eagle3"), "unsupported speculators_model_type 'eagle3'"),
        (
            lambda spec, t: t.pop("layers.3.self_attn.k_norm.weight"),
            "missing tensor 'layers.3.self_attn.k_norm.weight'",
        ),
        (lambda spec, t: t.update(extra=np.zeros(2, np.float32)), "unknown tensor 'extra'"),
        (lambda spec, t: spec.update(new_field=1), "unknown mamba_attn_hybrid config field 'new_field'"),
        (lambda spec, t: t.update({"fc.weight": t["fc.weight"][:, :-1]}), "tensor 'fc.weight' has shape"),
        (lambda spec, t: spec["transformer_layer_config"].update(hidden_size=48), "hidden_size: checkpoint 48"),
    ],
    ids=["model_type", "missing", "unknown", "field", "shape", "verifier"],
)
def test_strict_import_errors(change, message, tmp_path):
    target_params = target_setup(QWEN3)[0]
    spec = reference_config(QWEN3, ["sliding_attention"] * 3)
    tensors = reference_tensors(QWEN3, target_params, np.random.default_rng(2))
    change(spec, tensors)
    with pytest.raises(CheckpointError, match=message):
        import_speculators(write_reference_checkpoint(tmp_path, spec, tensors), QWEN3, target_params)


@pytest.mark.parametrize(
    ("kind", "target", "fields"),
    [
        ("hspec", QWEN3, HSPEC_FIELDS),
        ("hspec", LLAMA, dict(mask_embedding=True, qk_norm=True, window_mode="query")),
        ("dspark", QWEN3, dict(mask_embedding=True)),
        ("dflash", LLAMA, dict(mask_embedding=True, attn_layer_types=("full_attention", "sliding_attention"))),
    ],
    ids=["hspec-qwen3", "hspec-llama", "dspark", "dflash"],
)
def test_round_trip(kind, target, fields, tmp_path):
    """ours -> speculators -> ours: the same config, bit-identical fp32 params and vocabulary, the same drafts;
    the mask-token row travels in embed_tokens; sharded output (an index) reads back the same."""
    target_params, cache, taps, anchors = target_setup(target)
    config, params, vocab = our_drafter(kind, target, target_params, **fields)
    export_speculators(tmp_path, params, config, vocab, target_params, verifier="tiny", max_shard_bytes=20_000)
    assert os.path.isfile(tmp_path / "model.safetensors.index.json")
    back, back_params, back_vocab = import_speculators(
        str(tmp_path), target, target_params, window_mode=config.window_mode
    )
    assert back == config
    assert_trees_equal(back_params, params)
    assert np.array_equal(back_vocab.d2t, vocab.d2t) and np.array_equal(back_vocab.t2d, vocab.t2d)
    before = our_drafts(config, params, vocab, target_params, cache, taps, anchors)
    after = our_drafts(back, back_params, back_vocab, target_params, cache, taps, anchors)
    assert np.array_equal(before[1], after[1]) and np.array_equal(before[0], after[0])


def test_export_layout_names_and_bf16(tmp_path):
    """The exported H-Spec tensors have the reference's names and torch layouts, in bf16 when asked."""
    target_params = target_setup(QWEN3)[0]
    config, params, vocab = our_drafter("hspec", QWEN3, target_params, **HSPEC_FIELDS)
    export_speculators(tmp_path, params, config, vocab, target_params, dtype=jnp.bfloat16)
    state = safetensors.numpy.load_file(tmp_path / "model.safetensors")
    spec = json.loads((tmp_path / "config.json").read_text())
    expected = reference_tensors(QWEN3, target_params, np.random.default_rng(0))
    assert set(state) == set(expected)
    for name, value in expected.items():
        assert state[name].shape == value.shape, name
    assert state["layers.0.ssm.in_proj.weight"].dtype == ml_dtypes.bfloat16
    assert state["t2d"].dtype == bool and state["d2t"].dtype == np.int64
    assert spec["speculators_model_type"] == "mamba_attn_hybrid" and spec["block_pattern"] == PATTERN
    assert spec["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == BLOCK - 1
    assert "verifier_lm_head.weight" not in state


def test_qk_norms_on_a_target_without_them_train():
    """Detail 2: forced q/k norms on a Llama target are the drafter's own (ones, trainable); on Qwen3 they are
    copies of the target's and stay frozen."""
    for target, trainable in ((LLAMA, True), (QWEN3, False)):
        fields = dict(fusion_layer_ids=FUSION, attn_kv_layer_ids=ATTN_KV, mamba=MambaConfig(**MAMBA))
        config = drafter_config("hspec", target, qk_norm=True, mask_embedding=True, **fields)
        mask = trainable_mask(jax.eval_shape(lambda c=config: init_drafter(c, jax.random.key(0))), config)
        assert bool(mask["layers_3"]["self_attn"]["k_norm"]["scale"]) is trainable
        assert not mask["lm_head"] and not mask["mask_embedding"]


def test_dspark_samples_from_anchor():
    """Detail 3: "dspark" is speculators' DSpark: k slots [anchor, MASK x (k-1)], slot i drafts token a+i+1 with
    prev token x_{a+i}; the DFlash-layout variant is "dflash_markov"; both draft k = 7 from the paper recipe."""
    fields = dict(fusion_layer_ids=FUSION, block_size=8, mask_token_id=MASK)
    dspark, old = drafter_config("dspark", QWEN3, **fields), drafter_config("dflash_markov", QWEN3, **fields)
    assert (dspark.sample_from_anchor, dspark.block_size, dspark.num_drafts, dspark.first_draft_slot) == (True, 7, 7, 0)
    assert (old.sample_from_anchor, old.block_size, old.num_drafts, old.kind) == (False, 8, 7, "dflash_markov")
    tokens = jnp.arange(20)[None] + 10
    block, prev, labels = block_inputs(tokens, jnp.array([[4]]), 3, MASK, shift=0)
    assert block.tolist() == [[[14, MASK, MASK]]] and prev.tolist() == [[[14, 15, 16]]]
    assert labels.tolist() == [[[15, 16, 17]]]


def test_per_query_window_attention():
    """Detail 5: with a per-query window, slot t sees context rows >= a + t - W + 1 (checked against an explicit
    mask), unlike the block-anchored window; the kernel path (GPU variant, interpret mode) agrees."""
    rng = np.random.default_rng(0)
    b, a, t, n, k, h, s, w = 1, 2, 4, 4, 2, 16, 24, 6
    q = jnp.asarray(rng.standard_normal((b, a, t, n, h)), jnp.float32)
    k_blk, v_blk = (jnp.asarray(rng.standard_normal((b, a, t, k, h)), jnp.float32) for _ in range(2))
    k_ctx, v_ctx = (jnp.asarray(rng.standard_normal((b, s, k, h)), jnp.float32) for _ in range(2))
    anchors = jnp.array([[9, 20]])
    args = (q, k_blk, v_blk, k_ctx, v_ctx, anchors)
    attend = jax.jit(reference, static_argnames=("window", "per_query_window"))
    ours = attend(*args, window=w, per_query_window=True)
    explicit = np.zeros((b, a, t, n, h))
    for j, anchor in enumerate([9, 20]):
        keys = np.concatenate([np.asarray(k_ctx[0]), np.asarray(k_blk[0, j])])
        values = np.concatenate([np.asarray(v_ctx[0]), np.asarray(v_blk[0, j])])
        rows = np.concatenate([np.arange(s), anchor + np.arange(t)])
        for slot in range(t):
            seen = np.concatenate([np.arange(s) < anchor, np.arange(t) <= slot]) & (rows >= anchor + slot - w + 1)
            for head in range(n):
                sc = keys[seen, head // 2] @ np.asarray(q[0, j, slot, head]) / np.sqrt(h)
                p = np.exp(sc - sc.max())
                explicit[0, j, slot, head] = p @ values[seen, head // 2] / p.sum()
    np.testing.assert_allclose(ours, explicit, atol=1e-5)
    assert not np.allclose(ours, attend(*args, window=w), atol=1e-3)
    settings = KernelSettings(variant="gpu", interpret=True)
    kernel = jax.jit(pallas_attention, static_argnames=("window", "per_query_window", "settings"))(
        *args, window=w, per_query_window=True, settings=settings
    )
    np.testing.assert_allclose(kernel, ours, atol=1e-5)


def test_conv_in_fp32_then_cast():
    """Detail 6: in a bf16 drafter the depthwise conv is computed in fp32 and rounded once (vLLM's short-block
    path), not accumulated in bf16."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 8, 16)), jnp.bfloat16)
    conv = DepthwiseConv(4, jnp.bfloat16, jnp.bfloat16)
    params = conv.init(jax.random.key(0), x)
    params = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), p.dtype), params)
    out = conv.apply(params, x)
    kernel, bias = params["params"]["kernel"], params["params"]["bias"]
    f32 = lambda a: a.astype(jnp.float32)
    expected = causal_depthwise_conv(f32(x), f32(kernel), f32(bias)).astype(jnp.bfloat16)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(expected, np.float32))
    in_bf16 = causal_depthwise_conv(x, kernel, bias)
    assert not np.array_equal(np.asarray(out, np.float32), np.asarray(in_bf16, np.float32))


def test_convert_cli_both_directions(tmp_path, capsys):
    """`convert --format speculators` exports a drafter checkpoint, `--format drafter` imports it back for the
    same target (bit-identical); importing for a mismatched target is a one-line error."""
    target_params = target_setup(QWEN3)[0]
    export_hf_target(target_params, QWEN3, str(tmp_path / "target"))
    config, params, vocab = our_drafter("hspec", QWEN3, target_params, **HSPEC_FIELDS)
    save_drafter(str(tmp_path / "drafter"), params, config, vocab)
    argv = ["--from", str(tmp_path / "drafter"), "--to", str(tmp_path / "spec"), "--format", "speculators"]
    assert convert_main([*argv, "--target", str(tmp_path / "target")]) == 0
    argv = ["--from", str(tmp_path / "spec"), "--to", str(tmp_path / "back"), "--format", "drafter"]
    assert convert_main([*argv, "--target", str(tmp_path / "target"), "--window-mode", "block"]) == 0
    back, back_params, _ = restore_drafter(str(tmp_path / "back"))
    assert back.replace(target=config.target) == config
    assert_trees_equal(back_params, params)
    export_hf_target(target_setup(LLAMA)[0], LLAMA, str(tmp_path / "llama"))
    from hspec_jax.cli import run

    argv = ["--from", str(tmp_path / "spec"), "--to", str(tmp_path / "bad"), "--format", "drafter"]
    assert run(convert_main, [*argv, "--target", str(tmp_path / "llama")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "does not match the target" in err[0]


@pytest.mark.slow
def test_smollm2_drafter_exports_and_reimports(smollm2, tmp_path):
    """The shipped SmolLM2 H-Spec drafter goes to speculators and back bit-identically (its bf16 values, held in
    fp32, and the target's lm_head rows); the recipe's explicit fusion rank (= hidden size) and parameter dtype come
    back as the defaults."""
    target, target_params = smollm2
    config, params, vocab = restore_drafter("smollm2-hspec", target, target_params)
    export_speculators(tmp_path, params, config, vocab, target_params, verifier="HuggingFaceTB/SmolLM2-135M-Instruct")
    back, back_params, back_vocab = import_speculators(str(tmp_path), target, target_params, window_mode="block")
    assert back.latent_size == config.latent_size == target.hidden_size
    assert back.replace(fusion_rank=config.fusion_rank, param_dtype=config.param_dtype) == config
    assert not back.mask_embedding
    assert_trees_equal(back_params, params)
    assert np.array_equal(back_vocab.d2t, vocab.d2t)
