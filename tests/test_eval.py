"""The evaluation suite: prompt sets, chat formatting, paired bootstrap, report writer, and eval.main end to end."""

import argparse
import gc
import itertools
import json
import os
import re

import jax
import numpy as np
import pytest
from tqdm import tqdm

from eval import main as eval_main
from eval import report as eval_report
from eval.bootstrap import paired_bootstrap, ratio_gains
from eval.report import PLOTS, speedup_interval, write_report
from hspec_jax.chat import ChatEncoder, conversation
from hspec_jax.decoding import costs as cost_model
from hspec_jax.prompts import COUNTS, TASKS, load_prompts, parse_tasks, spread
from hspec_jax.target_spec import load_target_spec


def test_all_eight_tasks_load_with_the_documented_counts():
    prompts = load_prompts()
    assert [p.task for p in prompts] == [t for t in TASKS for _ in range(COUNTS[t])]
    assert len({p.id for p in prompts}) == len(prompts) == 1644
    assert all(len(p.turns) == (2 if p.task == "dialogue" else 1) for p in prompts)
    assert all((p.tools is not None) == (p.task == "tool_use") for p in prompts)
    assert all(t.strip() for p in prompts for t in p.turns)
    assert prompts[0].id == "spec_bench/" + prompts[0].id.split("/")[1] and prompts[0].task == "math"
    code = [p for p in prompts if p.task == "code"]
    assert code[0].id == "HumanEval/0" and "def has_close_elements" in code[0].turns[0]
    tools = [p for p in prompts if p.task == "tool_use"]
    assert tools[0].id == "simple_python_0" and json.loads(tools[0].tools)[0]["name"] == "calculate_triangle_area"


def test_subsets_are_spread_over_each_set_and_stable():
    two = load_prompts("dialogue,code", 2)
    assert [p.id for p in two] == ["spec_bench/81", "spec_bench/121", "HumanEval/0", "HumanEval/82"]
    assert load_prompts(["code", "dialogue"], 2) == two  # TASKS order whatever the order asked
    assert spread(10, 3) == [0, 3, 6] and spread(3, 5) == [0, 1, 2]
    assert len(load_prompts("all", 3)) == 24
    with pytest.raises(ValueError, match="unknown task"):
        parse_tasks("math,poetry")


def test_turns_and_tools_become_chat_messages(smollm2_tokenizer):
    dialogue = load_prompts("dialogue", 1)[0]
    messages, tools = conversation(dialogue, ["first answer"], native_tools=False)
    assert [m["role"] for m in messages] == ["user", "assistant", "user"] and tools is None
    assert messages[1]["content"] == "first answer" and messages[2]["content"] == dialogue.turns[1]
    with pytest.raises(ValueError, match="2 turns"):
        conversation(dialogue, ["a", "b"], native_tools=False)
    tool = load_prompts("tool_use", 1)[0]
    messages, tools = conversation(tool, [], native_tools=True)
    assert tools[0]["function"]["name"] == "calculate_triangle_area" and len(messages) == 1
    # SmolLM2-135M's template has no tools= argument: the definitions go into the system message.
    encoder = ChatEncoder(smollm2_tokenizer)
    assert not encoder.native_tools
    text = smollm2_tokenizer.decode(encoder.encode(tool, []))
    assert text.startswith("<|im_start|>system\n") and "<tools>" in text and "calculate_triangle_area" in text
    assert "You are a helpful AI assistant named SmolLM" not in text
    folded = ChatEncoder(smollm2_tokenizer, vocab_size=96).encode(tool, [])
    assert folded == [i % 96 for i in encoder.encode(tool, [])]


def brute_force_gains(num_a, den_a, num_b, den_b):
    """Every one of the n^n equally likely resamples, one Python loop each."""
    n = len(num_a)
    gains = []
    for index in itertools.product(range(n), repeat=n):
        a = sum(num_a[i] for i in index) / sum(den_a[i] for i in index)
        b = sum(num_b[i] for i in index) / sum(den_b[i] for i in index)
        gains.append(a / b - 1.0)
    return np.array(gains)


def test_paired_bootstrap_matches_brute_force():
    rng = np.random.default_rng(0)
    num_a, den_a = rng.integers(20, 60, 5).astype(float), rng.integers(8, 20, 5).astype(float)
    num_b, den_b = num_a * rng.uniform(0.7, 1.0, 5), den_a.copy()
    exact = brute_force_gains(num_a, den_a, num_b, den_b)
    all_index = np.array(list(itertools.product(range(5), repeat=5)))
    np.testing.assert_allclose(ratio_gains(num_a, den_a, num_b, den_b, all_index), exact, rtol=1e-12)
    gain = paired_bootstrap(num_a, den_a, num_b, den_b, resamples=40000, seed=1)
    assert gain.point == pytest.approx(num_a.sum() / num_b.sum() - 1.0)
    low, high = np.quantile(exact, [0.025, 0.975])
    assert gain.low == pytest.approx(low, abs=0.01) and gain.high == pytest.approx(high, abs=0.01)
    assert gain.low < gain.point < gain.high
    # Pairing: B = A on every unit times a constant -> the gain is that constant, with no spread at all.
    same = paired_bootstrap(num_a, den_a, num_a / 1.25, den_a, resamples=1000)
    assert same.point == pytest.approx(0.25) and same.low == pytest.approx(0.25) and same.high == pytest.approx(0.25)


def row(method, task, unit, call, tokens, seconds, prefill, call_steps, steps=None, accepted=0, at=None, same=None):
    r = {
        "task": task,
        "prompt_id": f"{task}/{unit}",
        "turn": 1,
        "method": method,
        "unit": unit,
        "call": call,
        "batch_size": 1,
        "prompt_tokens": 10,
        "tokens": tokens,
        "call_seconds": seconds,
        "call_prefill_seconds": prefill,
        "call_steps": call_steps,
    }
    if steps is not None:
        r.update(steps=steps, accepted=accepted, reached_at=at[0], accepted_at=at[1], identical=same)
    return r


def test_report_writer(tmp_path):
    rows = []
    for unit, task in enumerate(["math", "math", "code"]):
        rows.append(row("plain", task, unit, 3 * unit, 33, 1.1, 0.1, 32))  # 32 forwards in 1.0 s
        # A: 8 steps of 4 tokens (tau 4) in 0.5 s; B: 16 steps of 2 tokens (tau 2) in 0.8 s.
        at_a = ([8, 8, 8], [8, 8, 0])  # drafts 1 and 2 always accepted, 3 never
        rows.append(row("A", task, unit, 3 * unit + 1, 33, 0.6, 0.1, 8, 8, 24, at_a, True))
        rows.append(row("B", task, unit, 3 * unit + 2, 33, 0.9, 0.1, 16, 16, 16, ([16, 16, 0], [16, 0, 0]), True))
    meta = {
        "command": "python -m eval.main --test",
        "target": "a target",
        "machine": {"cpu": "a CPU", "cores": 2, "backend": "cpu", "devices": "cpu", "jax": "0", "dtype": "float32"},
        "settings": {"temperature": 0.0, "batch size": 1},
        "methods": [
            {"name": "plain", "kind": "plain", "k": 0, "kv_bytes_per_token": 0, "kv_bytes_peak": 0},
            {"name": "A", "kind": "hspec", "k": 3, "kv_bytes_per_token": 0, "kv_bytes_peak": 0},
            {"name": "B", "kind": "dspark", "k": 3, "kv_bytes_per_token": 1280, "kv_bytes_peak": 327680},
        ],
        "bootstrap_resamples": 200,
        "seed": 0,
    }
    paths = write_report(str(tmp_path), rows, meta)
    assert sorted(os.path.basename(p) for p in paths) == sorted(["report.md", *PLOTS])
    for name in PLOTS:
        with open(tmp_path / name, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    text = (tmp_path / "report.md").read_text()
    # A: tau 4, decode speedup (32 tokens / 0.5 s) / (32 / 1.0 s) = 2, predicted 4 * (1/32) / (0.5/8) = 2.
    assert "| A | 3 | 4.00 | 55.0 | 2.00x | 2.00x | 1.83x | 62.50 | 0 | 0 | 3/3 |" in text
    assert "| B | 3 | 2.00 | 36.7 | 1.25x | 1.25x | 1.22x | 50.00 | 1,280 | 327,680 | 3/3 |" in text
    assert "| A | all | 1.00 | 1.00 | 0.00 |" in text and "| B | all | 1.00 | 0.00 | n/a |" in text
    assert (
        "| math | 2 | 30.0 | 4.00 / 1.00 / 2.00x [2.00, 2.00] / 2.00x | 2.00 / 1.00 / 1.25x [1.25, 1.25] / 1.25x |"
        in text
    )
    assert "| all | A vs B | 3 | +100.0% [+100.0, +100.0] | +60.0% [+60.0, +60.0] |" in text
    assert "Machine: a CPU, 2 cores" in text and "Command: `python -m eval.main --test`" in text


def test_a_task_speedup_comes_with_its_interval_over_the_prompts():
    """Plain decoding takes 1 s per prompt; A takes 0.5 s on two prompts and 2 s on the third: pooled, A decodes 96
    tokens in 3 s against 3 s (1.00x), and resampling the prompts gives from 0.5x (the slow one thrice) to 2x."""
    rows = []
    for unit, seconds in enumerate([0.6, 0.6, 2.1]):
        rows.append(row("plain", "math", unit, 2 * unit, 33, 1.1, 0.1, 32))
        rows.append(row("A", "math", unit, 2 * unit + 1, 33, seconds, 0.1, 8, 8, 24, ([8, 8, 8], [8, 8, 0]), True))
    assert speedup_interval(rows, "A", {"bootstrap_resamples": 2000, "seed": 0}) == "1.00x [0.50, 2.00]"


def test_eval_main_end_to_end_on_the_tiny_random_target(tmp_path):
    """All eight tasks, one prompt each, plain decoding and two random drafters, greedy: every output lossless, the
    dialogue prompt's second turn longer than its first, the report and its plots written (and rewritten the same
    by eval.report). Fixed shapes (--prompt-width/--cache-length) keep it to one compiled program per method."""
    out = tmp_path / "eval"
    argv = ["--target", "random:tiny", "--drafter", "random:hspec", "--drafter", "random:dspark"]
    argv += ["--num-prompts", "1", "--max-new-tokens", "4", "--prompt-width", "1024", "--cache-length", "1040"]
    argv += ["--bootstrap-resamples", "100", "--compile-cache", "", "--out", str(out)]
    assert eval_main.main(argv) == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == (8 + 1) * 3  # the dialogue prompt has a second turn
    assert {r["method"] for r in rows} == {"plain", "random:hspec", "random:dspark"}
    assert {r["task"] for r in rows} == set(TASKS)
    spec = [r for r in rows if r["method"] != "plain"]
    assert all(r["identical"] for r in spec) and all(1 <= r["tokens"] <= 4 for r in rows)
    assert all(len(r["reached_at"]) == 7 and r["steps"] >= 1 for r in spec)
    second = [r for r in rows if r["turn"] == 2]
    first = {(r["prompt_id"], r["method"]): r for r in rows if r["turn"] == 1}
    assert len(second) == 3 and all(
        r["prompt_tokens"] > first[(r["prompt_id"], r["method"])]["prompt_tokens"] for r in second
    )
    text = (out / "report.md").read_text()
    assert "| random:dspark | 7 |" in text and "random:hspec vs random:dspark" in text
    assert all((out / name).stat().st_size > 0 for name in PLOTS)
    (out / "report.md").unlink()
    assert eval_report.main([str(out)]) == 0 and (out / "report.md").read_text() == text


def test_eval_main_runs_each_drafter_at_each_k(tmp_path, monkeypatch):
    """`--k auto,2`: one method per drafter and draft length, named `SPEC k=K`, each lossless; fixed K verifies K
    drafts every step, auto reports its draft lengths per task and the confidence head's calibration. (The
    drafter's own k, 7, is the end-to-end test's.) `--repeats 3`: every call timed three times, the median prefill
    and the median decode time (each run's own) reported."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # auto's step costs, measured once
    # One round per cost reading: what is checked here is that auto runs and reports, not how well its table agrees
    # with a long measurement (tests/test_adaptive.py, benchmarks/results/cost_tables.md).
    monkeypatch.setattr(cost_model, "ROUNDS", 1)
    out = tmp_path / "eval"
    argv = ["--target", "random:tiny", "--drafter", "random:hspec", "--k", "auto,2", "--tasks", "math"]
    argv += ["--num-prompts", "1", "--max-new-tokens", "4", "--prompt-width", "1024", "--cache-length", "1040"]
    argv += ["--bootstrap-resamples", "10", "--repeats", "3", "--compile-cache", "", "--out", str(out)]
    assert eval_main.main(argv) == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert {r["method"] for r in rows} == {"plain", "random:hspec k=auto", "random:hspec k=2"}
    for r in rows:
        wall, prefill = np.array(r["call_seconds_runs"]), np.array(r["call_prefill_seconds_runs"])
        assert len(wall) == len(prefill) == 3 and r["call_prefill_seconds"] == pytest.approx(
            np.median(prefill), abs=1e-5
        )
        assert r["call_seconds"] - r["call_prefill_seconds"] == pytest.approx(np.median(wall - prefill), abs=1e-5)
        if r["method"] == "random:hspec k=auto":
            # On CPU `auto` cuts the drafter's 7 drafts to 3 (AdaptivePolicy.auto_drafting): k_steps for 0..3.
            assert r["identical"] and len(r["k_steps"]) == 4 and sum(r["k_steps"]) == r["steps"]
            assert sum(r["k_steps"][1:]) <= r["drafted"] <= r["steps"]
        elif r["method"] != "plain":
            k = int(r["method"][-1])
            assert r["identical"] and len(r["reached_at"]) == k and r["k_steps"][k] == r["steps"]
            assert r["drafted"] == r["steps"]  # a fixed k drafts every block it verifies
    text = (out / "report.md").read_text()
    assert "| random:hspec k=2 | 2 |" in text and "| random:hspec k=auto | auto |" in text
    assert "## Draft length chosen per step" in text and "| random:hspec k=auto | math |" in text
    auto = next(r for r in rows if r["method"] == "random:hspec k=auto")
    declined = auto["drafted"] - sum(auto["k_steps"][1:])
    assert re.search(rf"\| random:hspec k=auto \| all \|.* \| {auto['drafted']} \| {declined} \|$", text, re.M)
    assert "## Confidence head calibration" in text and (out / "calibration.png").stat().st_size > 0


def test_compiled_programs_share_one_copy_of_the_weights():
    """Every (method, shape) compiled by eval.main runs on the weights placed once: compiling more programs adds
    no copy of them (on CPU each placement fuses q/k/v into new arrays; a copy per program took eval.main's k
    sweep on SmolLM2 past 22 GB)."""
    target = load_target_spec("random:tiny", None, 0)
    prompt_ids = [[5, 6, 7, 8]]
    methods = eval_main.load_methods(target, ["random:hspec"], prompt_ids, ks=(2,))
    args = argparse.Namespace(max_new_tokens=4, temperature=0.0, seed=0)
    evaluation = eval_main.Evaluation(target, methods, args, None)
    c = target.config
    columns = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    fused = {(c.hidden_size, columns), (columns // 16, c.hidden_size, 16)}  # as is, or packed for the CPU kernel

    def fused_copies():  # in layers: a stacked array counts each of its layers
        gc.collect()
        return sum(a.shape[0] if a.shape[1:] in fused else a.shape in fused for a in jax.live_arrays())

    before = fused_copies()
    assert before >= c.num_layers  # the placed target's own fused projections
    for width, capacity in ((8, 16), (16, 32)):
        tokens, lengths = np.full((1, width), 5, np.int32), np.array([4], np.int32)
        for method in methods:
            evaluation.runner(method, tokens, lengths, capacity, tqdm(disable=True))
    assert len(evaluation.runners) == 4 and fused_copies() <= before


def test_a_greedy_mismatch_names_the_prompt():
    prompt = load_prompts("code", 1)[0]
    method = eval_main.Method("random:hspec", None, 8)
    same = eval_main.same_output(np.array([5, 6, 7]), np.array([5, 6, 7]), True, method, prompt, 0)
    assert same and not eval_main.same_output(np.array([5, 6]), np.array([5, 7]), False, method, prompt, 0)
    with pytest.raises(eval_main.LosslessError, match=r"random:hspec .* HumanEval/0 \(code\), turn 2, from token 2"):
        eval_main.same_output(np.array([5, 6, 7]), np.array([5, 6]), True, method, prompt, 1)


def test_eval_main_rejects_bad_arguments(tmp_path, capsys):
    """Each bad argument exits with its own message (the drafter on a random target and one task: the check
    needs neither SmolLM2's weights nor all 1644 prompts encoded)."""
    argv = ["--target", "random:tiny", "--tasks", "math", "--num-prompts", "1", "--drafter", "random:nope"]
    assert eval_main.main([*argv, "--out", str(tmp_path)]) == 1
    assert "unknown drafter kind" in capsys.readouterr().err
    assert eval_main.main(["--tasks", "poetry", "--out", str(tmp_path)]) == 1
    assert "unknown task" in capsys.readouterr().err
    assert eval_main.main(["--k", "3", "--out", str(tmp_path)]) == 1
    assert "--k sets the drafted tokens per step: it needs --drafter" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        eval_main.main(["--drafter", "random:hspec", "--k", "3,3", "--out", str(tmp_path)])
    assert "--k takes distinct integers in 1..15, got '3,3'" in capsys.readouterr().err
