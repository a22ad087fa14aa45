"""The training loss, term by term, against brute-force numpy versions written from the definitions."""

import numpy as np
import pytest

from train.losses import LossWeights, drafter_loss, loss_from_sums, position_weights, slot_sums

RNG = np.random.default_rng(0)
B, A, T, V = 2, 3, 5, 11


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def brute_force(draft, target, mask, confidence, weights):
    """Loop over every slot; float64."""
    draft, target, confidence = (np.asarray(x, np.float64) for x in (draft, target, confidence))
    sums = {"ce": 0.0, "tv": 0.0, "confidence": 0.0}
    count = 0.0
    agree = np.zeros(T)
    slots = np.zeros(T)
    for b in range(B):
        for a in range(A):
            for k in range(T):
                if not mask[b, a, k]:
                    continue
                w = 0.0 if k == 0 else np.exp(-(k - 1) / weights.gamma)
                p, q = softmax(draft[b, a, k]), softmax(target[b, a, k])
                label = int(np.argmax(target[b, a, k]))
                accept = float(np.minimum(p, q).sum())
                c = confidence[b, a, k]
                bce = -(accept * np.log(1 / (1 + np.exp(-c))) + (1 - accept) * np.log(1 - 1 / (1 + np.exp(-c))))
                sums["ce"] += w * -np.log(p[label])
                sums["tv"] += w * (1 - accept)
                sums["confidence"] += w * bce
                count += 1
                slots[k] += 1
                agree[k] += float(np.argmax(p) == label)
    terms = {name: value / (count + 1e-5) for name, value in sums.items()}
    loss = weights.ce * terms["ce"] + weights.tv * terms["tv"] + weights.confidence * terms["confidence"]
    acc = agree[1:] / np.maximum(slots[1:], 1)
    return loss, terms, acc


@pytest.mark.parametrize("gamma", [4.0, 1.5])
def test_loss_terms_match_brute_force(gamma):
    draft = RNG.normal(size=(B, A, T, V)).astype(np.float32) * 2
    target = RNG.normal(size=(B, A, T, V)).astype(np.float32) * 2
    target[0, 0, 1] = draft[0, 0, 1]  # a slot where draft == target: TV 0, acceptance 1
    confidence = RNG.normal(size=(B, A, T)).astype(np.float32)
    mask = RNG.random((B, A, T)) < 0.7
    mask[..., 0] = False
    weights = LossWeights(0.1, 0.9, 1.0, gamma)
    loss, metrics = drafter_loss(draft, target, mask, weights, confidence)
    want_loss, terms, acc = brute_force(draft, target, mask, confidence, weights)
    for name, value in terms.items():
        np.testing.assert_allclose(float(metrics[name]), value, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(metrics["acc"]), acc, atol=1e-6)
    np.testing.assert_allclose(float(metrics["sim_accept_len"]), 1 + np.cumprod(acc).sum(), rtol=1e-6)


def test_position_weights_and_unweighted_denominator():
    np.testing.assert_allclose(
        np.asarray(position_weights(8, 4.0)), [0, 1, 0.7788, 0.6065, 0.4724, 0.3679, 0.2865, 0.2231], atol=1e-4
    )
    # Slot 0 never contributes; the denominator counts masked slots without their weights.
    draft = np.zeros((1, 1, 3, 2), np.float32)
    target = np.array([[[[0, 0], [0, 0], [0, 0]]]], np.float32)
    draft[0, 0, 2] = [5, -5]  # slot 2 wrong-ish vs uniform target
    _, metrics = drafter_loss(draft, target, np.array([[[True, True, True]]]), LossWeights(gamma=1.0))
    tv_slot2 = 1 - np.minimum(softmax(np.array([5.0, -5.0])), 0.5).sum()
    np.testing.assert_allclose(float(metrics["tv"]), np.exp(-1) * tv_slot2 / (3 + 1e-5), rtol=1e-5)


def test_chunks_sum_to_the_whole():
    draft = RNG.normal(size=(B, 4, T, V)).astype(np.float32)
    target = RNG.normal(size=(B, 4, T, V)).astype(np.float32)
    confidence = RNG.normal(size=(B, 4, T)).astype(np.float32)
    mask = RNG.random((B, 4, T)) < 0.5
    weights = LossWeights()
    whole = drafter_loss(draft, target, mask, weights, confidence)[1]
    halves = [
        slot_sums(draft[:, s], target[:, s], mask[:, s], weights.gamma, confidence[:, s])
        for s in (slice(0, 2), slice(2, 4))
    ]
    summed = loss_from_sums({k: halves[0][k] + halves[1][k] for k in halves[0]}, weights)[1]
    for name in ("loss", "ce", "tv", "confidence", "sim_accept_len"):
        np.testing.assert_allclose(float(summed[name]), float(whole[name]), rtol=1e-5)
