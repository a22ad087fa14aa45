"""`python -m train.main` end to end on the tiny recipe: it trains and exports a loadable drafter, resumes
exactly after kill -9, and two processes train like one (bad overrides: tests/test_train_bad_input.py)."""

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from conftest import without_compile_cache

from hspec_jax.checkpoints.drafter_io import read_drafter_meta, save_drafter
from hspec_jax.drafters import init_drafter
from hspec_jax.drafters.vocab import vocab_from_ids
from hspec_jax.recipes import drafter_from_recipe, load_config
from train.loop import lock_workdir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = ["Ada", "Bo", "Cy", "Di", "Ed", "Flo", "Gus", "Hal"]


def conversations(count, seed=0, prefix="sum"):
    """Templated arithmetic chats written here (no external data): learnable, deterministic text."""
    rng = np.random.default_rng(seed)
    records = []
    for i in range(count):
        a, b = (int(x) for x in rng.integers(1, 50, 2))
        name = NAMES[i % len(NAMES)]
        messages = [
            {"role": "user", "content": f"{name} has {a} apples and gets {b} more. How many now?"},
            {"role": "assistant", "content": f"{name} now has {a} + {b} = {a + b} apples."},
        ]
        records.append({"id": f"{prefix}-{i}", "messages": messages})
    return records


def write_jsonl(path, records):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return str(path)


def write_conversations(path, count=160):
    return write_jsonl(path, conversations(count))


def command(workdir, data, *overrides):
    """The arguments of `python -m train.main` on the tiny recipe."""
    return [
        "--config=configs/tiny.py",
        f"--workdir={workdir}",
        f"--config.data.sources={data}",
        "--config.data.exclude_eval_prompts=False",
        "--config.data.seq_len=128",
        "--config.data.max_anchors=16",
        "--config.train.batch_size=2",
        "--config.train.log_every=1",
        *overrides,
    ]


ENV = dict(os.environ, HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu")


def run_ok(train_driver, args) -> dict:
    """Run to completion (forked: tests/forked_main.py), require success, and return the JSON result it prints
    last."""
    child = train_driver.run(args)
    assert child.status == 0, child.stderr()[-3000:]
    return json.loads(child.stdout().strip().splitlines()[-1])


def losses(workdir):
    """The training steps' losses (not step 0: the starting drafter's evaluation, when logged)."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    rows = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))  # every step once, in order
    return [r["loss"] for r in rows]


# Six steps, evaluated at the last one. Only the run that is killed and resumed checkpoints along the way (every
# other step); the others save (and export) once, at the end: when to save changes no loss.
NUM_STEPS = 6
STEPS = [f"--config.train.num_steps={NUM_STEPS}"]
ONE_CHECKPOINT = f"--config.train.checkpoint_every={NUM_STEPS}"
TRAIN_COUNT = 160


@pytest.fixture(scope="session")
def straight(tmp_path_factory, train_driver):
    """(data file, work directory, printed result, step overrides) of one uninterrupted 6-step run with a held-out
    file, the reference of the resume and multi-process tests (which run with the same step overrides). The
    held-out file repeats the first training conversation, so training must drop it; its records name two families
    (their "source" field). Session-scoped: a worker may run another file's test between these tests, which would
    tear down a module fixture and run it again."""
    root = tmp_path_factory.mktemp("train_main")
    data = write_conversations(root / "chat.jsonl", TRAIN_COUNT)
    held_out = [*conversations(12, seed=1, prefix="held"), conversations(1)[0]]
    held_out = [{**r, "source": "math" if i < 6 else "code"} for i, r in enumerate(held_out)]
    held_out = write_jsonl(root / "heldout.jsonl", held_out)
    steps = [*STEPS, f"--config.data.held_out={held_out}"]
    args = command(root / "straight", data, *steps, ONE_CHECKPOINT, f"--config.train.eval_every={NUM_STEPS}")
    result = run_ok(train_driver, args)
    return data, root / "straight", result, steps


@pytest.mark.slow
@pytest.mark.xdist_group("processes")
def test_held_out_metrics_at_eval_steps_and_held_out_prompts_never_trained_on(straight):
    """The held-out metrics are logged at evaluation steps only, and at step 0 for the starting drafter (a record
    with no training metrics), and agree with each other and the printed result; the held-out conversation that
    repeats a training one is dropped from training and named."""
    _, straight, result, _ = straight
    with open(straight / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    slots = range(1, 8)  # the tiny recipe drafts 7 tokens per block
    expected = {*(f"heldout_acc_{k}" for k in slots), *(f"heldout_overlap_{k}" for k in slots)}
    expected |= {"heldout_sim_accept_len", "heldout_loss", "heldout_supervised_slots", "tau"}
    expected |= {f"heldout_{family}_{name}" for family in ("math", "code") for name in ("acc_1", "sim_accept_len")}
    assert [r["step"] for r in rows if expected <= set(r)] == [0, NUM_STEPS]  # eval_every=NUM_STEPS: start and end
    assert all(key.startswith(("heldout_", "tau", "accept_")) for key in rows[0] if key != "step")  # no training
    assert not any(key.startswith("heldout_") for r in rows[1:-1] for key in r)
    final = rows[-1]
    assert all(0.0 <= final[f"heldout_acc_{k}"] <= 1.0 for k in slots)
    agree = [final[f"heldout_acc_{k}"] for k in slots]
    assert final["heldout_sim_accept_len"] == pytest.approx(1 + sum(np.cumprod(agree)), rel=1e-5)
    assert final["heldout_supervised_slots"] > 0 and np.isfinite(final["heldout_loss"])
    for family in ("math", "code"):
        assert 0.0 <= final[f"heldout_{family}_acc_1"] <= 1.0
        assert 1.0 <= final[f"heldout_{family}_sim_accept_len"] <= 8.0
    assert result["heldout_acc_1"] == final["heldout_acc_1"]
    report = json.loads((straight / "data.json").read_text())
    (source,) = report["sources"]
    assert source["conversations"] == TRAIN_COUNT - 1 and source["excluded_held_out_prompts"] == 1
    assert report["held_out"] == [*(f"held-{i}" for i in range(12)), "sum-0"]
    assert report["held_out_families"] == {"math": 6, "code": 7}


@pytest.mark.slow
@pytest.mark.xdist_group("processes")
def test_trains_exports_and_resumes_exactly_after_kill(straight, train_driver, tmp_path):
    """The run's loss falls and it exports its drafter, recipe, data fingerprint, vocabulary and TensorBoard
    events; fine-tuning the export starts from its weights and vocabulary; a run killed with SIGKILL after a
    checkpoint resumes from it to the losses of the uninterrupted run."""
    data, straight, result, steps = straight
    steps = [*steps, f"--config.train.eval_every={NUM_STEPS}", "--config.train.checkpoint_every=2"]
    assert result["resumed_from"] == 0 and result["tau"] >= 1.0 and "accept_1" in result
    reference = losses(straight)
    assert len(reference) == NUM_STEPS and reference[-1] < reference[0]
    assert os.path.exists(straight / "drafter" / "hspec_drafter.json")
    record = json.loads((straight / "drafter" / "training.json").read_text())
    assert record["step"] == NUM_STEPS and record["recipe"]["train"]["num_steps"] == NUM_STEPS
    (source,) = record["data"]["sources"]
    with open(data, "rb") as f:
        assert source["sha256"] == hashlib.sha256(f.read()).hexdigest()
    assert os.path.exists(straight / "vocab.npz") and os.path.exists(straight / "data.json")
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(straight))

    # Fine-tuning the exported drafter: it starts from its weights (so below the fresh run's first loss on the
    # same first batch) and keeps its draft vocabulary. It runs the straight run's step count: the learning-rate
    # schedule is part of the compiled step, so the step program can be the straight run's, from the tests' cache.
    tuned = tmp_path / "tuned"
    init = f"--config.train.init_from={straight / 'drafter'}"
    run_ok(train_driver, command(tuned, data, *STEPS, "--config.train.eval_every=0", init))
    assert losses(tuned)[0] < reference[0] - 0.5 * (reference[0] - reference[-1])
    with np.load(straight / "vocab.npz") as a, np.load(tuned / "vocab.npz") as b:
        np.testing.assert_array_equal(a["d2t"], b["d2t"])
    assert json.loads((tuned / "data.json").read_text())["init_from"] == str(straight / "drafter")

    # The same run killed (SIGKILL) after its step-4 checkpoint, then started again with the same workdir.
    resumed = tmp_path / "resumed"
    victim = train_driver.start(command(resumed, data, *steps))
    deadline = time.time() + 600
    while not os.path.exists(resumed / "checkpoints" / "4") and time.time() < deadline:
        time.sleep(0.2)
    os.kill(victim.pid, signal.SIGKILL)
    assert victim.wait() == -signal.SIGKILL  # killed, not finished
    assert os.path.exists(resumed / "checkpoints" / "4") and not os.path.exists(resumed / "checkpoints" / "6")
    assert run_ok(train_driver, command(resumed, data, *steps))["resumed_from"] == 4
    np.testing.assert_allclose(losses(resumed), reference, rtol=1e-6)


def test_a_smaller_drafter_cut_from_a_saved_one_trains(train_driver, tmp_path):
    """`train.init_layers`: a recipe drafter of six of a saved drafter's eleven sub-layers and half its draft
    vocabulary starts from them and from its 32 most frequent tokens, trains, and exports a drafter of that shape."""
    recipe = load_config("tiny")
    drafter = drafter_from_recipe(recipe)
    source_vocab = vocab_from_ids(np.arange(drafter.vocab_size), drafter.target.vocab_size)
    save_drafter(str(tmp_path / "saved"), init_drafter(drafter, jax.random.key(0)), drafter, source_vocab)
    cut = tmp_path / "cut"
    overrides = [
        "--config.train.num_steps=2",
        "--config.train.eval_every=0",
        f"--config.train.init_from={tmp_path / 'saved'}",
        "--config.train.init_layers=0,3,4,8,9,10",
        "--config.drafter.block_pattern=('mamba','attn','mlp','mamba','attn','mlp')",
        "--config.drafter.attn_kv_layer_ids=(2,4)",
        "--config.drafter.draft_vocab_size=32",
    ]
    run_ok(train_driver, command(cut, write_conversations(tmp_path / "chat.jsonl"), *overrides))
    config, vocab, _ = read_drafter_meta(str(cut / "drafter"))
    assert config.block_pattern == ("mamba", "attn", "mlp", "mamba", "attn", "mlp")
    assert config.attn_kv_layer_ids == (2, 4) and vocab.size == 32
    assert set(np.asarray(vocab.d2t)) < set(np.asarray(source_vocab.d2t))
    assert json.loads((cut / "data.json").read_text())["init_from"] == str(tmp_path / "saved")


def free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.xdist_group("processes")
def test_two_processes_train_like_one_and_stop_together_on_sigterm(straight, tmp_path):
    """Two processes (data=2, one device each) give the losses of the one-process run, also when a SIGTERM to one
    of them (a scheduler's preemption notice) stops both after the same step, saved, and they are started again."""
    data, single, _, steps = straight
    steps = [*steps, ONE_CHECKPOINT, "--config.train.eval_every=0"]  # evaluating would change no loss
    workdir = tmp_path / "multi"

    args = [*command(workdir, data, *steps), "--config.mesh=data=2", "--num_processes=2"]
    # Without the tests' compilation cache: a collective program loaded from it by the second process disagrees
    # with the first's (jax 0.10.2 on CPU: "sync_global_devices name mismatch").
    env = without_compile_cache(ENV)

    def start_both():  # on a fresh port each time
        coordinator = f"--coordinator=localhost:{free_port()}"
        return [
            subprocess.Popen(
                [sys.executable, "-m", "train.main", *args, coordinator, f"--process_id={i}"],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i in range(2)
        ]

    procs = start_both()
    deadline = time.time() + 600
    while not (workdir / "recipe.json").exists() and time.time() < deadline:  # both joined the job and its service
        time.sleep(0.1)
    procs[1].send_signal(signal.SIGTERM)
    last_lines = []
    for p in procs:
        _, err = p.communicate(timeout=900)
        assert p.returncode == 130, err[-3000:]
        last_lines.append(err.strip().splitlines()[-1])
    assert last_lines[0] == last_lines[1], last_lines  # the same step, saved by both
    stopped = int(last_lines[0].removeprefix("interrupted: stopped after step ").split()[0])
    assert 1 <= stopped < NUM_STEPS and f"last checkpoint: step {stopped} in" in last_lines[0]
    outs = []
    for p in start_both():
        out, err = p.communicate(timeout=900)
        assert p.returncode == 0, err[-3000:]
        outs.append(out)
    assert json.loads(outs[0].strip().splitlines()[-1])["resumed_from"] == stopped  # process 0 prints the result
    np.testing.assert_allclose(losses(workdir), losses(single), rtol=2e-5)


def test_a_second_job_on_the_same_workdir_is_refused(tmp_path):
    held = lock_workdir(str(tmp_path))
    with pytest.raises(
        ValueError, match=rf"work directory {tmp_path} is in use by another training job \(pid {os.getpid()}\)"
    ):
        lock_workdir(str(tmp_path))
    held.close()  # the job ended: the directory is free again
    lock_workdir(str(tmp_path)).close()
