"""What `train.main` logs for TensorBoard: scalars grouped as `train/` and `eval/`, in event files that an
independent reader (tensorboardX's protocol buffers and CRC-32C, not the tensorboard package that wrote them) reads
back, checksums included."""

import os
import struct
import types

import pytest
from tensorboardX.proto.event_pb2 import Event
from tensorboardX.record_writer import masked_crc32c

from train.loop import MetricsLog, logged_and_evaluated, scalar_tag


def read_events(path):
    """Every Event of a TFRecord file, each record's two checksums checked."""
    events = []
    with open(path, "rb") as f:
        data = f.read()
    while data:
        header, data = data[:12], data[12:]
        (length,) = struct.unpack("<Q", header[:8])
        assert struct.unpack("<I", header[8:])[0] == masked_crc32c(header[:8])
        body, crc, data = data[:length], data[length : length + 4], data[length + 4 :]
        assert struct.unpack("<I", crc)[0] == masked_crc32c(body)
        events.append(Event.FromString(body))
    return events


def test_tensorboard_groups_training_and_held_out_scalars():
    names = ["loss", "acc_1", "sim_accept_len", "tokens_per_s", "tau", "accept_3", "heldout_acc_1"]
    assert [scalar_tag(n) for n in [*names, "heldout_sim_accept_len"]] == [
        "train/loss",
        "train/acc_1",
        "train/sim_accept_len",
        "train/tokens_per_s",
        "eval/tau",
        "eval/accept_3",
        "eval/heldout_acc_1",
        "eval/heldout_sim_accept_len",
    ]


def test_event_files_read_back_with_each_step_s_scalars(tmp_path):
    log = MetricsLog(str(tmp_path), resume_step=0)
    log.write(0, {"tau": 1.5, "heldout_acc_1": 0.25})
    log.write(300, {"loss": 2.0, "acc_1": 0.125, "tokens_per_s": 1e5})
    log.close()
    (name,) = [n for n in os.listdir(tmp_path) if n.startswith("events.out.tfevents.")]
    first, *steps = read_events(tmp_path / name)
    assert first.file_version == "brain.Event:2" and first.wall_time > 0
    assert [e.step for e in steps] == [0, 300]
    assert [{v.tag: v.simple_value for v in e.summary.value} for e in steps] == [
        {"eval/tau": 1.5, "eval/heldout_acc_1": 0.25},
        {"train/loss": 2.0, "train/acc_1": 0.125, "train/tokens_per_s": pytest.approx(1e5)},
    ]


def test_every_evaluation_step_is_evaluated_and_logged_whatever_log_every_is():
    """`eval_every` = 125 with `log_every` = 10 evaluates at 125, 250, 375 and 500 (an evaluation step not on the
    logging grid used to be skipped: such a run evaluated at 250 and 500 only)."""
    train = types.SimpleNamespace(num_steps=500, log_every=10, eval_every=125)
    outputs = {step: logged_and_evaluated(step, train) for step in range(1, 501)}
    assert [step for step, (_, evaluating) in outputs.items() if evaluating] == [125, 250, 375, 500]
    logged = [step for step, (logging, _) in outputs.items() if logging]
    assert logged == sorted({*range(10, 501, 10), 125, 375})
    train.eval_every = 0
    assert [step for step in range(1, 501) if logged_and_evaluated(step, train)[1]] == []
    assert logged_and_evaluated(7, types.SimpleNamespace(num_steps=7, log_every=10, eval_every=0)) == (True, False)
