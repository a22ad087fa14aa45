"""The benchmarks' own step functions still run with today's drafter API (they are not run by the suite otherwise)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import (
    decode_attention,
    drafter_ablation,
    drafter_recipes,
    matmul_rows,
    ngram_baseline,
    plain_steps,
    sampling_filters,
    vocab_coverage,
)
from benchmarks.spec_overhead import KINDS, isolated_step_times
from hspec_jax.drafters import init_drafter, init_from_target
from hspec_jax.drafters.vocab import build_draft_vocab
from hspec_jax.kernels import cpu_matmul
from hspec_jax.models import init_params
from hspec_jax.recipes import drafter_from_recipe, load_config, target_config
from train.losses import recipe_weights
from train.step import StepConfig


def test_spec_overhead_isolated_steps_run_for_every_kind_on_tiny():
    recipe = load_config("tiny")
    target = target_config(recipe)
    target_params = init_params(target, jax.random.key(0))
    drafters = {}
    for kind in KINDS:
        config = drafter_from_recipe(recipe, kind, target)
        vocab = build_draft_vocab(np.arange(90), target.vocab_size, config.vocab_size)
        params = init_from_target(init_drafter(config, jax.random.key(0)), config, target_params, vocab)
        drafters[kind] = (config, params, vocab)
    times = isolated_step_times(target, target_params, drafters, context=16, repeats=2)
    assert set(times) == {"T_T(1)", "T_T(8)", *(f"T_D(7) {kind}" for kind in KINDS)}
    assert all(t > 0 for t in times.values())


def test_matmul_rows_reports_every_back_end(tmp_path):
    out = tmp_path / "matmul_rows.md"
    matmul_rows.main(["--chain", "2", "--repeats", "2", "--out", str(out)])
    table = [line for line in out.read_text().splitlines() if line.startswith("| ") and "µs" not in line]
    packed = ["| packed kernel fp32"] if cpu_matmul.available() else []
    assert [row.split(" | ")[0] for row in table] == ["| XLA fp32", "| XLA bf16", "| PyTorch fp32", *packed]
    assert all(float(cell) > 0 for row in table for cell in row.strip(" |").split(" | ")[1:])


def test_sampling_filters_times_each_filter_at_1_and_8_rows(tmp_path):
    out = tmp_path / "sampling_filters.md"
    sampling_filters.main(["--vocab", "1000", "--top-k", "5", "--repeats", "2", "--out", str(out)])
    table = [line for line in out.read_text().splitlines() if line.startswith("| ") and " ms |" not in line]
    assert [row.split(" | ")[0] for row in table] == [
        "| top-5 threshold, XLA TopK",
        "| top-5 threshold, `kth_largest`",
        "| distribution, temperature 1",
        "| distribution, temperature 1 + top-5",
        "| top-p 0.9 cutoff, sorting the vocabulary",
        "| top-p 0.9 cutoff, `top_p_cutoff`",
        "| distribution, temperature 1 + top-p 0.9",
    ]
    assert all(float(cell) > 0 for row in table for cell in row.strip(" |").split(" | ")[1:])


def test_drafter_recipes_times_each_recipe_at_each_k(tmp_path):
    out = tmp_path / "drafter_recipes.md"
    drafter_recipes.main(["--recipes", "tiny", "--k", "2,3", "--contexts", "16", "--repeats", "2", "--out", str(out)])
    row = next(line for line in out.read_text().splitlines() if line.startswith("| tiny |"))
    cells = row.strip(" |").split(" | ")
    assert cells[1] == f"{drafter_recipes.parameter_count(load_config('tiny')) / 1e6:.1f} M"
    assert len(cells) == 4 and all(float(c) > 0 for c in cells[2:])


def test_with_drafts_sets_the_block_for_k():
    recipe = load_config("tiny")
    assert drafter_from_recipe(drafter_recipes.with_drafts(recipe, 3)).num_drafts == 3
    assert drafter_from_recipe(recipe).num_drafts == 7  # the recipe itself is left alone


def test_decode_attention_compares_every_shape_and_the_two_agree(tmp_path, monkeypatch):
    monkeypatch.setattr(decode_attention, "SHAPES", [(2, 300, 1, 200), (1, 300, 8, 290)])
    out = tmp_path / "decode_attention.md"
    decode_attention.main(["--repeats", "2", "--out", str(out)])
    rows = [line.strip(" |").split(" | ") for line in out.read_text().splitlines() if line.startswith("| ")][1:]
    assert [r[:4] for r in rows] == [["2", "300", "1", "200"], ["1", "300", "8", "290"]]
    assert all(float(r[4]) > 0 and float(r[5]) > 0 and float(r[7]) < 1e-5 for r in rows)


def test_vocab_coverage_counts_tokens_inside_the_vocabulary_per_task_and_overall():
    t2d = np.zeros(10, bool)
    t2d[[1, 2, 3]] = True
    answers = {"math": [[1, 2], [5]], "code": [[3, 3, 7, 9]]}
    assert vocab_coverage.coverage(answers, t2d) == {"math": 2 / 3, "code": 0.5, "all": 4 / 7}


def test_ngram_baseline_counts_supervised_transitions_and_backs_off():
    """Training: after (1, 5) comes 7, after (2, 5) comes 8 (twice, so the bigram of 5 says 8), 9 is the most
    frequent token. Held out: the trigram gets both contexts right, the bigram one, an unseen anchor falls back."""
    train = [[(1, 5, 7), (2, 5, 8), (3, 5, 8), (4, 6, 9), (4, 6, 9), (4, 6, 9)]]
    held_out = [[(1, 5, 7), (2, 5, 8), (0, 42, 9)]]
    result = ngram_baseline.score(ngram_baseline.fit(train), held_out)
    assert result == {"positions": 3, "unigram": 1 / 3, "bigram": 2 / 3, "trigram": 1.0}


def test_drafter_ablation_without_the_seed_state_is_the_drafter_with_a_zero_seed():
    """`no seed state` scores exactly the drafter whose seed projections output zeros (S0 = 0), and differs from the
    drafter as trained; `no target KV` changes the scores too."""
    recipe = load_config("tiny")
    target = target_config(recipe)
    target_params = init_params(target, jax.random.key(0))
    drafter = drafter_from_recipe(recipe, "hspec", target)
    vocab = build_draft_vocab(np.arange(target.vocab_size), target.vocab_size, drafter.vocab_size)
    params = init_from_target(init_drafter(drafter, jax.random.key(1)), drafter, target_params, vocab)
    tokens = np.asarray(jax.random.randint(jax.random.key(2), (1, 48), 4, target.vocab_size), np.int32)
    batch = {
        "tokens": tokens,
        "positions": np.arange(48, dtype=np.int32)[None],
        "doc_ids": np.zeros((1, 48), np.int32),
        "loss_mask": np.arange(48)[None] >= 8,
        "anchors": np.arange(8, 40, 2, dtype=np.int32)[None],
        "anchor_valid": np.ones((1, 16), bool),
    }
    weights = recipe_weights("hspec")

    def score(p, **fields):
        config = StepConfig(target, drafter.replace(**fields), weights, anchors_per_chunk=8)
        return drafter_ablation.held_out_agreement(config, p, target_params, vocab, [batch])

    zero_seed = {
        name: jax.tree.map(jnp.zeros_like, value) if name.startswith("seed_projs") else value
        for name, value in params.items()
    }
    no_seed = score(params, **drafter_ablation.VARIANTS["no seed state"])
    assert no_seed.keys() == score(zero_seed).keys()
    for name, value in score(zero_seed).items():
        np.testing.assert_allclose(value, no_seed[name], rtol=1e-5, atol=1e-6, err_msg=name)
    as_trained = score(params)
    assert as_trained["ce"] != no_seed["ce"]
    assert as_trained["ce"] != score(params, **drafter_ablation.VARIANTS["no target KV"])["ce"]


def test_plain_steps_times_auto_pinned_to_plain_steps_in_a_fresh_process(tmp_path, monkeypatch):
    """A fresh process decodes the same tokens with plain decoding, with `auto` held to plain steps (the drafter
    never runs) and with `auto` on its own cost table, learning across generations or from its first prior each
    time; the report gives its row, the drafter's blocks, and the spread of each ratio."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the fresh process measures its own table
    out = tmp_path / "plain_steps.md"
    argv = ["--target", "random:tiny", "--processes", "1", "--capacity", "128", "--rounds", "2", "--out", str(out)]
    plain_steps.main(argv)
    text = out.read_text()
    rows = [line.strip("| ").split(" | ") for line in text.splitlines() if line.startswith("| 128 | 40 |")]
    assert [row[2] for row in rows] == ["1"]
    plain, pinned, share, own, drafted, verified = (rows[0][i] for i in (3, 4, 6, 7, 10, 11))
    assert share == "1.00" and rows[0][15] == "True"
    first_drafted, first_verified = (int(x) for x in rows[0][14].split(" / "))
    assert 0 <= first_verified <= first_drafted <= 64 and float(rows[0][13]) > 0
    assert float(plain) > 0 and float(pinned) > 0 and float(own) > 0
    assert 0 <= int(verified) <= int(drafted) <= 64
    summary = text.split("| ratio | mean |")[1]
    assert all(f"| 128 | {name} |" in summary for name in ("pinned / plain", "own / plain", "first / plain"))


def test_whole_runs_alternates_plain_and_drafter_processes_on_a_tasks_prompts(tmp_path, monkeypatch):
    """`--task` runs the first turns of the task's evaluation prompts, as `eval.main` picks them; each round starts
    a plain and a drafter process, alternating which goes first, and the ratio is the drafter's rate over the plain
    rate of the same round (here 30 / 20 tok/s for every prompt)."""
    from benchmarks import whole_runs
    from hspec_jax.prompts import load_prompts

    commands = []

    def fake_run(command):
        commands.append(command)
        drafted = "--drafter" in command
        lines = [f"decode: 64 tokens in 1 s ({30.0 if drafted else 20.0} tok/s)"]
        lines += ["spec: tau=1.50 steps=10 chosen k=0:0.5,3:0.5 step costs T(k)/T(0) k=0:1.00,3:1.50"] * drafted
        return "\n".join(lines) + "\n", 1.0

    monkeypatch.setattr(whole_runs, "run", fake_run)
    out = tmp_path / "runs.md"
    argv = ["--task", "summarization", "--num-prompts", "2", "--rounds", "2", "--demo-runs", "0", "--out", str(out)]
    assert whole_runs.main(argv) == 0
    texts = [p.turns[0] for p in load_prompts("summarization", 2)]
    prompts = [c[c.index("--prompt") + 1] for c in commands]
    assert prompts == [texts[0]] * 4 + [texts[1]] * 4
    assert [("--drafter" in c) for c in commands] == [False, True, True, False, True, False, False, True]
    report = out.read_text()
    assert (
        report.count("| **1.500x** |") == 2
        and "Median over prompts: **1.500x**" in report
        and "--task summarization --num-prompts 2" in report
    )
    with pytest.raises(SystemExit):
        whole_runs.main(["--task", "math", "--prompt", "x"])
