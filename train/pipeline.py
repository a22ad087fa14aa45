"""The training input pipeline (Grain): conversations -> packed rows with document ids and anchors -> batches.

    conversations of each source: shuffle(seed), repeat (each epoch reshuffled)
      -> tokenize with the chat template and loss mask (hspec_jax.chat), truncate to `seq_len`, drop documents
         without supervised tokens
      -> mix the sources by weight -> [first `num_epochs` x (all documents) documents, or endless]
      -> first-fit pack into rows of `seq_len` (grain.experimental.FirstFitPackIterDataset, `packing_bins` bins)
      -> per row: document ids, positions, anchors -> global batch -> this process's rows

Each batch is a dict of numpy arrays (B = the per-process batch, L = `seq_len`, A = `max_anchors`):

    tokens        [B, L] int32   padding: the tokenizer's pad token (EOS if it has none)
    positions     [B, L] int32   0-based within each document, 0 on padding
    doc_ids       [B, L] int32   0, 1, ... per document within the row, -1 on padding
    loss_mask     [B, L] bool    supervised (assistant) tokens; False on padding
    anchors       [B, A] int32   sorted ascending; unused slots hold 0
    anchor_valid  [B, A] bool

Anchor candidates: positions j with loss_mask[j] and loss_mask[j + 1] in the same document, j - 1 in that
document too (H-Spec's seed is read at j - 1; so never packed index 0 nor a document's first token) and
j < L - block_size (the block fits in the
row). Up to `max_anchors` are drawn without replacement by a generator seeded with (seed, row index), then
sorted. A document's start is `anchor - positions[anchor]`. A document longer than `seq_len` keeps its first
`seq_len` tokens.

Epochs: `num_epochs=None` repeats forever (the step count decides); otherwise the mixture yields
`num_epochs` x (the number of documents over all sources) documents and then stops (the last partial batch is
dropped). With one source that is exactly `num_epochs` passes; with several, each source is sampled by its
weight and repeats as often as that needs.

Processes: every process builds the same global batch of `batch_size` rows and keeps rows
[process_index * B, (process_index + 1) * B) with B = batch_size / process_count, so the data does not depend
on the number of processes. The iterator's `get_state()` / `set_state()` (a small JSON-able dict) restore the
stream exactly; Orbax saves it with `grain.checkpoint.CheckpointSave(iterator)` /
`grain.checkpoint.CheckpointRestore(iterator)` (one JSON file per process).
"""

from __future__ import annotations

import dataclasses

import grain
import numpy as np

from hspec_jax.chat import tokenize_conversation
from train.data import Conversation, LoadedSource, Source, load_mixture

BATCH_KEYS = ("tokens", "positions", "doc_ids", "loss_mask", "anchors", "anchor_valid")


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    seq_len: int
    batch_size: int  # global rows per step
    max_anchors: int
    block_size: int
    seed: int = 0
    num_epochs: int | None = None
    process_index: int = 0
    process_count: int = 1
    packing_bins: int = 16  # rows first-fit packing fills at once (more: less padding)

    def __post_init__(self):
        if self.seq_len <= self.block_size + 1:
            raise ValueError(f"seq_len {self.seq_len} must exceed block_size + 1 = {self.block_size + 1}")
        if self.batch_size % self.process_count:
            raise ValueError(f"batch_size {self.batch_size} is not divisible by {self.process_count} processes")
        if not 0 <= self.process_index < self.process_count:
            raise ValueError(f"process_index {self.process_index} is not in 0..{self.process_count - 1}")
        if min(self.max_anchors, self.packing_bins, self.num_epochs or 1) < 1:
            raise ValueError("max_anchors, packing_bins and num_epochs must be at least 1")


def document(tokenizer, messages: list[dict], seq_len: int) -> dict | None:
    """{"tokens" [T] int32, "loss_mask" [T] bool}, T <= seq_len, or None without supervised tokens."""
    ids, mask = tokenize_conversation(tokenizer, messages)
    ids, mask = ids[:seq_len], mask[:seq_len]
    return {"tokens": ids, "loss_mask": mask} if mask.any() else None


def anchor_candidates(loss_mask: np.ndarray, doc_ids: np.ndarray, block_size: int) -> np.ndarray:
    """Positions `[N]` that may anchor a block in one packed row (rules in the module docstring)."""
    length = loss_mask.shape[0]
    j = np.arange(length - 1)
    seed_in_doc = np.zeros(length - 1, bool)  # row j - 1 (H-Spec's seed) belongs to the same document
    seed_in_doc[1:] = doc_ids[:-2] == doc_ids[1:-1]
    ok = loss_mask[:-1] & loss_mask[1:] & (doc_ids[:-1] == doc_ids[1:]) & seed_in_doc & (j < length - block_size)
    return j[ok]


def sample_anchors(candidates: np.ndarray, max_anchors: int, rng: np.random.Generator):
    """(anchors [A] int32 sorted, valid [A] bool): up to A candidates drawn without replacement."""
    count = min(max_anchors, len(candidates))
    anchors = np.zeros(max_anchors, np.int32)
    anchors[:count] = np.sort(rng.choice(candidates, count, replace=False))
    return anchors, np.arange(max_anchors) < count


def finish_row(index: int, packed: dict, config: PipelineConfig) -> dict:
    """A packed row from grain (`tokens`, `loss_mask` and their `_segment_ids` 1-based / `_positions`) -> the
    row's arrays of BATCH_KEYS, anchors drawn with a generator seeded by (seed, index)."""
    doc_ids = packed["tokens_segment_ids"].astype(np.int32) - 1
    loss_mask = packed["loss_mask"].astype(bool) & (doc_ids >= 0)
    rng = np.random.default_rng((config.seed, index))
    anchors, valid = sample_anchors(anchor_candidates(loss_mask, doc_ids, config.block_size), config.max_anchors, rng)
    return {
        "tokens": packed["tokens"].astype(np.int32),
        "positions": np.where(doc_ids >= 0, packed["tokens_positions"], 0).astype(np.int32),
        "doc_ids": doc_ids,
        "loss_mask": loss_mask,
        "anchors": anchors,
        "anchor_valid": valid,
    }


def pad_token_id(tokenizer) -> int:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError("the tokenizer has neither a pad nor an EOS token to pad packed rows with")
    return int(pad)


def as_sources(data) -> list[LoadedSource]:
    """A source spec string, a list of `LoadedSource`, or a list of `Conversation` (one source)."""
    if isinstance(data, str):
        return load_mixture(data)
    data = list(data)
    if data and all(isinstance(d, Conversation) for d in data):
        return [LoadedSource(Source("conversations", "memory"), data, 0)]
    if data and all(isinstance(d, LoadedSource) for d in data):
        return data
    raise ValueError("training data must be a source spec, LoadedSource list or Conversation list (non-empty)")


def make_train_dataset(data, tokenizer, config: PipelineConfig) -> grain.IterDataset:
    """The Grain dataset of this process's batches (dicts of BATCH_KEYS arrays)."""
    sources = as_sources(data)
    streams = []
    for k, loaded in enumerate(sources):
        messages = [c.messages for c in loaded.conversations]
        stream = grain.MapDataset.source(messages).shuffle(seed=(config.seed + 1000003 * k) % 2**32).repeat()
        streams.append(stream.map(lambda m: document(tokenizer, m, config.seq_len)))
    mixed = streams[0] if len(streams) == 1 else grain.MapDataset.mix(streams, [s.source.weight for s in sources])
    if config.num_epochs is not None:
        mixed = mixed[: config.num_epochs * sum(len(s.conversations) for s in sources)]
    pad = pad_token_id(tokenizer)
    packed = grain.experimental.FirstFitPackIterDataset(
        mixed.to_iter_dataset(),
        length_struct={"tokens": config.seq_len, "loss_mask": config.seq_len},
        num_packing_bins=config.packing_bins,
        seed=config.seed,
        padding_struct={"tokens": pad, "loss_mask": False},
    )
    rows = packed.map_with_index(lambda index, row: finish_row(index, row, config))
    local = config.batch_size // config.process_count
    start = config.process_index * local
    return rows.batch(config.batch_size, drop_remainder=True).map(
        lambda batch: {key: batch[key][start : start + local] for key in BATCH_KEYS}
    )


def make_train_iterator(
    data,
    tokenizer,
    *,
    seq_len: int,
    batch_size: int,
    max_anchors: int,
    block_size: int,
    seed: int = 0,
    num_epochs: int | None = None,
    process_index: int | None = None,
    process_count: int | None = None,
    packing_bins: int = 16,
) -> grain.DatasetIterator:
    """An iterator over this process's batches (see the module docstring); `data` is a source spec (loaded by
    `train.data.load_mixture`, which excludes the evaluation prompts), a list of `LoadedSource` or of
    `Conversation`.
    Process index and count default to JAX's."""
    if process_index is None or process_count is None:
        import jax

        process_index, process_count = jax.process_index(), jax.process_count()
    config = PipelineConfig(
        seq_len, batch_size, max_anchors, block_size, seed, num_epochs, process_index, process_count, packing_bins
    )
    return iter(make_train_dataset(data, tokenizer, config))


def count_supervised(counts: np.ndarray, tokenizer, messages: list[dict], seq_len: int | None = None) -> int:
    """Add the supervised tokens of one conversation (truncated to `seq_len` if given) to `counts` `[V]`;
    returns how many were added."""
    ids, mask = tokenize_conversation(tokenizer, messages)
    supervised = ids[:seq_len][mask[:seq_len]]
    np.add.at(counts, supervised, 1)
    return int(supervised.size)


def supervised_token_counts(data, tokenizer, vocab_size: int, seq_len: int | None = None) -> np.ndarray:
    """Counts `[vocab_size]` int64 of the supervised tokens over every conversation of `data` (as for
    `make_train_iterator`; documents truncated to `seq_len` if given). Feed to
    `hspec_jax.drafters.draft_vocab_from_counts`."""
    counts = np.zeros(vocab_size, np.int64)
    for loaded in as_sources(data):
        for conversation in loaded.conversations:
            count_supervised(counts, tokenizer, conversation.messages, seq_len)
    return counts


def sampled_token_counts(
    data, tokenizer, vocab_size: int, budget: int, seed: int = 0, seq_len: int | None = None
) -> tuple[np.ndarray, int]:
    """(counts `[vocab_size]` int64, conversations read): the supervised tokens of a random sample of `data`'s
    conversations, drawn as the training mixture draws them (a source by its weight, then its next conversation
    in a shuffled order, none twice) until `budget` tokens are counted or every conversation is read. What the
    draft vocabulary needs (its top tokens by frequency) in a fraction of the time of counting everything;
    `budget=0` counts everything."""
    sources = as_sources(data)
    rng = np.random.default_rng(seed)
    orders = [list(rng.permutation(len(s.conversations))) for s in sources]
    weights = np.array([s.source.weight for s in sources], float)
    counts = np.zeros(vocab_size, np.int64)
    counted = read = 0
    while (budget <= 0 or counted < budget) and any(orders):
        live = np.array([bool(order) for order in orders])
        k = rng.choice(len(sources), p=weights * live / (weights * live).sum())
        counted += count_supervised(counts, tokenizer, sources[k].conversations[orders[k].pop()].messages, seq_len)
        read += 1
    return counts, read
