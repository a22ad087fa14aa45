"""The jitted training step: frozen target forward, many-block drafter forward, loss, optimiser update.

One step on a packed batch (see `train/data.py` for the batch layout):

1. the frozen target runs once over the packed rows `[B, L]` (per-document positions, no attention across
   documents) under `stop_gradient`; it yields the fused taps (H-Spec's seed, DFlash's injected context),
   its KV cache (read in place by the drafters' attention) and its last hidden state;
2. the anchors `[B, A]` are processed in chunks (`lax.map` with rematerialisation, so memory is bounded by
   one chunk): per chunk, `draft_blocks` drafts all its blocks `[B, A/n, T]`, the target's logits are
   computed at the block positions only, restricted to the draft vocabulary, and `slot_sums` adds up
   the loss statistics;
3. the loss (`train/losses.py`) is differentiated with respect to the drafter's parameters (frozen ones
   are held by `stop_gradient`) and the optimiser (`train/optim.py`) updates the trainable ones.

The target parameters are an argument of the step, never part of the train state or the checkpoint.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import optax

from hspec_jax import parallel
from hspec_jax.drafters.api import draft_blocks, training_inputs
from hspec_jax.drafters.config import DrafterConfig
from hspec_jax.drafters.output import DraftOutput, drafted_slots
from hspec_jax.drafters.params import trainable_mask
from hspec_jax.drafters.vocab import DraftVocab
from hspec_jax.models.config import TargetConfig
from hspec_jax.models.decoder import embedding_matrix, forward, output_logits
from hspec_jax.models.kv_cache import KVCache, init_cache
from train.losses import LossWeights, loss_from_sums, slot_sums


class TrainState(flax.struct.PyTreeNode):
    """Everything a checkpoint restores (besides the data iterator): the drafter only, never the target."""

    step: jax.Array
    params: dict
    opt_state: Any
    rng: jax.Array  # raw key data, advanced every step: the stream for any stochastic part of a step


def fresh_state(params: dict, optimizer: optax.GradientTransformation, seed: int, mesh=None) -> TrainState:
    """Step 0 of training `params` (placed as they will train) with `optimizer`. With a `mesh`, the leaves not
    already on it (the step, the optimiser's counts, the rng) are replicated on it, where the train step returns
    them: left on one device, they would make the second step compile the program again."""
    state = TrainState(jnp.int32(0), params, jax.jit(optimizer.init)(params), jax.random.key_data(jax.random.key(seed)))
    if mesh is None:
        return state
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def on_mesh(x):
        placed = isinstance(x.sharding, jax.sharding.NamedSharding) and x.sharding.mesh == mesh
        return x if placed else jax.device_put(x, replicated)

    return jax.tree.map(on_mesh, state)


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """The static settings of a step (hashable; part of the compiled program)."""

    target: TargetConfig
    drafter: DrafterConfig
    weights: LossWeights
    anchors_per_chunk: int = 64


class TargetFeatures(NamedTuple):
    fused: jax.Array  # [B, L, F*D] the drafter's taps, concatenated
    last: jax.Array  # [B, L, D] the last layer's output before the final norm (tap L)
    cache: KVCache  # every layer's K/V of the packed rows (rows 0 .. L-1)


def target_features(target_params: dict, config: StepConfig, tokens: jax.Array, positions: jax.Array):
    """The frozen target over packed rows: tokens, positions `[B, L]` -> `TargetFeatures` (no gradient)."""
    target = config.target
    taps = (*config.drafter.fusion_layer_ids, target.num_layers)
    batch, length = tokens.shape
    no_logits = jnp.zeros((batch, 0), jnp.int32)  # logits are computed later, at block positions only
    out = forward(target_params, target, tokens, init_cache(target, batch, length), taps, no_logits, positions)
    out = jax.lax.stop_gradient(out)
    return TargetFeatures(jnp.concatenate(out.hidden[:-1], axis=-1), out.hidden[-1], out.cache)


def block_mask(batch: dict, anchors: jax.Array, valid: jax.Array, block_size: int) -> jax.Array:
    """`[B, A, T]`: slot k >= 1 of the block at anchor a is supervised iff the anchor is valid and token a + k
    is inside the row, in the anchor's document and supervised (an assistant token)."""
    length = batch["tokens"].shape[1]
    rows = jnp.arange(anchors.shape[0])[:, None, None]
    idx = anchors[..., None] + jnp.arange(block_size)
    inside = idx < length
    idx = jnp.minimum(idx, length - 1)
    same_doc = batch["doc_ids"][rows, idx] == batch["doc_ids"][rows, anchors[..., None]]
    supervised = batch["loss_mask"][rows, idx].astype(bool)
    return valid[..., None] & inside & same_doc & supervised & (jnp.arange(block_size) > 0)


def block_target_logits(target_params, target: TargetConfig, last, anchors, block_size: int, vocab: DraftVocab):
    """The target's logits `[B, A, T, Vd]` over the draft vocabulary for the token at slot k of each block:
    token a + k is predicted by the target's output at row a + k - 1 (slot 0's row a - 1 is never supervised).
    last `[B, L, D]` (tap L), anchors `[B, A]`."""
    rows = jnp.arange(last.shape[0])[:, None, None]
    source_rows = jnp.clip(anchors[..., None] + jnp.arange(block_size) - 1, 0, last.shape[1] - 1)
    return output_logits(target_params, target, last[rows, source_rows], vocab.d2t)


def loss_layout(out: DraftOutput, drafter) -> DraftOutput:
    """A drafter's output `[B, A, T, ...]` in the layout the loss reads, `[B, A, k + 1, ...]` with slot j for the
    token j after the anchor: the drafting slots (`drafted_slots`, as the engine reads them) behind a zero slot 0
    (never supervised)."""
    out = drafted_slots(out, drafter)
    pad = lambda x: None if x is None else jnp.concatenate([jnp.zeros_like(x[:, :, :1]), x], axis=2)
    return out._replace(hidden=pad(out.hidden), logits=pad(out.logits), confidence=pad(out.confidence))


def chunk_sums(params, target_params, vocab: DraftVocab, config: StepConfig, batch, features, anchors, valid):
    """Loss statistics (`slot_sums`) of the blocks at `anchors [B, A']` (one chunk)."""
    drafter = config.drafter
    t = drafter.num_drafts + 1  # the anchor and the k tokens drafted after it
    tokens, positions = batch["tokens"], batch["positions"]
    embedding = embedding_matrix(target_params)
    inputs = training_inputs(drafter, embedding, tokens, positions, anchors, features.fused, features.cache)
    out = loss_layout(draft_blocks(params, drafter, inputs), drafter)
    target_logits = block_target_logits(target_params, config.target, features.last, anchors, t, vocab)
    mask = block_mask(batch, anchors, valid, t)
    return slot_sums(out.logits, target_logits, mask, config.weights.gamma, out.confidence)


def chunked(anchors: jax.Array, valid: jax.Array, per_chunk: int):
    """anchors, valid `[B, A]` -> `[n, B, per_chunk]` each (A padded with invalid anchors at row 0)."""
    a = anchors.shape[1]
    per_chunk = min(per_chunk, a)
    pad = -a % per_chunk
    anchors = jnp.pad(anchors, ((0, 0), (0, pad)))
    valid = jnp.pad(valid, ((0, 0), (0, pad)))
    split = lambda x: jnp.moveaxis(x.reshape(x.shape[0], -1, per_chunk), 1, 0)
    return split(anchors), split(valid)


def batch_sums(params, target_params, vocab, config: StepConfig, batch, features) -> dict:
    """The loss statistics (`slot_sums`) of every block of a batch, chunk by chunk (rematerialised), added up."""
    body = jax.checkpoint(lambda xs: chunk_sums(params, target_params, vocab, config, batch, features, *xs))
    sums = jax.lax.map(body, chunked(batch["anchors"], batch["anchor_valid"], config.anchors_per_chunk))
    return jax.tree.map(lambda x: x.sum(0), sums)


def loss_fn(params, target_params, vocab, config: StepConfig, batch, features, trainable):
    """(loss, metrics) of a batch, pooled over all its rows; parameters outside `trainable` get no gradient."""
    params = jax.tree.map(lambda p, train: p if train else jax.lax.stop_gradient(p), params, trainable)
    return loss_from_sums(batch_sums(params, target_params, vocab, config, batch, features), config.weights)


def _batch_place(mesh, x):
    """Where a per-row array lives: rows over data x fsdp (and KV heads over model for `[B, S, K, H]` buffers)."""
    return parallel.kv_sharding(mesh, x.shape) if x.ndim == 4 else parallel.batch_sharding(mesh, x.shape)


def make_train_step(
    config: StepConfig, optimizer: optax.GradientTransformation, schedule=None, mesh=None, state_shardings=None
):
    """A jitted `(state, target_params, vocab, batch) -> (state, metrics)`; the state is donated. With a `mesh`,
    the target's features are constrained to the batch sharding (rows over data x fsdp). `state_shardings` (a
    TrainState of shardings: where the state comes in) pins where the new state goes out. Left to the compiler,
    the parameters and optimiser moments could come back in another layout than the one they were given, and
    the second step would compile the program again for it (it did on a data=2,fsdp=2,model=2 mesh)."""

    def step(state: TrainState, target_params, vocab, batch):
        features = target_features(target_params, config, batch["tokens"], batch["positions"])
        if mesh is not None:
            features = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, _batch_place(mesh, x)), features)
        mask = trainable_mask(state.params, config.drafter)
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (_, metrics), grads = grad_fn(state.params, target_params, vocab, config, batch, features, mask)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics["grad_norm"] = optax.tree.norm(grads)
        if schedule is not None:
            metrics["learning_rate"] = schedule(state.step)
        rng = jax.random.key_data(jax.random.split(jax.random.wrap_key_data(state.rng))[0])
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state, rng=rng)
        if state_shardings is not None:
            new_state = jax.lax.with_sharding_constraint(new_state, state_shardings)
        return new_state, metrics

    return jax.jit(step, donate_argnums=(0,))


def evaluate_sums(params, target_params, vocab, config: StepConfig, batch) -> dict:
    """The loss statistics (`slot_sums`) of a batch on the training path, without an update: add them over many
    batches, then `loss_from_sums` gives the pooled metrics (what `eval_loss_fn` gives for one batch)."""
    features = target_features(target_params, config, batch["tokens"], batch["positions"])
    return batch_sums(params, target_params, vocab, config, batch, features)


def eval_sums_fn(config: StepConfig):
    """A jitted `(params, target_params, vocab, batch) -> evaluate_sums(...)`."""
    return jax.jit(
        lambda params, target_params, vocab, batch: evaluate_sums(params, target_params, vocab, config, batch)
    )


def eval_loss_fn(config: StepConfig):
    """A jitted `(params, target_params, vocab, batch) -> metrics` without an update (held-out loss)."""

    def evaluate(params, target_params, vocab, batch):
        return loss_from_sums(evaluate_sums(params, target_params, vocab, config, batch), config.weights)[1]

    return jax.jit(evaluate)
