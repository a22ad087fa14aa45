"""Training scale-out: a few steps on 8 simulated host devices (a data=2,fsdp=2,model=2 mesh) give the losses of
one device, with the drafter's parameters sharded over fsdp and the batch over data x fsdp."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.xdist_group("processes")
def test_sharded_training_equals_one_device():
    script = os.path.join(ROOT, "tests", "train_sharded_run.py")
    proc = subprocess.run([sys.executable, script], capture_output=True, text=True, cwd=ROOT, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    single = results["single"]["losses"]
    assert single[-1] < single[0]
    np.testing.assert_allclose(results["data=2,fsdp=2,model=2"]["losses"], single, rtol=2e-4)
    assert results["data=2,fsdp=2,model=2"]["step_programs"] == 1
    assert results["data=2,fsdp=2,model=2"]["fc_sharding"] == "P('fsdp',)"
    assert results["data=2,fsdp=2,model=2"]["batch_sharding"] == "P(('data', 'fsdp'), None)"
