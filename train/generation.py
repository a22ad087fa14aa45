"""Batched generation with the target for the data tools, with bucketed shapes so few programs are compiled."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from hspec_jax.decoding import SamplingConfig, generate, pad_batch
from hspec_jax.decoding.engine import stop_ids


@dataclasses.dataclass(frozen=True)
class BatchGenerator:
    """Generates continuations of up to `batch_size` prompts at a time. Batches are padded to `batch_size` rows;
    `generate` buckets the prompt width and cache capacity, so one program per bucket is compiled."""

    config: object  # TargetConfig
    params: dict
    tokenizer: object
    batch_size: int
    max_new_tokens: int
    sampling: SamplingConfig

    @property
    def pad_id(self) -> int:
        return self.config.pad_token_id if self.config.pad_token_id is not None else 0

    def __call__(self, prompts: list[list[int]], rng: jax.Array) -> list[tuple[list[int], bool]]:
        """For each prompt: (generated ids without the stop token, stopped by a stop token)."""
        if not 0 < len(prompts) <= self.batch_size:
            raise ValueError(f"{len(prompts)} prompts for a batch of {self.batch_size}")
        rows = prompts + [prompts[0]] * (self.batch_size - len(prompts))
        tokens, lengths = pad_batch(rows, self.pad_id)
        eos_ids = stop_ids(self.config, self.tokenizer)
        out = generate(
            self.params,
            self.config,
            tokens,
            lengths,
            max_new_tokens=self.max_new_tokens,
            rng=rng,
            sampling=self.sampling,
            eos_ids=eos_ids,
            pad_id=self.pad_id,
        )
        generated, counts = np.asarray(out.tokens), np.asarray(out.num_tokens)
        results = []
        for row, count in zip(generated[: len(prompts)], counts[: len(prompts)], strict=True):
            ids = row[:count].tolist()
            stopped = bool(ids) and ids[-1] in eos_ids
            results.append((ids[:-1] if stopped else ids, stopped))
        return results

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
