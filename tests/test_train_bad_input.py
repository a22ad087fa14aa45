"""`train.main` meets the inference tools' contract: every bad flag, recipe value, data file or work directory is
one `error: ...` line naming it, exit 2 or 1, before anything is read, loaded or written; a work directory
refuses a resume with another recipe; a damaged checkpoint is named and moved aside, never deleted; Ctrl-C or
SIGTERM saves the step under way, says where it stopped and exits 130."""

from __future__ import annotations

import json
import os
import signal
import time

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.experimental import multihost_utils

from hspec_jax.errors import InputError
from hspec_jax.recipes import load_config
from train.checks import recipe_differences, record_recipe
from train.data import Conversation
from train.loop import StopSignals, checkpoint_manager, restore_latest
from train.pipeline import make_train_iterator, sampled_token_counts, supervised_token_counts
from train.tokenizers import char_tokenizer

CHAT = {"messages": [{"role": "user", "content": "Add 2 and 3."}, {"role": "assistant", "content": "5."}]}


@pytest.fixture(scope="module")
def train_main(train_driver):
    """`train_main(workdir, *args, data=None, config=...)` runs `python -m train.main --config=... --workdir=...
    *args` (plus `--config.data.sources=data`) and returns (exit status, stderr lines)."""

    def run(workdir, *args, data=None, config="configs/tiny.py", timeout=120):
        args = [f"--config={config}", f"--workdir={workdir}", *args]
        if data is not None:
            args.append(f"--config.data.sources={data}")
        child = train_driver.run(args, timeout)
        return child.status, child.stderr().strip().splitlines()

    return run


def assert_one_error(status, lines, code, *parts):
    assert status == code, lines
    assert lines and lines[-1].startswith("error: ") and not any("Traceback" in line for line in lines), lines
    for part in parts:
        assert part in lines[-1], lines[-1]


def write_jsonl(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


@pytest.mark.parametrize(
    "args, code, parts",
    [
        (["--config.train.nonexistent=1"], 2, ["--config.train.nonexistent", "no field 'nonexistent'", "num_steps"]),
        (["--config.train.batch_size=abc"], 2, ["--config.train.batch_size", "'abc'"]),
        (["--num-processes=2"], 2, ["num-processes", "num_processes"]),
        (["--config.train.batch_size=0"], 1, ["--config.train.batch_size must be at least 1, got 0"]),
        (["--config.train.learning_rate=0"], 1, ["--config.train.learning_rate must be positive"]),
        (["--config.data.seq_len=8"], 1, ["--config.data.seq_len must exceed"]),
        (["--config.data.sources=/nope/chats.jsonl"], 1, ["'/nope/chats.jsonl' does not exist"]),
        (["--config.data.sources=chats.txt"], 1, ["--config.data.sources", "chats.txt"]),
        (["--config.data.held_out=/nope/held.jsonl"], 1, ["--config.data.held_out: file '/nope/held.jsonl' does"]),
        (["--config.data.held_out_batches=0"], 1, ["--config.data.held_out_batches must be at least 1, got 0"]),
        (["--config.target.path=/nope/model"], 1, ["/nope/model"]),
        (["--config.mesh=data=2,fsdp=1,model=1"], 1, ["--config.mesh"]),
        (["--config.drafter.kind=nope"], 1, ["unknown drafter kind 'nope'"]),
        (["--config.train.optimizer=sgd"], 1, ["--config.train.optimizer 'sgd' is unknown"]),
        (["--config.drafter.mamba_heads=3"], 2, ["--config.drafter.mamba_heads", "no field 'mamba_heads'"]),
        (["--config.train.init_layers=0,1"], 1, ["init_layers cuts the drafter of --config.train.init_from"]),
        (["--config.train.init_layers=0,x"], 1, ["--config.train.init_layers='0,x': give comma-separated"]),
    ],
)
def test_bad_flags_and_recipe_values_are_one_line_before_anything_is_written(train_main, tmp_path, args, code, parts):
    status, lines = train_main(tmp_path / "run", *args)
    assert_one_error(status, lines, code, *parts)
    assert not (tmp_path / "run").exists()


def test_a_missing_recipe_file_and_a_file_as_workdir_are_one_line(train_main, tmp_path):
    assert_one_error(*train_main(tmp_path, config="configs/nope.py"), 2, "--config: ", "configs/nope.py")
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert_one_error(*train_main(afile), 1, f"--workdir {afile} is not a directory")


def test_help_spells_the_flags_as_they_are_accepted():
    from train import main

    assert "--num_processes" in main.__doc__ and "--num-processes" not in main.__doc__
    assert "--process_id" in main.__doc__ and "--process-id" not in main.__doc__


@pytest.mark.parametrize(
    "lines, where",
    [
        ([json.dumps(CHAT), "{not json", json.dumps(CHAT)], ":2: not a JSON record"),
        ([json.dumps(CHAT), "", json.dumps([1, 2])], ":3: a record must be a JSON object, got list"),
        ([json.dumps(CHAT), json.dumps({"text": "hi"})], ":2: record has neither 'messages' nor 'conversations'"),
    ],
)
def test_a_bad_data_line_is_named_with_its_number_before_anything_is_written(train_main, tmp_path, lines, where):
    data = write_jsonl(tmp_path / "chats.jsonl", lines)
    status, err = train_main(tmp_path / "run", data=data)
    assert_one_error(status, err, 1, data + where)
    assert not (tmp_path / "run").exists()


def test_a_held_out_file_smaller_than_the_real_tau_prompts_writes_nothing(train_main, tmp_path):
    data = write_jsonl(tmp_path / "chats.jsonl", [json.dumps(CHAT)] * 8)
    held = write_jsonl(tmp_path / "held.jsonl", [json.dumps(CHAT)] * 3)  # the tiny recipe's real tau needs 4
    status, err = train_main(tmp_path / "run", f"--config.data.held_out={held}", data=data)
    assert_one_error(status, err, 1, f"--config.data.held_out '{held}' has 3 usable conversations; it needs at least 4")
    assert not (tmp_path / "run").exists()


def test_a_source_without_usable_conversation_writes_nothing(train_main, tmp_path):
    data = write_jsonl(tmp_path / "chats.jsonl", [json.dumps({"messages": [{"role": "assistant", "content": "x"}]})])
    (tmp_path / "run").mkdir()
    status, err = train_main(tmp_path / "run", data=data)
    assert_one_error(status, err, 1, "has no usable conversation", data)
    assert os.listdir(tmp_path / "run") == []


def test_resuming_with_another_recipe_names_the_fields_that_differ(train_main, tmp_path):
    record_recipe(load_config("tiny"), str(tmp_path))
    before = sorted(os.listdir(tmp_path))
    status, err = train_main(tmp_path, "--config.drafter.kind=dspark", "--config.drafter.draft_vocab_size=32")
    assert_one_error(
        status, err, 1, "drafter.kind='hspec' (requested 'dspark')", "drafter.draft_vocab_size=64 (requested 32)"
    )
    assert sorted(os.listdir(tmp_path)) == before


def test_what_may_change_on_resume():
    recorded = load_config("tiny").to_dict()
    changed = load_config("tiny")
    changed.train.num_steps, changed.train.learning_rate, changed.drafter.attention_impl = 9, 1.0, "reference"
    assert recipe_differences(recorded, changed.to_dict()) == []
    changed.target.hf_config.hidden_size = 32
    changed.data.sources = "other.jsonl"
    changed.data.held_out_batches = 1  # which held-out batches are measured, not what is trained on
    assert recipe_differences(recorded, changed.to_dict()) == [
        "data.sources='sharegpt' (requested 'other.jsonl')",
        "target.hf_config.hidden_size=64 (requested 32)",
    ]


def test_a_work_directory_older_than_the_held_out_fields_resumes_with_their_defaults():
    recorded = load_config("tiny").to_dict()
    del recorded["data"]["held_out"], recorded["data"]["held_out_batches"]
    assert recipe_differences(recorded, load_config("tiny").to_dict()) == []
    changed = load_config("tiny")
    changed.data.held_out = "held.jsonl"
    assert recipe_differences(recorded, changed.to_dict()) == ["data.held_out='' (requested 'held.jsonl')"]


class _Run:
    """What `restore_latest` reads of a `train.loop.Run`: the recipe and the data iterator."""

    def __init__(self, iterator):
        self.config = load_config("tiny")
        self.iterator = iterator


def test_a_damaged_checkpoint_is_named_moved_aside_and_the_previous_one_restored(tmp_path, capsys):
    chars = char_tokenizer()
    conversations = [Conversation(f"c{i}", "m", CHAT["messages"]) for i in range(8)]
    iterator = make_train_iterator(
        conversations, chars, seq_len=64, batch_size=2, max_anchors=4, block_size=8, process_index=0, process_count=1
    )
    run = _Run(iterator)
    manager = checkpoint_manager(str(tmp_path), keep=3)
    for step in (1, 2):
        state = {"w": jnp.full(3, float(step))}
        next(iterator)
        save = ocp.args.Composite(state=ocp.args.StandardSave(state), data=grain.checkpoint.CheckpointSave(iterator))
        manager.save(step, args=save)
    manager.wait_until_finished()
    step_two = tmp_path / "checkpoints" / "2"
    victim = step_two / "state" / "manifest.ocdbt"
    victim.write_bytes(b"")
    template = {"w": jnp.zeros(3)}
    manager, state, step = restore_latest(str(tmp_path), manager, run, template)
    assert step == 1 and float(state["w"][0]) == 1.0
    warning = capsys.readouterr().err.strip().splitlines()[-1]
    assert warning.startswith("warning: checkpoint step 2 is damaged") and "resuming from step 1" in warning
    assert str(victim) in warning
    assert (tmp_path / "damaged" / "2").is_dir() and not step_two.exists()
    manager.close()
    (tmp_path / "checkpoints" / "1" / "state" / "_METADATA").write_bytes(b"")
    with pytest.raises(InputError, match=r"checkpoint step 1 is damaged .*no earlier one is left: move .* away"):
        restore_latest(str(tmp_path), checkpoint_manager(str(tmp_path), keep=3), run, template)
    assert (tmp_path / "checkpoints" / "1").is_dir()  # nothing valid, or the last one, is removed


def test_the_draft_vocabulary_sample_draws_by_weight_and_can_count_everything():
    chars = char_tokenizer()
    conversations = [
        Conversation(f"c{i}", "m", [{"role": "user", "content": "q"}, {"role": "assistant", "content": "ab" * (i + 1)}])
        for i in range(10)
    ]
    everything = supervised_token_counts(conversations, chars, 96)
    counts, read = sampled_token_counts(conversations, chars, 96, budget=0)
    np.testing.assert_array_equal(counts, everything)
    assert read == 10
    counts, read = sampled_token_counts(conversations, chars, 96, budget=5, seed=1)
    assert 1 <= read < 10 and counts.sum() >= 5


@pytest.mark.slow
def test_ctrl_c_during_training_saves_the_step_says_where_and_exits_130(train_driver, tmp_path):
    """Ctrl-C finishes the step under way, saves it (although no checkpoint is due for 100,000 steps) with its
    exported drafter, and says so; the same command resumes from that step."""
    data = write_jsonl(tmp_path / "chats.jsonl", [json.dumps(CHAT)] * 40)
    args = [
        "--config=configs/tiny.py",
        f"--workdir={tmp_path / 'run'}",
        f"--config.data.sources={data}",
        "--config.data.exclude_eval_prompts=False",
        "--config.data.held_out_prompts=0",
        # The shapes of tests/test_train_main.py's runs: the same compiled step, from the tests' compilation cache
        "--config.data.seq_len=128",
        "--config.data.max_anchors=16",
        "--config.train.batch_size=2",
        "--config.train.checkpoint_every=100000",
        "--config.train.log_every=1",
    ]
    child = train_driver.start([*args, "--config.train.num_steps=100000"], timeout=600)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 600
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2) and time.time() < deadline:
        time.sleep(0.2)
    os.kill(child.pid, signal.SIGINT)
    assert child.wait() == 130
    err = child.stderr()
    lines = err.strip().replace("\r", "\n").splitlines()
    assert "Traceback" not in err and "Ctrl-C: stopping after this step, saving it" in err
    stopped = int(lines[-1].removeprefix("interrupted: stopped after step ").split()[0])
    assert stopped >= 2 and lines[-1] == (
        f"interrupted: stopped after step {stopped} of 100000; last checkpoint: step {stopped} in "
        f"{tmp_path / 'run' / 'checkpoints'}; run the same command to resume"
    )
    assert sorted(int(s) for s in os.listdir(tmp_path / "run" / "checkpoints") if s.isdigit()) == [stopped]
    assert json.loads((tmp_path / "run" / "drafter" / "training.json").read_text())["step"] == stopped
    resumed = train_driver.run([*args, f"--config.train.num_steps={stopped + 1}"])
    assert resumed.status == 0, resumed.stderr()[-3000:]
    assert json.loads(resumed.stdout().strip().splitlines()[-1])["resumed_from"] == stopped


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_first_signal_asks_to_stop_after_the_step_and_a_second_stops_at_once(signum, capsys):
    """One process: Ctrl-C and SIGTERM alike are noted, not raised, until a second one; the handlers are put back."""
    before = signal.getsignal(signum)
    stop = StopSignals()
    try:
        assert not stop.requested()
        os.kill(os.getpid(), signum)
        assert stop.requested()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signum)
            time.sleep(5)  # the handler raises in this thread at once
    finally:
        stop.restore()
    assert signal.getsignal(signum) is before
    name = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
    assert f"{name}: stopping after this step, saving it (Ctrl-C again to stop at once)" in capsys.readouterr().err


def test_many_processes_hand_a_ctrl_c_on_as_a_sigterm_and_stop_at_the_preemption_sync_point(monkeypatch, capsys):
    """In a job of many processes, SIGTERM is left to JAX's preemption notifier (which tells every process); a first
    Ctrl-C is handed to it as a SIGTERM to its own process, and whether to stop after a step is the sync point's
    answer, for steps counted from this run's start. (The notifier and the sync point themselves: the two-process
    test in tests/test_train_main.py.)"""
    notified, asked = [], []

    def notifier(signum, frame):  # stands in for the handler jax.distributed.initialize installs
        notified.append(signum)

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(
        multihost_utils, "reached_preemption_sync_point", lambda step: asked.append(step) or bool(notified)
    )
    previous = signal.signal(signal.SIGTERM, notifier)
    try:
        stop = StopSignals()
        try:
            assert signal.getsignal(signal.SIGTERM) is notifier
            assert not stop.requested()
            os.kill(os.getpid(), signal.SIGINT)
            assert notified == [signal.SIGTERM]
            assert stop.requested()
            assert asked == [1, 2]
        finally:
            stop.restore()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert "Ctrl-C: stopping after this step, saving it" in capsys.readouterr().err


def test_eval_and_data_tools_refuse_bad_output_and_arguments_in_one_line(tmp_path, capsys):
    from eval import main as eval_main
    from eval import serving
    from hspec_jax.cli import run
    from train import compare_runs, regenerate, synthesize

    afile = tmp_path / "afile"
    afile.write_text("x")
    other = write_jsonl(tmp_path / "other.jsonl", [json.dumps({"a": 1})])
    regen_out = str(tmp_path / "r.jsonl")
    cases = [
        (eval_main.main, ["--target", "random:tiny", "--out", str(afile)], 1, f"--out {afile} is not a directory"),
        (
            eval_main.main,
            ["--target", "random:tiny", "--out", str(tmp_path / "o"), "--num-prompts", "0"],
            2,
            "--num-prompts",
        ),
        (serving.main, ["--target", "random:tiny", "--out", str(afile)], 1, f"--out {afile} is not a directory"),
        (synthesize.main, ["--target", "tiny", "--out", str(tmp_path), "--num", "2"], 1, "is a directory"),
        (synthesize.main, ["--target", "/nope", "--out", str(tmp_path / "s.jsonl"), "--num", "2"], 1, "/nope"),
        (synthesize.main, ["--target", "tiny", "--out", other, "--num", "2"], 1, "not this tool's instructions"),
        (synthesize.main, ["--out", str(tmp_path / "s.jsonl"), "--num", "2", "--top-p", "2"], 2, "--top-p"),
        (regenerate.main, ["--target", "tiny", "--sources", "sharegpt", "--out", str(tmp_path)], 1, "is a directory"),
        (regenerate.main, ["--target", "/nope", "--sources", "sharegpt", "--out", regen_out], 1, "/nope"),
        (regenerate.main, ["--sources", "x=/nope.jsonl", "--out", regen_out], 1, "--sources: data"),
        (regenerate.main, ["--target", "tiny", "--sources", other, "--out", other], 1, "not a conversation of this"),
        (regenerate.main, ["--sources", "sharegpt", "--out", regen_out, "--batch-size", "0"], 2, "--batch-size"),
        (compare_runs.main, [str(tmp_path / "nope")], 1, "metrics.jsonl does not exist"),
        (compare_runs.main, [str(tmp_path), "--last", "0"], 2, "--last"),
    ]
    for main, argv, code, part in cases:
        try:
            status = run(main, argv)
        except SystemExit as e:
            status = e.code
        lines = capsys.readouterr().err.strip().splitlines()
        assert_one_error(status, lines, code, part)
    assert sorted(os.listdir(tmp_path)) == ["afile", "other.jsonl"]


def test_compare_runs_skips_a_line_cut_by_a_kill_and_names_a_bad_one(tmp_path):
    from train.compare_runs import read_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [1]
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo\n{"step": 3}\n')
    with pytest.raises(InputError, match=r"metrics.jsonl:2: not a JSON record"):
        read_metrics(str(tmp_path))


def test_a_work_directory_from_before_recipe_json_is_checked_against_its_exported_recipe(tmp_path):
    from train.checks import check_resume

    (tmp_path / "drafter").mkdir()
    (tmp_path / "drafter" / "training.json").write_text(
        json.dumps({"step": 3, "recipe": load_config("tiny").to_dict()})
    )
    check_resume(load_config("tiny"), str(tmp_path))
    other = load_config("tiny")
    other.drafter.kind = "dspark"
    with pytest.raises(InputError, match=r"drafter.kind='hspec' \(requested 'dspark'\)"):
        check_resume(other, str(tmp_path))
