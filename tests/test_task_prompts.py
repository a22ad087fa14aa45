"""train.task_prompts: prompts for every evaluation family, held-out sets disjoint from training, no evaluation
prompt, deterministic."""

import json

import pytest

from hspec_jax.prompts import TASKS, load_prompts
from train import task_prompts
from train.chat import normalize_text, user_texts

MODULE = '''
def mean_of(values, weights=None):
    """The weighted mean of `values`: each value times its weight, summed, over the sum of the weights."""
    weights = weights or [1] * len(values)
    total = sum(v * w for v, w in zip(values, weights))
    return total / sum(weights)


def clamp(value, low, high):
    """`value` limited to the closed interval from `low` to `high` (low when below it, high when above it)."""
    if value < low:
        return low
    return min(value, high)


def _private(x):
    """Never offered: a private name, however well documented it is."""
    return x
'''


def sharegpt_like():
    english = (
        "The committee met on Tuesday to discuss the new budget for the library. They agreed to buy more books "
        "for children and to open on Sundays. What is the best way to plan a small garden in a cold climate? "
    )
    german = "Die Stadt hat einen neuen Park eröffnet, und die Kinder spielen dort jeden Tag mit ihren Freunden."
    records = []
    for i in range(40):
        passage = " ".join([english] * 8) + f" Item {i}."
        records.append(
            {
                "id": f"c{i}",
                "conversations": [
                    {"from": "human", "value": f"How do I write a letter of thanks to my neighbour number {i}?"},
                    {"from": "gpt", "value": passage},
                    {"from": "human", "value": f"{german} Satz {i} ist für die Übersetzung da."},
                ],
            }
        )
    return records


@pytest.fixture
def pools(monkeypatch, tmp_path):
    (tmp_path / "stats.py").write_text(MODULE)
    monkeypatch.setattr(task_prompts, "sharegpt_records", sharegpt_like)
    return task_prompts.Pools({"c0"}, code_root=str(tmp_path))


def test_every_family_gets_prompts_none_held_out_shared_and_none_an_evaluation_prompt(pools):
    evaluation = {normalize_text(t) for p in load_prompts("all") for t in p.turns}
    for family in TASKS:
        training, held_out = task_prompts.build(family, pools, 12, seed=0, held_out=4)
        assert len(held_out) == 4 and len(training) >= 4, family
        held = {normalize_text(t) for r in held_out for t in user_texts(r["messages"])}
        for record in training:
            turns = {normalize_text(t) for t in user_texts(record["messages"])}
            assert not turns & held and not turns & evaluation, (family, record)
        assert all(r["id"].startswith(f"task-{family}-0-") for r in training + held_out)
    assert pools.functions and all("_private" not in full for _, full, _ in pools.functions)
    assert not any("neighbour number 0?" in q for q in pools.questions)  # an excluded conversation is not used


def test_no_training_prompt_of_any_family_holds_a_held_out_turn_of_another(pools):
    def turns(records):
        return {normalize_text(t) for r in records for t in user_texts(r["messages"])}

    def leaks(reserved):
        built = {f: task_prompts.build(f, pools, 40, seed=0, held_out=4, reserved=reserved) for f in TASKS}
        held = turns(r for _, held_out in built.values() for r in held_out)
        return held, sum(bool(turns([r]) & held) for training, _ in built.values() for r in training)

    held, unreserved = leaks(frozenset())
    assert unreserved > 0  # qa's held-out questions are first turns that dialogue prompts draw
    reserved = task_prompts.held_out_turns(pools, seed=0, held_out=4)
    assert reserved == held and leaks(reserved) == (held, 0)


def test_main_writes_every_familys_files_and_a_subset_run_keeps_the_held_out_sets(pools, monkeypatch, tmp_path):
    """`python -m train.task_prompts`: the files of a run over two families equal theirs in a run over all eight,
    and no training file shares a user turn with any held-out file of the full run."""
    monkeypatch.setattr(task_prompts, "stdlib_functions", lambda **kw: pools.functions)

    def written(out, families):
        args = ["--out-dir", str(out), "--per-family", "30", "--held-out", "4", "--exclude", "--families", families]
        assert task_prompts.main(args) == 0
        return {p.name: [json.loads(line) for line in p.read_text().splitlines()] for p in out.iterdir()}

    every = written(tmp_path / "all", ",".join(TASKS))
    subset = written(tmp_path / "two", "dialogue,qa")
    assert len(every) == 2 * len(TASKS) and subset == {n: every[n] for n in subset} and len(subset) == 4
    held = {
        normalize_text(t)
        for n, rs in every.items()
        if n.endswith("_heldout.jsonl")
        for r in rs
        for t in user_texts(r["messages"])
    }
    for name, records in every.items():
        if not name.endswith("_heldout.jsonl"):
            assert records and not any({normalize_text(t) for t in user_texts(r["messages"])} & held for r in records)


def test_prompts_have_their_family_shape(pools):
    def first(family):
        return task_prompts.build(family, pools, 3, seed=1, held_out=1)[0][0]["messages"]

    assert first("translation")[0]["content"].startswith("Translate ")
    assert len(first("dialogue")) == 2
    tools = first("tool_use")
    assert tools[0]["role"] == "system" and "<tools>" in tools[0]["content"]
    json.loads(tools[0]["content"].split("<tools>")[1].split("</tools>")[0])  # the schemas are JSON
    assert "```python\ndef mean_of(values, weights=None):" in first("code")[0]["content"]


def test_the_same_arguments_give_the_same_prompts(pools):
    assert task_prompts.build("math", pools, 20, seed=3, held_out=5) == task_prompts.build("math", pools, 20, 3, 5)
    assert task_prompts.build("math", pools, 20, seed=3, held_out=5) != task_prompts.build("math", pools, 20, 4, 5)
