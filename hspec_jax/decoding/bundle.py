"""What a decoding engine runs: the target and, for draft-and-verify, the drafter and its draft vocabulary, in one
frozen pytree.

The params and the vocabulary's arrays are its leaves; the two configs (frozen, hashable dataclasses) are static
tree metadata. A jitted function takes the bundle as one argument and is traced again only when a config changes,
never for new params of the same shapes (training's real tau reuses one program for every drafter checkpoint).
"""

from __future__ import annotations

import flax.struct

from hspec_jax.drafters.config import DrafterConfig
from hspec_jax.drafters.dflash import drafter_context
from hspec_jax.drafters.vocab import DraftVocab
from hspec_jax.models.config import TargetConfig
from hspec_jax.models.kv_cache import KVBuffers, KVCache, init_cache


@flax.struct.dataclass
class Bundle:
    """The target alone (plain decoding: no drafter) or with a drafter (draft-and-verify)."""

    target_params: dict
    target: TargetConfig = flax.struct.field(pytree_node=False)
    drafter_params: dict | None = None
    drafter: DrafterConfig | None = flax.struct.field(pytree_node=False, default=None)
    vocab: DraftVocab | None = None

    @property
    def lookahead(self) -> int:
        """Rows a step writes past the committed ones (the verified block: k + 1; 0 for plain decoding)."""
        return 0 if self.drafter is None else self.drafter.block_size

    @property
    def rows_per_step(self) -> int:
        """The most rows one decoding step commits or writes ahead of the committed ones."""
        return max(self.lookahead, 1)


def init_caches(bundle: Bundle, batch: int, capacity: int) -> tuple[KVCache, KVBuffers | tuple]:
    """Empty caches of `capacity` rows for `batch` sequences: the target's `KVCache` and the drafter-side cache
    (DFlash/DSpark's `KVBuffers`; () for H-Spec and for plain decoding)."""
    cache = init_cache(bundle.target, batch, capacity)
    return cache, () if bundle.drafter is None else drafter_context(bundle.drafter, batch, capacity)
