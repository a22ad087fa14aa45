"""Where an engine's arrays live: params, the batch and the caches sharded on a mesh, or, on one device, params as
the backend runs them best. Every decoding driver (`generate`, `speculative_generate`, the compiled `Engine`) places
its inputs through `Placement`."""

from __future__ import annotations

from hspec_jax import parallel
from hspec_jax.decoding.bundle import Bundle
from hspec_jax.models.layers import for_backend


class Placement:
    """Put params / batch / caches on the mesh (without one: params as `for_backend` gives them for the target
    `config`'s decoder, scanned or per layer, the rest as is)."""

    def __init__(self, mesh, config):
        self.mesh, self.head_dim, self.scan = mesh, config.head_dim, config.scans_layers

    def params(self, params):
        """Sharded on the mesh; on one device, as the backend runs them best (`for_backend`: fused on CPU, the layers
        stacked where the decoder scans them, one tree per layer where it does not)."""
        if self.mesh is None:
            return for_backend(params, scan=self.scan)
        return parallel.shard_params(params, self.mesh, self.head_dim)

    def bundle(self, bundle: Bundle) -> Bundle:
        """`bundle` with both models' params placed as `params` places them (the vocabulary as it is)."""
        drafter_params = None if bundle.drafter_params is None else self.params(bundle.drafter_params)
        return bundle.replace(target_params=self.params(bundle.target_params), drafter_params=drafter_params)

    def batch(self, *arrays):
        return arrays if self.mesh is None else parallel.shard_batch(self.mesh, *arrays)

    def kv(self, tree):
        return tree if self.mesh is None else parallel.shard_kv(self.mesh, tree)
