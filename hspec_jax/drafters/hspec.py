"""H-Spec: the Mamba-attention hybrid drafter that keeps no KV cache of its own.

One forward drafts a whole block [anchor, MASK x k] at positions a .. a+k:

1. latent fusion: z = hidden_norm(fc(concat of the target's tapped hidden states at position a-1)),
   then per seed projection S0 = seed_proj(z) viewed as `[H, P, N]` (O(1) memory in the context length);
2. the sub-layers of `block_pattern`: Mamba-2 from S0 (zero conv history), attention whose queries are the
   block and whose context is the target's own cached K/V of one mapped layer (read in place, rows < a,
   within the sliding window) plus the block itself (causal for windowed sub-layers, bidirectional for
   full-attention ones; `attention_layout`), and SwiGLU MLPs; all pre-norm + residual. The block's queries and
   keys get q/k norms when `attention_qk_norm` (the target's setting, or forced on as in the reference for
   targets without them); the cached context keys are used as stored;
3. final norm, the frozen draft lm_head (target lm_head rows of the draft vocabulary), and the Markov /
   confidence heads (`heads.py`).

Ablations on the same module: `use_state_injection=False` ("KV only": S0 = 0, hidden states unused) and
`use_target_kv=False` ("last-token only": attention sees only the block).
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from hspec_jax.drafters.config import HSpecConfig
from hspec_jax.drafters.family import DrafterFamily, DrafterKind, register_family, register_kind
from hspec_jax.drafters.heads import ConfidenceHead, MarkovHead
from hspec_jax.drafters.inputs import DraftInputs
from hspec_jax.drafters.layers import AttentionSubLayer, MambaSubLayer, MLPSubLayer
from hspec_jax.drafters.mamba2 import MambaConfig
from hspec_jax.drafters.output import DraftOutput, apply_heads, draft_logits
from hspec_jax.models.layers import RMSNorm, dense


class HSpec(nn.Module):
    config: HSpecConfig

    @nn.compact
    def __call__(self, embeds, inputs: DraftInputs) -> DraftOutput:
        """embeds `[B, A, T, D]` (target embeddings of the block tokens); `inputs` (see `DraftInputs`): anchors,
        doc_starts, seed_hidden `[B, A, F*D]` (concatenated taps at anchor - 1), prev_tokens, and target_cache,
        whose mapped layer (`attn_kv_layer_ids`) each attention sub-layer reads in place (`cache.layer(i)`)."""
        cfg = self.config
        target = cfg.target
        dtype, pdtype, eps = cfg.compute_dtype, cfg.storage_dtype, target.rms_norm_eps
        b, a = inputs.anchors.shape
        seeds = []
        if cfg.num_seed_projections:
            fc = dense(cfg.latent_size, "fc", dtype=dtype, param_dtype=pdtype)
            latent = RMSNorm(eps, pdtype, name="hidden_norm")(fc(inputs.seed_hidden.astype(dtype)))
            size = cfg.mamba.num_heads * cfg.mamba.head_dim * cfg.mamba.d_state
            for j in range(cfg.num_seed_projections):
                seed = dense(size, f"seed_projs_{j}", dtype=dtype, param_dtype=pdtype)(latent)
                seeds.append(seed.astype(jnp.float32).reshape(b, a, *cfg.mamba.state_shape))
        attention = target.replace(dtype=dtype, param_dtype=pdtype, qk_norm=cfg.attention_qk_norm)
        h = embeds.astype(dtype)
        mamba_index = attn_index = 0
        for i, kind in enumerate(cfg.block_pattern):
            if kind == "mamba":
                seed_index = cfg.seed_index(mamba_index)
                state0 = seeds[seed_index] if seed_index is not None else None
                h = MambaSubLayer(target.hidden_size, cfg.mamba, eps, dtype, pdtype, name=f"layers_{i}")(h, state0)
                mamba_index += 1
            elif kind == "attn":
                context = inputs.target_cache.layer(cfg.attn_kv_layer_ids[attn_index]) if cfg.use_target_kv else None
                window, causal = cfg.attention_layout(attn_index, default_causal=True)
                sub = AttentionSubLayer(
                    attention, eps, window, causal, cfg.window_mode, cfg.attention_impl, name=f"layers_{i}"
                )
                h = sub(h, inputs.anchors, inputs.doc_starts, context)
                attn_index += 1
            else:
                h = MLPSubLayer(target.hidden_size, cfg.mlp_size, eps, dtype, pdtype, name=f"layers_{i}")(h)
        hidden, logits = draft_logits(self, cfg, h)
        markov = MarkovHead(target.vocab_size, cfg.vocab_size, cfg.markov_rank, pdtype, name="markov_head")
        confidence = ConfidenceHead(pdtype, name="confidence_head")
        return apply_heads(cfg, markov, confidence, hidden, logits, inputs.prev_tokens)


def mirrored_layers(config: HSpecConfig) -> dict[str, int]:
    """Each attention sub-layer reads (and copies q/k/v from) its mapped target layer."""
    attn = config.sublayers("attn")
    return {f"layers_{i}": layer for i, layer in zip(attn, config.attn_kv_layer_ids, strict=True)}


FAMILY = register_family(
    DrafterFamily(
        "hspec",
        HSpecConfig,
        HSpec,
        components={"seed_projs": "ssm seed projection"},
        nested={"mamba": MambaConfig},
        mirrored_layers=mirrored_layers,
    )
)
register_kind(DrafterKind("hspec", FAMILY, compared=True))
register_kind(DrafterKind("hspec_kv_only", FAMILY, lambda fields, target: {**fields, "use_state_injection": False}))
register_kind(DrafterKind("hspec_last_token", FAMILY, lambda fields, target: {**fields, "use_target_kv": False}))
