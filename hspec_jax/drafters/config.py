"""Drafter configurations: one frozen (hashable, jit-static) dataclass per architecture family.

* `HSpecConfig`: the Mamba-attention hybrid. Its ablations are switches on the same config:
  `use_state_injection=False` is "KV only" (zero SSM state), `use_target_kv=False` is "last-token only".
* `DFlashConfig`: DFlash (target hidden states of every context position injected as a drafter-side KV
  cache). `markov_rank > 0` with `sample_from_anchor=True` makes it DSpark (without: `dflash_markov`);
  `kv_source="target"` is "DFlash + direct target-KV reuse".

`drafter_config(kind, target, **fields)` builds any registered kind by name (`family.DRAFTER_KINDS`; each family
module registers its kinds and their field overrides).
Layer-id conventions: `fusion_layer_ids` are target tap ids (tap i = the residual stream entering target
layer i, HF `hidden_states[i]`); `attn_kv_layer_ids` are target decoder-layer indices whose KV cache is read.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hspec_jax.drafters.family import DRAFTER_FAMILIES, drafter_kind
from hspec_jax.drafters.mamba2 import MambaConfig
from hspec_jax.models.config import TargetConfig

PAPER_BLOCK_PATTERN = ("mamba", "mlp", "mamba", "attn", "mlp", "mamba", "attn", "mlp", "mamba", "attn", "mlp")
SUBLAYER_KINDS = ("mamba", "attn", "mlp")
SEED_MODES = ("per_layer", "shared", "once")
KV_SOURCES = ("inject", "target")
WINDOW_MODES = ("block", "query")
ATTN_LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """Fields every drafter has; each family's config subclasses it and names its `kind`.
    Block = [anchor, MASK x (block_size - 1)]; slot i predicts the token i positions after the anchor (i + 1 with
    `sample_from_anchor`, where slot 0 drafts too).
    `draft_vocab_size=None` drafts over the full target vocabulary.

    Attention layout: `attn_layer_types` gives each attention layer (H-Spec: attention sub-layer; DFlash: layer)
    "sliding_attention" (window `sliding_window`, causal inside the block) or "full_attention" (no window,
    bidirectional inside the block); empty = every layer windowed, with the family's own block causality.
    `window_mode`: "block" = every slot sees the context rows [a - W, a) (the reference's training mask),
    "query" = slot t sees rows >= a + t - W + 1 (a window relative to each query, as vLLM serves it).
    `mask_embedding`: the drafter carries its own embedding row for `mask_token_id` (param `mask_embedding`
    `[D]`, frozen) instead of the target's (imported checkpoints whose mask row was re-initialised)."""

    target: TargetConfig
    fusion_layer_ids: tuple[int, ...]
    block_size: int = 8
    draft_vocab_size: int | None = None
    mask_token_id: int = 0
    fusion_rank: int | None = None  # width of the fused latent; None = target hidden size
    intermediate_size: int | None = None  # MLP width; None = the target's
    sliding_window: int | None = 2048
    attn_layer_types: tuple[str, ...] = ()
    window_mode: str = "block"
    sample_from_anchor: bool = False
    mask_embedding: bool = False
    markov_rank: int = 0
    confidence_head: bool = False
    attention_impl: str = "auto"
    dtype: Any = None  # None = the target's compute dtype
    param_dtype: Any = None

    def _check_target_layers(self, layers: tuple[int, ...]) -> None:
        for layer in layers:
            if not 0 <= layer < self.target.num_layers:
                raise ValueError(f"attention KV layer id {layer} out of range 0..{self.target.num_layers - 1}")

    def _check_common(self):
        if self.block_size < 1 or self.num_drafts < 1:
            raise ValueError(f"block_size {self.block_size} drafts no token (the anchor needs at least one draft)")
        for tap in self.fusion_layer_ids:
            if not 0 <= tap <= self.target.num_layers:
                raise ValueError(f"fusion layer id {tap} out of range 0..{self.target.num_layers}")
        if not 0 <= self.mask_token_id < self.target.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} outside the target vocabulary")
        if self.draft_vocab_size is not None and not 0 < self.draft_vocab_size <= self.target.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} must be in 1..{self.target.vocab_size}")
        if self.confidence_head and not self.markov_rank:
            raise ValueError("the confidence head reads the Markov embedding: it needs markov_rank > 0")
        if self.window_mode not in WINDOW_MODES:
            raise ValueError(f"unknown window_mode {self.window_mode!r}; choose from {WINDOW_MODES}")
        for kind in self.attn_layer_types:
            if kind not in ATTN_LAYER_TYPES:
                raise ValueError(f"unknown attention layer type {kind!r}; choose from {ATTN_LAYER_TYPES}")
        if "sliding_attention" in self.attn_layer_types and not self.sliding_window:
            raise ValueError("sliding_attention layers need a sliding_window")
        if self.sliding_window is not None and self.window_mode == "query" and self.sliding_window < self.block_size:
            raise ValueError(f"a per-query window needs sliding_window >= block_size ({self.block_size})")

    def _check_layer_types(self, num_layers: int) -> None:
        if self.attn_layer_types and len(self.attn_layer_types) != num_layers:
            raise ValueError(f"attn_layer_types has {len(self.attn_layer_types)} entries for {num_layers} layers")

    def attention_layout(self, index: int, default_causal: bool) -> tuple[int | None, bool]:
        """(window, causal inside the block) of attention layer `index`."""
        if not self.attn_layer_types:
            return self.sliding_window, default_causal
        if self.attn_layer_types[index] == "full_attention":
            return None, False
        return self.sliding_window, True

    @property
    def cache_layers(self) -> int:
        """Layers of the KV cache the drafter keeps of its own (`dflash.empty_context`); 0 = none."""
        return 0

    @property
    def owns_kv_cache(self) -> bool:
        """Whether the drafter keeps a KV cache of its own, into which context rows are injected."""
        return self.cache_layers > 0

    @property
    def num_drafts(self) -> int:
        """k, the number of drafted tokens per step."""
        return self.block_size - 1 + self.sample_from_anchor

    @property
    def first_draft_slot(self) -> int:
        """The block slot holding the first draft (1, or 0 with `sample_from_anchor`)."""
        return 0 if self.sample_from_anchor else 1

    def with_drafts(self, k: int):
        """This config drafting k tokens per step."""
        return self.replace(block_size=k + 1 - self.sample_from_anchor)

    @property
    def vocab_size(self) -> int:
        return self.draft_vocab_size or self.target.vocab_size

    @property
    def latent_size(self) -> int:
        return self.fusion_rank or self.target.hidden_size

    @property
    def mlp_size(self) -> int:
        return self.intermediate_size or self.target.intermediate_size

    @property
    def compute_dtype(self):
        return self.dtype or self.target.dtype

    @property
    def storage_dtype(self):
        return self.param_dtype or self.target.param_dtype

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class HSpecConfig(DrafterConfig):
    attn_kv_layer_ids: tuple[int, ...] = ()
    mamba: MambaConfig | None = None
    block_pattern: tuple[str, ...] = PAPER_BLOCK_PATTERN
    seed_mode: str = "shared"
    markov_rank: int = 256
    confidence_head: bool = True
    use_state_injection: bool = True
    use_target_kv: bool = True
    qk_norm: bool | None = None  # per-head q/k norms on the block's queries and keys; None = the target's

    def __post_init__(self):
        self._check_common()
        self._check_layer_types(self.block_pattern.count("attn"))
        for kind in self.block_pattern:
            if kind not in SUBLAYER_KINDS:
                raise ValueError(f"unknown sub-layer {kind!r} in block_pattern; choose from {SUBLAYER_KINDS}")
        if self.block_pattern.count("attn") != len(self.attn_kv_layer_ids):
            raise ValueError(
                f"block_pattern has {self.block_pattern.count('attn')} attention sub-layers but "
                f"attn_kv_layer_ids maps {len(self.attn_kv_layer_ids)}"
            )
        self._check_target_layers(self.attn_kv_layer_ids)
        if "mamba" in self.block_pattern and self.mamba is None:
            raise ValueError("block_pattern has mamba sub-layers: set `mamba`")
        if self.seed_mode not in SEED_MODES:
            raise ValueError(f"unknown seed_mode {self.seed_mode!r}; choose from {SEED_MODES}")

    @property
    def attention_qk_norm(self) -> bool:
        """Whether the block's queries and keys get q/k norms (never applied to the target's cached keys)."""
        return self.target.qk_norm if self.qk_norm is None else self.qk_norm

    @property
    def kind(self) -> str:
        if not self.use_state_injection:
            return "hspec_kv_only"
        if not self.use_target_kv:
            return "hspec_last_token"
        return "hspec"

    @property
    def num_mamba(self) -> int:
        return self.block_pattern.count("mamba")

    def sublayers(self, kind: str) -> list[int]:
        """The indices in `block_pattern` of the sub-layers of `kind` ("mamba", "attn" or "mlp"), in order."""
        return [i for i, k in enumerate(self.block_pattern) if k == kind]

    @property
    def num_seed_projections(self) -> int:
        if not self.use_state_injection or not self.num_mamba:
            return 0
        return self.num_mamba if self.seed_mode == "per_layer" else 1

    def seed_index(self, mamba_index: int) -> int | None:
        """Which seed projection initialises the state of the mamba_index-th Mamba sub-layer (None = zeros)."""
        if not self.use_state_injection:
            return None
        if self.seed_mode == "per_layer":
            return mamba_index
        if self.seed_mode == "shared":
            return 0
        return 0 if mamba_index == 0 else None


@dataclasses.dataclass(frozen=True)
class DFlashConfig(DrafterConfig):
    num_layers: int = 5
    kv_source: str = "inject"
    target_kv_layer_ids: tuple[int, ...] = ()  # with kv_source="target": one target layer per drafter layer
    qk_norm: bool | None = None  # None: Qwen3-style q/k norms when injecting, the target's own when reusing
    block_causal: bool = False  # DFlash attends bidirectionally inside the block

    def __post_init__(self):
        self._check_common()
        self._check_layer_types(self.num_layers)
        if self.kv_source not in KV_SOURCES:
            raise ValueError(f"unknown kv_source {self.kv_source!r}; choose from {KV_SOURCES}")
        if self.kv_source == "target":
            if len(self.target_kv_layer_ids) != self.num_layers:
                raise ValueError(
                    f"kv_source='target' maps {len(self.target_kv_layer_ids)} target layers onto "
                    f"{self.num_layers} drafter layers"
                )
            self._check_target_layers(self.target_kv_layer_ids)
            if self.qk_norm not in (None, self.target.qk_norm):
                raise ValueError("reading the target's KV cache requires the target's own q/k norm setting")

    @property
    def cache_layers(self) -> int:
        """DFlash/DSpark inject into a cache of their own, one layer per drafter layer."""
        return self.num_layers if self.kv_source == "inject" else 0

    @property
    def kind(self) -> str:
        if self.kv_source == "target":
            return "dflash_target_kv"
        if self.markov_rank:
            return "dspark" if self.sample_from_anchor else "dflash_markov"
        return "dflash"

    @property
    def attention_qk_norm(self) -> bool:
        if self.kv_source == "target":
            return self.target.qk_norm
        return True if self.qk_norm is None else self.qk_norm


# The target fields a drafter depends on: its embedding/vocabulary, hidden size, tapped layers, KV geometry, RoPE.
TARGET_ARCH_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "qk_norm",
    "rope_theta",
    "rope_scaling",
)


def check_target(drafter: DrafterConfig, target: TargetConfig) -> None:
    """Raise a clear error if `drafter` was built for a target with a different architecture."""
    wrong = [
        f"{f}: drafter expects {getattr(drafter.target, f)}, target has {getattr(target, f)}"
        for f in TARGET_ARCH_FIELDS
        if getattr(drafter.target, f) != getattr(target, f)
    ]
    if wrong:
        raise ValueError("drafter and target do not match (" + "; ".join(wrong) + ")")


def drafter_config(kind: str, target: TargetConfig, **fields) -> DrafterConfig:
    """A drafter config by kind name. `fields` are the recipe (layer ids, Mamba shape as a config or a dict,
    ranks ...); fields of another drafter family are ignored, so one recipe dict can build every kind, but a field
    no family has is an error naming it (a typo in a recipe or a command-line override must not pass silently).
    A recipe's `block_size` is 1 + k for every kind: "dspark" (sample_from_anchor) gets a block of k slots."""
    spec = drafter_kind(kind)
    known = {f.name for family in DRAFTER_FAMILIES.values() for f in dataclasses.fields(family.config)} - {"target"}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"unknown drafter config field(s) {', '.join(map(repr, unknown))}; known: {sorted(known)}")
    names = {f.name for f in dataclasses.fields(spec.family.config)}
    fields = {k: v for k, v in fields.items() if k in names}
    for key, nested in spec.family.nested.items():
        if isinstance(fields.get(key), dict):
            fields[key] = nested(**fields[key])
    return spec.family.config(target=target, **spec.fields(fields, target))
