"""Starting a training run from a trained drafter (`train.init_from`): the same drafter, or a smaller one cut from it.

Without `train.init_layers` the recipe's drafter must be the starting drafter's (dtypes aside): the run fine-tunes
its weights and keeps its draft vocabulary. With `train.init_layers` (for example `0,1,2,3,4,9,10`) the recipe's
drafter is a sub-drafter of it, for trading acceptance for drafter time without training from scratch:

- its i-th sub-layer (`block_pattern[i]`) starts from the listed sub-layer of the starting drafter, of the same
  kind; an attention sub-layer reads the same target layer's KV (`attn_kv_layer_ids`) with the same window;
- its draft vocabulary may be smaller: the run's most frequent supervised tokens among the starting drafter's (EOS
  kept), with the matching rows of the lm_head and columns of the Markov head;
- everything else (taps, latent fusion, seed projections, norms, heads) is copied as is. Seed projections follow
  their Mamba sub-layers where each has its own (`seed_mode="per_layer"`).

No other field may differ; an error names the fields that do.
"""

from __future__ import annotations

import jax
import numpy as np

from hspec_jax.checkpoints import CheckpointError
from hspec_jax.checkpoints.drafter_io import config_to_dict, read_drafter_meta, restore_drafter
from hspec_jax.drafters import init_drafter
from hspec_jax.drafters.config import DrafterConfig
from hspec_jax.drafters.vocab import DraftVocab, draft_vocab_from_counts, to_draft
from hspec_jax.errors import InputError

# What init_layers lets differ (each mapped attention sub-layer is checked to keep its target layer and layout).
CUT_FIELDS = ("block_pattern", "attn_kv_layer_ids", "attn_layer_types", "draft_vocab_size")


def parse_layers(text: str | None) -> tuple[int, ...] | None:
    """`train.init_layers` ("0,1,4", or unset / "" for none) -> sub-layer indices."""
    if not text:
        return None
    try:
        return tuple(int(part) for part in str(text).split(","))
    except ValueError:
        raise InputError(
            f"--config.train.init_layers={text!r}: give comma-separated sub-layer indices of the starting drafter"
        ) from None


def starting_drafter(
    spec: str, drafter: DrafterConfig, layers: tuple[int, ...] | None
) -> tuple[DrafterConfig, DraftVocab]:
    """(config, draft vocabulary) of the starting drafter `spec` (directory or shipped name), its weights not read,
    checked against the recipe's `drafter` and the sub-layer map `layers` (None: the same drafter)."""
    try:
        config, vocab, _ = read_drafter_meta(spec, drafter.target)
    except CheckpointError as e:
        raise InputError(f"--config.train.init_from={spec!r}: {e}") from None
    if type(config) is not type(drafter):
        raise InputError(
            f"--config.train.init_from={spec!r} is a drafter of kind {config.kind}; "
            f"the recipe's is of kind {drafter.kind}"
        )
    ours, theirs = config_to_dict(drafter)["fields"], config_to_dict(config)["fields"]
    free = ("dtype", "param_dtype", *(CUT_FIELDS if layers is not None else ()))
    differ = sorted(k for k in ours if k not in free and ours[k] != theirs[k])
    if differ:
        fields = ", ".join(f"{k}={theirs[k]!r} (recipe: {ours[k]!r})" for k in differ)
        hint = "" if layers is not None else " (--config.train.init_layers cuts a smaller drafter from it)"
        raise InputError(f"--config.train.init_from={spec!r} does not match the recipe's drafter: {fields}{hint}")
    if layers is not None:
        check_layer_map(config, drafter, layers)
    return config, vocab


def check_layer_map(source: DrafterConfig, drafter: DrafterConfig, layers: tuple[int, ...]) -> None:
    """That `layers` maps every sub-layer of `drafter` to a distinct sub-layer of `source` of the same kind, each
    attention sub-layer to one reading the same target layer with the same window, and that the draft vocabulary
    does not grow."""
    flag = f"--config.train.init_layers={','.join(map(str, layers))}"
    if not hasattr(drafter, "sublayers"):
        raise InputError(f"{flag}: the {drafter.kind} drafter has no sub-layers to choose (H-Spec kinds do)")
    if len(layers) != len(drafter.block_pattern):
        raise InputError(
            f"{flag} lists {len(layers)} sub-layers; the recipe's block_pattern has {len(drafter.block_pattern)}"
        )
    if len(set(layers)) != len(layers):
        raise InputError(f"{flag} names a sub-layer twice")
    attn_ours, attn_theirs = drafter.sublayers("attn"), source.sublayers("attn")
    for i, j in enumerate(layers):
        if not 0 <= j < len(source.block_pattern):
            raise InputError(f"{flag}: the starting drafter has sub-layers 0..{len(source.block_pattern) - 1}")
        kind = drafter.block_pattern[i]
        if source.block_pattern[j] != kind:
            raise InputError(f"{flag}: sub-layer {i} is {kind!r} in the recipe but {j} is {source.block_pattern[j]!r}")
        if kind == "attn":
            a, b = attn_ours.index(i), attn_theirs.index(j)
            ours = (drafter.attn_kv_layer_ids[a], drafter.attention_layout(a, default_causal=True))
            theirs = (source.attn_kv_layer_ids[b], source.attention_layout(b, default_causal=True))
            if ours != theirs:
                raise InputError(
                    f"{flag}: attention sub-layer {i} reads target layer {ours[0]} (window, causal {ours[1]}) but "
                    f"the starting drafter's sub-layer {j} reads layer {theirs[0]} ({theirs[1]})"
                )
    if drafter.vocab_size > source.vocab_size:
        raise InputError(
            f"{flag}: a draft vocabulary of {drafter.vocab_size} tokens cannot be cut from {source.vocab_size}"
        )


def cut_vocab(source: DraftVocab, size: int, counts, eos_ids) -> DraftVocab:
    """The `size` most frequent tokens (by `counts [V]`) of the draft vocabulary `source`, its EOS tokens kept."""
    if size == source.size:
        return source
    inside = np.asarray(source.t2d)
    masked = np.where(inside, np.asarray(counts, np.float64), -1.0)  # never above a token of `source`
    return draft_vocab_from_counts(masked, size, always=[e for e in eos_ids if inside[e]])


def cut_params(
    params: dict, source: DrafterConfig, drafter: DrafterConfig, source_vocab: DraftVocab, vocab: DraftVocab, layers
) -> dict:
    """The sub-drafter's params: sub-layer i <- the starting drafter's sub-layer `layers[i]`, the draft-vocabulary
    rows of the lm_head `[Vd, D]` and columns of `markov_w2 [r, Vd]`, the rest as is."""
    out = {k: v for k, v in params.items() if not k.startswith(("layers_", "seed_projs_"))}
    for i, j in enumerate(layers):
        out[f"layers_{i}"] = params[f"layers_{j}"]
    ours, theirs = drafter.sublayers("mamba"), source.sublayers("mamba")
    for m in range(drafter.num_seed_projections):
        # per_layer: the m-th Mamba sub-layer's seed comes from the projection of the Mamba sub-layer it was cut from
        source_m = theirs.index(layers[ours[m]]) if drafter.seed_mode == "per_layer" else m
        out[f"seed_projs_{m}"] = params[f"seed_projs_{source_m}"]
    if vocab.size != source_vocab.size:
        columns = np.asarray(to_draft(vocab.d2t, source_vocab))
        out["lm_head"] = params["lm_head"][columns]
        out["markov_head"] = {**params["markov_head"], "markov_w2": params["markov_head"]["markov_w2"][:, columns]}
    return out


def starting_params(
    spec: str, drafter: DrafterConfig, target_params: dict, vocab: DraftVocab, layers: tuple[int, ...] | None
) -> dict:
    """The weights of the starting drafter `spec` (cut to the recipe's drafter by `layers` and the run's draft
    `vocab`), in the recipe's parameter dtype; read once, by a fresh run."""
    starting_drafter(spec, drafter, layers)  # the config checks
    source, params, source_vocab = restore_drafter(spec, drafter.target, target_params)
    if layers is not None:
        params = cut_params(params, source, drafter, source_vocab, vocab, layers)
    expected = jax.eval_shape(init_drafter, drafter, jax.random.key(0))
    got = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, drafter.param_dtype), params)
    want = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, drafter.param_dtype), expected)
    if jax.tree.structure(got) != jax.tree.structure(want) or jax.tree.leaves(got) != jax.tree.leaves(want):
        raise InputError(f"--config.train.init_from={spec!r}: its weights do not fit the recipe's drafter")
    return jax.tree.map(lambda x: x.astype(drafter.param_dtype), params)
