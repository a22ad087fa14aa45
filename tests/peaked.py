"""Random targets made peaked, so that greedy decoding is far from ties (tests that compare token streams)."""

import jax


def peaked(params: dict, scale: float) -> dict:
    """`params` with every matrix (embeddings, lm_head, each layer's linear kernels) multiplied by `scale`; norms
    and biases unchanged. The target's stacked layers carry one more (leading) axis."""

    def scaled(path, x):
        per_layer_rank = x.ndim - (getattr(path[0], "key", None) == "layers")
        return x * scale if per_layer_rank == 2 else x

    return jax.tree_util.tree_map_with_path(scaled, params)
