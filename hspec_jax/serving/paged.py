"""The paged KV pool: fixed-size pages shared by every sequence, and a page table per sequence.

Layout: per layer, keys and values `[P, page, K, H]` (stacked `[L, P, page, K, H]` when the decoder scans its
layers, as in the dense cache) (P pages of `page` rows each); `page_table [B, M]` maps
sequence b's logical page j (its rows j*page .. (j+1)*page - 1) to a pool page. Page 0 is the null page: it is
never allocated and every unused table entry points at it, so rows a forward writes beyond a sequence's pages
(padding, a rejected draft past the end) land there and are never read as valid (readers mask rows at and past
`lengths`). Rows past the table (M*page) are dropped, as in the dense cache.

The pool has the accessors of `hspec_jax.models.kv_cache`: `layer(i)` is the dense `[B, M*page, K, H]` view
gathered through the page table (the reference path: every reader, the target's attention and the drafters'
target-KV attention, gets the layout it already expects), `write(i, k, v, starts)` scatters new rows into their
pages. So the decoder, the drafters and both decoding loops run on it unchanged.

`PagedBuffers` is a drafter's own cache (DFlash/DSpark): it shares the target's page table, so page j of a
sequence holds both models' rows j*page.. and one allocator serves both out of one memory budget.
"""

from __future__ import annotations

import math

import flax.struct
import jax
import jax.numpy as jnp

from hspec_jax.drafters.config import DrafterConfig
from hspec_jax.models.config import TargetConfig
from hspec_jax.models.kv_cache import Layers, put_layer, zeros_layers

NULL_PAGE = 0


@flax.struct.dataclass
class PagedBuffers:
    k: Layers  # per layer [P, page, K, H] (or stacked [L, P, page, K, H])
    v: Layers  # per layer [P, page, K, H]
    page_table: jax.Array  # [B, M] int32 pool page of each logical page; NULL_PAGE where none

    @property
    def page_size(self) -> int:
        return self.k[0].shape[1]

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0]

    @property
    def capacity(self) -> int:
        """Rows each sequence can address (M * page)."""
        return self.page_table.shape[1] * self.page_size

    def layer(self, i) -> tuple[jax.Array, jax.Array]:
        """(keys, values) of layer i as the dense view `[B, M*page, K, H]`, gathered through the page table."""
        b, m = self.page_table.shape

        def gather(pool):
            return pool[self.page_table].reshape(b, m * self.page_size, *pool.shape[2:])

        return gather(self.k[i]), gather(self.v[i])

    def in_place(self, i) -> tuple[jax.Array, jax.Array, None]:
        """What attention reads for layer i: the dense view of `layer(i)` (pages are gathered, never read in place)."""
        return *self.layer(i), None

    def write(self, i, k: jax.Array, v: jax.Array, starts: jax.Array):
        """Write layer i's new rows k, v `[B, T, K, H]` at rows `starts[b] + t` into their pages (i may be traced
        where the pools are stacked)."""
        rows = starts[:, None] + jnp.arange(k.shape[1])[None, :]  # [B, T]
        logical = rows // self.page_size
        m = self.page_table.shape[1]
        pages = jnp.take_along_axis(self.page_table, jnp.clip(logical, 0, m - 1), axis=1)
        pages = jnp.where(logical < m, pages, self.num_pages)  # past the table: out of bounds, dropped
        offsets = rows % self.page_size

        def put(pool, new, *layer):
            return pool.at[(*layer, pages, offsets)].set(new.astype(pool.dtype), mode="drop")

        if not isinstance(self.k, tuple):  # stacked pools: straight into layer i (traced under a scan)
            return self.replace(k=put(self.k, k, i), v=put(self.v, v, i))
        return self.replace(k=put_layer(self.k, i, put(self.k[i], k)), v=put_layer(self.v, i, put(self.v[i], v)))

    def slot(self, s: jax.Array):
        """Sequence `s` (a traced index) alone, batch 1, over the same pool."""
        return self.replace(page_table=jax.lax.dynamic_slice_in_dim(self.page_table, s, 1))

    def with_slot(self, s: jax.Array, view):
        """This pool after `view = self.slot(s)` was written to."""
        return self.replace(k=view.k, v=view.v)


@flax.struct.dataclass
class PagedKVCache(PagedBuffers):
    lengths: jax.Array  # [B] int32, committed rows per sequence

    def slot(self, s: jax.Array):
        """Sequence `s` (a traced index) alone, batch 1, over the same pool, with its committed length."""
        table = jax.lax.dynamic_slice_in_dim(self.page_table, s, 1)
        return self.replace(page_table=table, lengths=jax.lax.dynamic_slice_in_dim(self.lengths, s, 1))

    def with_slot(self, s: jax.Array, view):
        """This pool after `view = self.slot(s)` was written to and committed."""
        return self.replace(k=view.k, v=view.v, lengths=self.lengths.at[s].set(view.lengths[0]))


def _pools(num_layers: int, num_pages: int, page_size: int, kv_heads: int, head_dim: int, dtype, stacked=False):
    return zeros_layers(num_layers, (num_pages, page_size, kv_heads, head_dim), dtype, stacked)


def paged_cache(
    config: TargetConfig, slots: int, num_pages: int, page_size: int, max_pages: int, dtype=None
) -> PagedKVCache:
    """An empty target pool of `num_pages` pages (the null page included) for `slots` sequences of at most
    `max_pages` pages each, in `dtype` (default: the config's compute dtype)."""
    dtype = dtype or config.dtype
    geometry = (num_pages, page_size, config.num_kv_heads, config.head_dim, dtype)
    return PagedKVCache(
        k=_pools(config.num_layers, *geometry, config.scans_layers),
        v=_pools(config.num_layers, *geometry, config.scans_layers),
        page_table=jnp.full((slots, max_pages), NULL_PAGE, jnp.int32),
        lengths=jnp.zeros((slots,), jnp.int32),
    )


def paged_context(drafter: DrafterConfig | None, cache: PagedKVCache) -> PagedBuffers | tuple:
    """The drafter-side pool paired with `cache` (same pages, same page table): DFlash/DSpark's layers in the
    drafter's compute dtype; () for plain decoding and for drafters that keep no cache."""
    if drafter is None or not drafter.owns_kv_cache:
        return ()
    target = drafter.target
    geometry = (cache.num_pages, cache.page_size, target.num_kv_heads, target.head_dim, drafter.compute_dtype)
    pools = lambda: _pools(drafter.cache_layers, *geometry)
    return PagedBuffers(k=pools(), v=pools(), page_table=jnp.array(cache.page_table, copy=True))


def page_bytes(config: TargetConfig, drafter: DrafterConfig | None, page_size: int) -> tuple[int, int]:
    """(target bytes, drafter bytes) of one page: K and V of `page_size` rows in every layer of each model."""

    def pools():
        cache = paged_cache(config, 1, 1, page_size, 1)
        return cache, paged_context(drafter, cache)

    cache, context = jax.eval_shape(pools)

    def pool_bytes(pools) -> int:
        return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves((pools.k, pools.v)))

    drafter_bytes = pool_bytes(context) if isinstance(context, PagedBuffers) else 0
    return pool_bytes(cache), drafter_bytes
