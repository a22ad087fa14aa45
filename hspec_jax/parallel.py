"""Device meshes and sharding rules: the distributed engine is plain JAX SPMD (GSPMD).

A mesh has three axes: `data` (batch), `fsdp` (batch, and in training the drafter's parameters and
optimiser state: fully sharded data parallelism) and `model` (tensor parallelism). Parameters are sharded by
logical axis, found from their path in the param dict (`PARAM_RULES`):

    vocab  -> model         embedding / lm_head rows, Markov head vocabulary axes
    heads  -> model         q/k/v output features and o_proj input features (whole heads per shard)
    mlp    -> model         the SwiGLU intermediate width
    batch  -> data x fsdp   prompts, packed training rows, KV caches, per-sequence lengths

The target's decoder layers are stacked on a leading layer axis (`layers/...`, `[L, ...]`), and so is its KV
cache when the decoder scans (`[L, B, S, K, H]`): that axis is never sharded. Every device keeps its
tensor-parallel shard of every layer, so a scanned step slices its own shard locally and the layer loop needs
no collective beyond the ones tensor parallelism already has; splitting layers over devices would be pipeline
parallelism, which a decoding step of a few tokens cannot keep busy.

Parameters replicated on purpose (norms, output biases, Mamba mixers, fusion projections, heads' small
layers) are named in `REPLICATED_PARAMS`; a parameter in neither table is an error naming its path, so a new
parameter cannot silently end up replicated. With `fsdp=True` (`param_shardings`, the trained drafter) each
parameter's largest remaining dimension that the fsdp axis divides is split over it. A dimension that the
mesh axis does not divide (e.g. 3 KV heads on model=2) is replicated rather than split unevenly. The jitted
decoding loops need no changes: inputs placed with these shardings make XLA partition the whole loop,
inserting the collectives. On one device every spec is trivially replicated.

Many hosts: call `jax.distributed.initialize()` first in every process (one process per host, same
program); `jax.devices()` then lists the global devices and `make_mesh` spans all of them. Load or create
parameters on every host and place them with `shard_params` (each host keeps only its shards);
prompts must be the same global batch on every host.
"""

from __future__ import annotations

import math
import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

AXES = ("data", "fsdp", "model")
LOGICAL_TO_MESH = {"batch": ("data", "fsdp"), "vocab": ("model",), "heads": ("model",), "mlp": ("model",)}
# (path regex, logical axis of each dimension) of the sharded parameters. First match wins.
PARAM_RULES = (
    (r"(^|/)embed_tokens/embedding$", ("vocab", None)),
    (r"(^|/)lm_head$", ("vocab", None)),
    (r"self_attn/[qkv]_proj/kernel$", (None, "heads")),
    (r"self_attn/[qkv]_proj/bias$", ("heads",)),
    (r"self_attn/o_proj/kernel$", ("heads", None)),
    (r"mlp/(gate|up)_proj/kernel$", (None, "mlp")),
    (r"mlp/(gate|up)_proj/bias$", ("mlp",)),
    (r"mlp/down_proj/kernel$", ("mlp", None)),
    (r"markov_head/markov_w1$", ("vocab", None)),
    (r"markov_head/markov_w2$", (None, "vocab")),
)
# (path regex, why) of the parameters replicated on purpose: every dimension on no mesh axis.
REPLICATED_PARAMS = (
    (
        r"(^|/)(input_layernorm|post_attention_layernorm|norm|q_norm|k_norm|hidden_norm|ssm_norm|mlp_norm)/scale$",
        "RMSNorm scales [D] or [H]: layer, final, q/k, fusion (hidden) and drafter sub-layer norms",
    ),
    (r"self_attn/o_proj/bias$", "o_proj bias [D]: the model dimension is not sharded"),
    (r"mlp/down_proj/bias$", "down_proj bias [D]: the model dimension is not sharded"),
    (r"ssm/(in_proj|out_proj|conv1d)/(kernel|bias)$", "Mamba-2 mixer projections and conv: not tensor-parallel"),
    (r"ssm/(A_log|D|dt_bias|norm)$", "Mamba-2 per-head decays, skip, dt bias and gated-norm scale: small vectors"),
    (r"(^|/)fc/kernel$", "drafter fusion projection [F*D, D]: not tensor-parallel"),
    (r"(^|/)seed_projs_\d+/kernel$", "H-Spec seed projections [D, D]: not tensor-parallel"),
    (r"confidence_head/proj/(kernel|bias)$", "confidence head [D, 1] and its bias: tiny"),
    (r"^mask_embedding$", "the drafter's mask-token embedding row [D]"),
)


def parse_mesh_spec(spec: str) -> dict[str, int]:
    """'data=2,model=4' -> {'data': 2, 'model': 4}; missing axes are 1."""
    sizes = dict.fromkeys(AXES, 1)
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, value = part.partition("=")
        if name not in AXES or not value.isdigit() or int(value) < 1:
            raise ValueError(f"bad mesh spec {spec!r}: expected e.g. 'data=2,model=4' (axes {AXES})")
        sizes[name] = int(value)
    return sizes


def make_mesh(spec: str = "data=1,model=1", devices=None) -> Mesh:
    """A ('data', 'fsdp', 'model') mesh over the first data*fsdp*model devices."""
    sizes = parse_mesh_spec(spec)
    devices = list(devices if devices is not None else jax.devices())
    needed = math.prod(sizes.values())
    if needed > len(devices):
        raise ValueError(f"mesh {spec!r} needs {needed} devices, only {len(devices)} available")
    grid = np.asarray(devices[:needed], dtype=object).reshape(tuple(sizes[a] for a in AXES))
    return Mesh(grid, AXES)


def _path(key_path) -> str:
    return "/".join(str(getattr(k, "key", k)) for k in key_path)


STACKED_LAYERS = "layers/"  # the target's stacked layer tree: its leading layer axis stays unsharded


def logical_axes(path: str, shape) -> tuple:
    """The logical axis of each dimension of the parameter at `path` (e.g. 'layers/self_attn/q_proj/kernel')
    of `shape`: from `PARAM_RULES`, or all None for `REPLICATED_PARAMS`, after a leading unsharded layer axis for
    the target's stacked layers. A parameter in neither, or whose rank is not its rule's, is a ValueError naming
    it."""
    if path.startswith(STACKED_LAYERS) and not path[len(STACKED_LAYERS)].isdigit():
        return (None, *logical_axes(path[len(STACKED_LAYERS) :], shape[1:]))
    for pattern, axes in PARAM_RULES:
        if re.search(pattern, path):
            if len(axes) != len(shape):
                raise ValueError(f"parameter {path!r} of shape {tuple(shape)} does not fit its sharding rule {axes}")
            return axes
    if any(re.search(pattern, path) for pattern, _ in REPLICATED_PARAMS):
        return (None,) * len(shape)
    rules = "\n".join(f"  {pattern}  {axes}" for pattern, axes in PARAM_RULES)
    replicated = "\n".join(f"  {pattern}  ({why})" for pattern, why in REPLICATED_PARAMS)
    raise ValueError(
        f"no sharding rule for parameter {path!r} of shape {tuple(shape)}: add it to PARAM_RULES or "
        f"REPLICATED_PARAMS in hspec_jax/parallel.py.\nPARAM_RULES:\n{rules}\nREPLICATED_PARAMS:\n{replicated}"
    )


def spec_for(mesh: Mesh, shape, axes, granule: dict[str, int] | None = None) -> PartitionSpec:
    """PartitionSpec placing each logical axis on its mesh axis where the size divides evenly (in whole
    `granule` units, e.g. whole heads), replicating it otherwise."""
    out = []
    for size, logical in zip(shape, axes, strict=True):
        mesh_axes = tuple(a for a in LOGICAL_TO_MESH.get(logical, ()) if mesh.shape.get(a, 1) > 1)
        unit = (granule or {}).get(logical, 1)
        parts = math.prod(mesh.shape[a] for a in mesh_axes)
        fits = mesh_axes and size % (parts * unit) == 0
        out.append((mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes) if fits else None)
    return PartitionSpec(*out)


def with_fsdp(mesh: Mesh, shape, spec: PartitionSpec) -> PartitionSpec:
    """`spec` with the largest still-unsharded dimension that the `fsdp` axis divides split over it."""
    parts = mesh.shape.get("fsdp", 1)
    free = [i for i, (size, axis) in enumerate(zip(shape, spec, strict=True)) if axis is None and size % parts == 0]
    if parts == 1 or not free:
        return spec
    dim = max(free, key=lambda i: shape[i])
    return PartitionSpec(*("fsdp" if i == dim else axis for i, axis in enumerate(spec)))


def param_shardings(params, mesh: Mesh, head_dim: int, fsdp: bool = False):
    """NamedSharding for every parameter (see the module docstring for the rules); a parameter no rule covers
    is a ValueError naming its path (`logical_axes`)."""
    granule = {"heads": head_dim}

    def sharding(key_path, x):
        spec = spec_for(mesh, x.shape, logical_axes(_path(key_path), x.shape), granule)
        return NamedSharding(mesh, with_fsdp(mesh, x.shape, spec) if fsdp else spec)

    return jax.tree_util.tree_map_with_path(sharding, params)


def shard_params(params, mesh: Mesh, head_dim: int, fsdp: bool = False):
    return jax.device_put(params, param_shardings(params, mesh, head_dim, fsdp))


def batch_sharding(mesh: Mesh, shape) -> NamedSharding:
    """Batch-leading arrays (prompts, lengths, rng-free per-sequence state): batch on `data`."""
    return NamedSharding(mesh, spec_for(mesh, shape, ("batch",) + (None,) * (len(shape) - 1)))


def kv_sharding(mesh: Mesh, shape) -> NamedSharding:
    """A KV buffer `[B, S, K, H]` (or stacked `[L, B, S, K, H]`, the layer axis unsharded): batch on `data`, KV
    heads on `model`."""
    return NamedSharding(mesh, spec_for(mesh, shape, (None,) * (len(shape) - 4) + ("batch", None, "heads", None)))


def shard_batch(mesh: Mesh, *arrays):
    return tuple(jax.device_put(a, batch_sharding(mesh, np.shape(a))) for a in arrays)


def shard_kv(mesh: Mesh, tree):
    """Place every `[B, S, K, H]` (or stacked `[L, B, S, K, H]`) buffer of a cache pytree (KVCache, DFlash
    context) and its `[B]` lengths."""
    return jax.tree.map(
        lambda x: jax.device_put(x, kv_sharding(mesh, x.shape) if x.ndim >= 4 else batch_sharding(mesh, x.shape)), tree
    )
