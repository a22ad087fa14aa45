"""The target's KV cache: per layer, post-RoPE keys and values `[B, S, K, H]`, plus committed lengths `[B]`.

Layout and contract. Readers and writers go through two accessors, so another cache layout (the paged pool of
`hspec_jax.serving`) is transparent to them: `cache.layer(i)` gives layer i's keys and values as the dense
`[B, S, K, H]` view, `cache.in_place(i)` what the target's attention reads (a stacked cache's arrays and i, read
block by block where they lie), and `cache.write(i, k, v, starts)` writes new rows. `KVBuffers` is the same without
lengths: a drafter's own cache (DFlash/DSpark), whose rows are committed in step with the target's.

* `cache.k[i]`, `cache.v[i]` are decoder layer i's keys and values, `[B, S_max, K, H]`: `cache.k` is a tuple of
  per-layer arrays, or one array `[L, B, S_max, K, H]` stacked on a leading layer axis when the decoder scans
  its layers (`TargetConfig.scans_layers`; `init_cache` follows the config). Keys are stored *after* the k-norm
  (Qwen3) and after RoPE at their absolute positions, so a reader never re-rotates.
* `cache.lengths[b]` is how many rows of sequence b are committed: rows `0 .. lengths[b]-1` are valid.
  Rows at and beyond `lengths[b]` may hold stale data (a rejected draft, a padded prompt) and are
  overwritten by the next forward pass; every reader masks them out by position.
* A forward pass writes its T new rows at `lengths[b] .. lengths[b]+T-1` and does not change
  `lengths`; `commit(cache, n)` then advances each sequence by the number of rows it keeps. Rows past
  `S_max` are dropped, never wrapped: callers check capacity (see `check_capacity`).
* Under `jax.jit` with the cache donated, writes are in-place updates; no step copies the cache.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from hspec_jax.models.config import TargetConfig

Layers = tuple[jax.Array, ...] | jax.Array  # one array per layer, or one stacked on a leading layer axis


def zeros_layers(num_layers: int, shape: tuple, dtype, stacked: bool) -> Layers:
    """Zeros of `shape` for each of `num_layers` layers: one `[L, *shape]` array if `stacked`, else a tuple."""
    if stacked:
        return jnp.zeros((num_layers, *shape), dtype)
    return tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))


def put_layer(layers: Layers, i, value: jax.Array) -> Layers:
    """`layers` with layer i (static, or traced for the stacked form) replaced by `value`."""
    if isinstance(layers, tuple):
        return (*layers[:i], value, *layers[i + 1 :])
    return layers.at[i].set(value)


def map_layers(fn, *layers: Layers) -> Layers:
    """`fn` applied to each layer's arrays, keeping the form (a tuple, or stacked through `jax.vmap`)."""
    if isinstance(layers[0], tuple):
        return tuple(map(fn, *layers))
    return jax.vmap(fn)(*layers)


def layer_view(cache, i):
    """`cache` (any of the caches here or in `hspec_jax.serving.paged`) as a one-layer cache of the same kind
    holding decoder layer i (its other fields shared): what one decoder layer reads and writes as its layer 0."""
    return cache.replace(k=(cache.k[i],), v=(cache.v[i],))


@flax.struct.dataclass
class KVBuffers:
    k: Layers  # per layer [B, S, K, H], post-norm, post-RoPE (or stacked [L, B, S, K, H])
    v: Layers  # per layer [B, S, K, H]

    @property
    def capacity(self) -> int:
        """S_max, the number of rows each sequence can hold."""
        return self.k[0].shape[1]

    def layer(self, i: int) -> tuple[jax.Array, jax.Array]:
        """(keys, values) of decoder layer i, each `[B, S, K, H]`."""
        return self.k[i], self.v[i]

    def in_place(self, i) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """What attention reads for layer i (`blocked_attention`'s k, v and layer): the stacked k and v `[L, B, S, K,
        H]` and i where the layers are stacked (read in place, block by block), else layer i's arrays and None."""
        if isinstance(self.k, tuple):
            return self.k[i], self.v[i], None
        return self.k, self.v, i

    def write(self, i, k: jax.Array, v: jax.Array, starts: jax.Array):
        """Write layer i's new rows k, v `[B, T, K, H]` at rows `starts[b] + t` (rows past S dropped). In stacked
        layers i may be traced, and the rows go straight into the stack (in place under a scan's carry)."""
        if isinstance(self.k, tuple):
            k_new, v_new = write_rows(self.k[i], k, starts), write_rows(self.v[i], v, starts)
            return self.replace(k=put_layer(self.k, i, k_new), v=put_layer(self.v, i, v_new))
        return self.replace(k=write_rows(self.k, k, starts, i), v=write_rows(self.v, v, starts, i))

    def slot(self, s: jax.Array):
        """Sequence `s` (a traced index) alone: batch 1, its rows copied out (the paged pool's accessor)."""
        take = lambda x: jax.lax.dynamic_slice_in_dim(x, s, 1)
        return self.replace(k=map_layers(take, self.k), v=map_layers(take, self.v))

    def with_slot(self, s: jax.Array, view):
        """These buffers after `view = self.slot(s)` was written to: its rows put back in place."""
        put = lambda x, row: jax.lax.dynamic_update_slice_in_dim(x, row, s, 0)
        return self.replace(k=map_layers(put, self.k, view.k), v=map_layers(put, self.v, view.v))


@flax.struct.dataclass
class KVCache(KVBuffers):
    lengths: jax.Array  # [B] int32, committed rows per sequence

    def slot(self, s: jax.Array):
        """Sequence `s` (a traced index) alone, batch 1, with its committed length."""
        return KVBuffers.slot(self, s).replace(lengths=jax.lax.dynamic_slice_in_dim(self.lengths, s, 1))

    def with_slot(self, s: jax.Array, view):
        """This cache after `view = self.slot(s)` was written to and committed."""
        return KVBuffers.with_slot(self, s, view).replace(lengths=self.lengths.at[s].set(view.lengths[0]))


def init_cache(config: TargetConfig, batch_size: int, capacity: int, dtype=None) -> KVCache:
    """An empty cache of `capacity` rows per sequence, in `dtype` (default: the config's compute dtype): per layer
    k and v `[B, S, K, H]` (B = `batch_size`, S = `capacity`; stacked `[L, B, S, K, H]` when the config's decoder
    scans its layers), committed `lengths [B]` all 0."""
    dtype = dtype or config.dtype
    shape = (batch_size, capacity, config.num_kv_heads, config.head_dim)
    return KVCache(
        k=zeros_layers(config.num_layers, shape, dtype, config.scans_layers),
        v=zeros_layers(config.num_layers, shape, dtype, config.scans_layers),
        lengths=jnp.zeros((batch_size,), jnp.int32),
    )


def write_rows(buffer: jax.Array, rows: jax.Array, starts: jax.Array, layer=None) -> jax.Array:
    """Write `rows [B, T, ...]` into `buffer [B, S, ...]` (or into layer `layer` of a stacked `[L, B, S, ...]`) at
    rows `starts[b] + t`; rows past S are dropped."""
    b, t = rows.shape[:2]
    row_ids = starts[:, None] + jnp.arange(t)[None, :]  # [B, T]
    batch_ids = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
    index = (batch_ids, row_ids) if layer is None else (layer, batch_ids, row_ids)
    return buffer.at[index].set(rows.astype(buffer.dtype), mode="drop")


def commit(cache: KVCache, num_rows: jax.Array) -> KVCache:
    """Advance each sequence's committed length by `num_rows [B]` (rows already written by a forward)."""
    return cache.replace(lengths=cache.lengths + num_rows.astype(jnp.int32))


def check_capacity(prompt_lengths, needed_new_rows: int, capacity: int) -> None:
    """Host-side check that every prompt, plus `needed_new_rows` rows of lookahead, fits in the cache."""
    longest = int(max(prompt_lengths))
    if longest + needed_new_rows > capacity:
        raise ValueError(
            f"prompt of {longest} tokens plus {needed_new_rows} rows of lookahead does not fit in a KV cache "
            f"of {capacity} rows; shorten the prompt or raise the cache length"
        )
