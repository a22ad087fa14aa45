"""train.compare_runs: in-sample per-slot means over the last logged steps, held-out agreement, simulated accept
length and real tau by evaluation step, clear errors."""

import json
import os

from hspec_jax.cli import run
from train import compare_runs


def write_run(root, name, records):
    workdir = os.path.join(root, name)
    os.makedirs(workdir)
    with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    return workdir


def logged(step, acc, overlap, **extra):
    record = {"step": step, "loss": 1.0}
    record.update({f"acc_{k + 1}": v for k, v in enumerate(acc)})
    record.update({f"overlap_{k + 1}": v for k, v in enumerate(overlap)})
    return {**record, **extra}


def held_out(acc, sim):
    """What train.main logs at an evaluation step besides the real tau."""
    return {**{f"heldout_acc_{k + 1}": v for k, v in enumerate(acc)}, "heldout_sim_accept_len": sim}


def test_in_sample_means_and_held_out_rates_by_eval_step(tmp_path, capsys):
    a = write_run(
        tmp_path,
        "a",
        [
            logged(10, [0.9, 0.9], [0.9, 0.9]),  # outside --last 2
            logged(20, [0.4, 0.2], [0.5, 0.3], tau=1.25, **held_out([0.3, 0.1], 1.33)),
            logged(30, [0.6, 0.0], [0.7, 0.1], tau=1.5, **held_out([0.35, 0.2], 1.42)),
        ],
    )
    b = write_run(tmp_path, "b", [logged(30, [0.1, 0.1, 0.3], [0.2, 0.2, 0.2], tau=1.5)])  # tau only
    with open(os.path.join(a, "recipe.json"), "w") as f:
        json.dump({"train": {"batch_size": 4}, "data": {"seq_len": 2048}}, f)
    out = tmp_path / "table.md"
    assert compare_runs.main([f"H-Spec={a}", b, "--last", "2", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert out.read_text() == text
    assert "| H-Spec | 30 | acc (in-sample) | 0.500 | 0.100 | - |" in text
    assert "| H-Spec | 30 | overlap (in-sample) | 0.600 | 0.200 | - |" in text
    assert "| b | 30 | acc (in-sample) | 0.100 | 0.100 | 0.300 |" in text
    header = "| run | step | tokens trained on | held-out acc 1 | held-out acc 2 | held-out sim accept len | real tau |"
    assert header in text
    assert "| H-Spec | 20 | 0.16M | 0.300 | 0.100 | 1.330 | 1.250 |" in text  # 20 steps x 4 rows x 2048 tokens
    assert "| H-Spec | 30 | 0.25M | 0.350 | 0.200 | 1.420 | 1.500 |" in text
    assert "| b | 30 | - | - | - | - | 1.500 |" in text  # no recipe.json: tokens unknown
    assert "| H-Spec | 10 |" not in text  # not an evaluation step


def test_learning_curves_png_from_step_0(tmp_path, capsys):
    """--plot draws the evaluation steps, step 0 (the starting drafter, no training metrics) included."""
    start = {"step": 0, "tau": 1.1, **held_out([0.2], 1.2)}
    workdir = write_run(tmp_path, "r", [start, logged(10, [0.5], [0.5], tau=1.3, **held_out([0.3], 1.3))])
    png = tmp_path / "curve.png"
    assert compare_runs.main([workdir, "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "| r | 0 | - | 0.200 | 1.200 | 1.100 |" in text and f"wrote {png}" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_no_evaluation_step_no_held_out_table_and_nothing_to_plot(tmp_path, capsys):
    workdir = write_run(tmp_path, "r", [logged(10, [0.5], [0.5])])
    assert compare_runs.main([workdir]) == 0
    text = capsys.readouterr().out
    assert "| r | 10 | acc (in-sample) | 0.500 |" in text and "held-out" not in text
    assert run(compare_runs.main, [workdir, "--plot", str(tmp_path / "c.png")]) == 1
    assert "--plot: no run has an evaluation step" in capsys.readouterr().err


def test_records_are_taken_in_step_order(tmp_path):
    records = compare_runs.read_metrics(write_run(tmp_path, "r", [logged(20, [0.2], [0.2]), logged(10, [0.1], [0.1])]))
    assert [r["step"] for r in records] == [10, 20]
    assert compare_runs.slot_means(records, "acc", 1) == [0.2]


def test_not_a_work_directory_is_a_clear_error(tmp_path, capsys):
    assert run(compare_runs.main, [str(tmp_path / "nope")]) == 1
    assert "nope/metrics.jsonl does not exist: is" in capsys.readouterr().err


def test_empty_metrics_is_a_clear_error(tmp_path, capsys):
    write_run(tmp_path, "empty", [])
    assert run(compare_runs.main, [str(tmp_path / "empty")]) == 1
    assert "has no records" in capsys.readouterr().err


def test_held_out_families_table(tmp_path, capsys):
    """Where the held-out metrics name families, a third table gives each family's slot-1 agreement and simulated
    accept length at every evaluation step; runs without them show dashes, and the pooled `heldout_acc_1` is not
    taken for a family."""
    family = lambda name, acc, sim: {f"heldout_{name}_acc_1": acc, f"heldout_{name}_sim_accept_len": sim}
    a = write_run(
        tmp_path,
        "a",
        [
            logged(0, [0.1], [0.1], tau=1.1, **held_out([0.2], 1.2), **family("math", 0.3, 1.4)),
            logged(
                9, [0.2], [0.2], tau=1.2, **held_out([0.3], 1.3), **family("math", 0.5, 1.8), **family("qa", 0.4, 1.5)
            ),
        ],
    )
    b = write_run(tmp_path, "b", [logged(9, [0.1], [0.1], tau=1.1, **held_out([0.2], 1.2))])
    assert compare_runs.main([a, b]) == 0
    text = capsys.readouterr().out
    assert "| run | step | math | qa |" in text
    assert "| a | 0 | 0.300 / 1.400 | - / - |" in text
    assert "| a | 9 | 0.500 / 1.800 | 0.400 / 1.500 |" in text
    assert "| b | 9 | - / - | - / - |" in text
    assert compare_runs.families([{"heldout_acc_1": 0.2, "heldout_sim_accept_len": 1.2}]) == []
