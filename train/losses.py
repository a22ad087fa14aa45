"""The drafter's training loss, as pure functions over one batch of blocks.

Every per-slot function takes `[..., Vd]` logits over the draft vocabulary (fp32) and returns a value `[...]`;
`slot_sums` adds them up over a chunk of blocks `[B, A, T]` and `loss_from_sums` turns the sums of all chunks into
one number the way the reference does: sum(value * mask * w_k) / (sum(mask) + 1e-5), with position weights
w_0 = 0, w_k = exp(-(k - 1) / gamma) and an *unweighted* mask count in the denominator.

The loss (H-Spec, DSpark, as the H-Spec reference code trains them):
    0.1 * CE(draft, argmax of the target inside the draft vocabulary)
  + 0.9 * TV = 1 - sum_v min(p_draft, p_target)       (target restricted to the draft vocabulary, renormalised)
  + 1.0 * BCE(confidence logit, sum_v min(p_draft, p_target))   (no gradient through the BCE target)
`p_draft` is the distribution after the Markov bias. DFlash's recipe uses CE alone (each kind's weights:
`DrafterKind.loss`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from hspec_jax.drafters.family import drafter_kind

DENOMINATOR_EPS = 1e-5


class LossWeights(NamedTuple):
    ce: float = 0.1
    tv: float = 0.9
    confidence: float = 1.0
    gamma: float = 4.0  # position decay


def position_weights(block_size: int, gamma: float) -> jax.Array:
    """`[T]`: w_0 = 0 (slot 0 is the anchor, it predicts nothing), w_k = exp(-(k - 1) / gamma) for k >= 1."""
    k = jnp.arange(block_size, dtype=jnp.float32)
    return jnp.where(k == 0, 0.0, jnp.exp(-(k - 1) / gamma))


def cross_entropy(draft_logits: jax.Array, target_logits: jax.Array) -> jax.Array:
    """`[..., Vd]` x2 -> `[...]`: -log p_draft(argmax target)."""
    label = jnp.argmax(target_logits, axis=-1)
    logp = jax.nn.log_softmax(draft_logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, label[..., None], axis=-1)[..., 0]


def overlap(draft_logits: jax.Array, target_logits: jax.Array) -> jax.Array:
    """`[..., Vd]` x2 -> `[...]`: sum_v min(p_draft, p_target), softmaxes in fp32. For greedy-free drafting this
    is the probability that the target accepts a token drawn from the draft (min(1, p/q) rule)."""
    p = jax.nn.softmax(draft_logits.astype(jnp.float32), axis=-1)
    q = jax.nn.softmax(target_logits.astype(jnp.float32), axis=-1)
    return jnp.sum(jnp.minimum(p, q), axis=-1)


def confidence_bce(confidence_logits: jax.Array, accept: jax.Array) -> jax.Array:
    """`[...]`: binary cross-entropy with logits against the (stop-gradient) acceptance probability."""
    accept = jax.lax.stop_gradient(accept)
    return (
        jnp.maximum(confidence_logits, 0) - confidence_logits * accept + jnp.log1p(jnp.exp(-jnp.abs(confidence_logits)))
    )


def slot_sums(
    draft_logits: jax.Array,
    target_logits: jax.Array,
    mask: jax.Array,
    gamma: float,
    confidence_logits: jax.Array | None = None,
) -> dict:
    """The additive statistics of one chunk of blocks, so chunks can be summed before dividing.

    draft_logits, target_logits `[B, A, T, Vd]` (fp32), mask `[B, A, T]` (supervised slots), confidence_logits
    `[B, A, T]` or None -> {"ce", "tv", "confidence": sum(value * mask * w_k) (scalars); "count": sum(mask);
    "agree", "overlap", "slot_count": per slot sums over the mask `[T]`}."""
    mask = mask.astype(jnp.float32)
    w = position_weights(draft_logits.shape[-2], gamma)
    weighted = lambda values: jnp.sum(values * mask * w)
    per_slot = lambda values: jnp.sum(values * mask, axis=tuple(range(mask.ndim - 1)))
    accept = overlap(draft_logits, target_logits)
    agree = (jnp.argmax(draft_logits, -1) == jnp.argmax(target_logits, -1)).astype(jnp.float32)
    out = {
        "ce": weighted(cross_entropy(draft_logits, target_logits)),
        "tv": weighted(1.0 - accept),
        "count": jnp.sum(mask),
        "agree": per_slot(agree),
        "overlap": per_slot(accept),
        "slot_count": per_slot(jnp.ones_like(mask)),
    }
    if confidence_logits is not None:
        out["confidence"] = weighted(confidence_bce(confidence_logits, accept))
    return out


def loss_from_sums(sums: dict, weights: LossWeights) -> tuple[jax.Array, dict]:
    """(loss, metrics) from `slot_sums` (summed over chunks). Metrics: each loss term; per slot k >= 1 the
    greedy agreement rate `acc` and mean acceptance probability `overlap` `[T - 1]`; `sim_accept_len` =
    1 + sum_k prod_{i<=k} acc_i, the acceptance length the per-slot rates predict (as SpecForge and
    speculators log it)."""
    denominator = sums["count"] + DENOMINATOR_EPS
    terms = {name: sums[name] / denominator for name in ("ce", "tv", "confidence") if name in sums}
    loss = weights.ce * terms["ce"] + weights.tv * terms["tv"]
    if "confidence" in terms:
        loss = loss + weights.confidence * terms["confidence"]
    slots = jnp.maximum(sums["slot_count"], 1.0)
    acc = (sums["agree"] / slots)[1:]
    metrics = dict(terms, loss=loss, acc=acc, overlap=(sums["overlap"] / slots)[1:], supervised_slots=sums["count"])
    metrics["sim_accept_len"] = 1.0 + jnp.sum(jnp.cumprod(acc))
    return loss, metrics


def drafter_loss(
    draft_logits: jax.Array,
    target_logits: jax.Array,
    mask: jax.Array,
    weights: LossWeights,
    confidence_logits: jax.Array | None = None,
) -> tuple[jax.Array, dict]:
    """The loss of one batch of blocks `[B, A, T, Vd]` in one piece: `loss_from_sums(slot_sums(...))`."""
    sums = slot_sums(draft_logits, target_logits, mask, weights.gamma, confidence_logits)
    return loss_from_sums(sums, weights)


def recipe_weights(kind: str, gamma: float = 4.0, **overrides: float | None) -> LossWeights:
    """The loss weights of a drafter kind's recipe (`DrafterKind.loss` over the default `LossWeights`), with
    explicit `ce` / `tv` / `confidence` overrides (None = keep the recipe's)."""
    base = LossWeights(gamma=gamma)._replace(**drafter_kind(kind).loss)
    unknown = sorted(set(overrides) - {"ce", "tv", "confidence"})
    if unknown:
        raise ValueError(f"unknown loss weight(s) {unknown}; known: ce, tv, confidence")
    return base._replace(**{name: value for name, value in overrides.items() if value is not None})
