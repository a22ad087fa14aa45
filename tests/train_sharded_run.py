"""Run by tests/test_train_scale.py in a subprocess with 8 host devices: a few training steps of H-Spec on the
tiny recipe on one device and on a data=2,fsdp=2,model=2 mesh; prints the losses and shardings as JSON. (One
kind: the other kinds' parameters go through the same sharding rules, and each kind adds two compilations on
8 devices, about 40 s of the test suite.)"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np
from test_train_step import TARGET, packed_batch, setup_state

from hspec_jax import parallel
from hspec_jax.models import init_params
from train.losses import LossWeights
from train.pipeline import BATCH_KEYS
from train.step import StepConfig, fresh_state, make_train_step

assert jax.device_count() == 8, jax.devices()
STEPS = 3
target_params = init_params(TARGET, jax.random.key(0))
# 8 distinct rows per step (4 pairs of rows with different tokens and anchors)
pairs = [[packed_batch(seed=10 * step + i, batch=2) for i in range(4)] for step in range(STEPS)]
batches = [{k: np.concatenate([p[k] for p in step]) for k in BATCH_KEYS} for step in pairs]

LOWERED = "/jax/core/compile/jaxpr_to_mlir_module_duration"  # one per program compiled (or loaded from a cache)
lowered = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, _, fun_name="", **kw: lowered.append(event == LOWERED and fun_name == "jit(step)")
)

results = {}
for spec in ("single", "data=2,fsdp=2,model=2"):
    drafter, vocab, state, optimizer, schedule = setup_state("hspec", target_params)
    mesh = None if spec == "single" else parallel.make_mesh(spec)
    tp = target_params
    if mesh is not None:
        params = parallel.shard_params(state.params, mesh, TARGET.head_dim, fsdp=True)
        state = fresh_state(params, optimizer, 0, mesh)
        tp = parallel.shard_params(target_params, mesh, TARGET.head_dim)
    config = StepConfig(TARGET, drafter, LossWeights(), anchors_per_chunk=6)
    shardings = None if mesh is None else jax.tree.map(lambda x: x.sharding, state)
    step = make_train_step(config, optimizer, schedule, mesh, shardings)
    losses = []
    lowered.clear()
    for batch in batches:
        if mesh is not None:
            batch = {k: jax.device_put(v, parallel.batch_sharding(mesh, v.shape)) for k, v in batch.items()}
        else:
            batch = jax.tree.map(jnp.asarray, batch)
        state, metrics = step(state, tp, vocab, batch)
        losses.append(float(metrics["loss"]))
    entry = {"losses": losses}
    if mesh is not None:
        entry["step_programs"] = sum(lowered)  # one program for every step
        entry["fc_sharding"] = str(state.params["fc"]["kernel"].sharding.spec)
        entry["batch_sharding"] = str(batch["tokens"].sharding.spec)
    results[spec] = entry
print(json.dumps(results))
