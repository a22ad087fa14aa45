"""Drafter checkpoints: safetensors round trip with config and vocabulary (fp32 exact, bf16 storage), shipped
drafters by short name; strict, clear errors."""

import json

import jax
import numpy as np
import pytest

from hspec_jax.checkpoints import CheckpointError
from hspec_jax.checkpoints.drafter_io import (
    read_drafter_config,
    resolve_drafter,
    restore_drafter,
    save_drafter,
    target_lm_head,
    trained_drafters,
)
from hspec_jax.drafters import DRAFTER_KINDS, init_drafter, init_from_target
from hspec_jax.drafters.vocab import build_draft_vocab
from hspec_jax.models import init_params
from hspec_jax.recipes import drafter_from_recipe, load_config, target_config

RECIPE = load_config("configs/tiny.py")
TARGET = target_config(RECIPE)


@pytest.mark.parametrize("kind", DRAFTER_KINDS)
def test_round_trip(kind, tmp_path):
    config = drafter_from_recipe(RECIPE, kind, TARGET)
    params = init_drafter(config, jax.random.key(0))
    vocab = build_draft_vocab(np.arange(200) % 90, TARGET.vocab_size, config.vocab_size)
    save_drafter(str(tmp_path / "d"), params, config, vocab)
    config2, params2, vocab2 = restore_drafter(str(tmp_path / "d"), TARGET)
    assert config2 == config
    jax.tree.map(np.testing.assert_array_equal, params2, params)
    np.testing.assert_array_equal(np.asarray(vocab2.d2t), np.asarray(vocab.d2t))
    restored_alone, _, _ = restore_drafter(str(tmp_path / "d"))  # the stored target config is enough too
    assert restored_alone == config


def test_mismatched_target_and_bad_checkpoints(tmp_path):
    config = drafter_from_recipe(RECIPE, "hspec", TARGET)
    params = init_drafter(config, jax.random.key(0))
    vocab = build_draft_vocab([], TARGET.vocab_size, config.vocab_size)
    save_drafter(str(tmp_path / "d"), params, config, vocab)
    with pytest.raises(ValueError, match="hidden_size: drafter expects 64, target has 128"):
        restore_drafter(str(tmp_path / "d"), TARGET.replace(hidden_size=128))
    manifest = tmp_path / "d" / "hspec_drafter.json"
    data = json.loads(manifest.read_text())
    data["config"]["fields"]["mamba"]["num_heads"] = 8  # the stored params no longer fit the config
    manifest.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"parameter layers_0\.ssm\.A_log has shape \(4,\), expected \(8,\)"):
        restore_drafter(str(tmp_path / "d"))
    with pytest.raises(CheckpointError, match="not an hspec-jax drafter checkpoint"):
        restore_drafter(str(tmp_path))


def test_bf16_storage_and_strict_tensors(tmp_path):
    import ml_dtypes
    import safetensors.numpy

    config = drafter_from_recipe(RECIPE, "hspec", TARGET)
    params = init_drafter(config, jax.random.key(1))
    vocab = build_draft_vocab(np.arange(50), TARGET.vocab_size, config.vocab_size)
    save_drafter(str(tmp_path / "d"), params, config, vocab, dtype=ml_dtypes.bfloat16)
    stored = safetensors.numpy.load_file(str(tmp_path / "d" / "model.safetensors"))
    assert {v.dtype for v in stored.values()} == {np.dtype(ml_dtypes.bfloat16)}
    _, restored, _ = restore_drafter(str(tmp_path / "d"), TARGET)
    for want, got in zip(jax.tree.leaves(params), jax.tree.leaves(restored), strict=True):
        assert got.dtype == want.dtype  # cast back to the config's parameter dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want).astype(ml_dtypes.bfloat16).astype(got.dtype))

    path = str(tmp_path / "d" / "model.safetensors")
    safetensors.numpy.save_file({**stored, "extra.weight": np.zeros(3, np.float32)}, path)
    with pytest.raises(CheckpointError, match=r"unknown parameter extra\.weight"):
        restore_drafter(str(tmp_path / "d"))
    del stored["layers_0.ssm.A_log"]
    safetensors.numpy.save_file(stored, path)
    with pytest.raises(CheckpointError, match=r"is missing parameter layers_0\.ssm\.A_log"):
        restore_drafter(str(tmp_path / "d"))


def test_an_lm_head_equal_to_the_targets_rows_is_not_stored(tmp_path):
    import safetensors.numpy

    target_params = init_params(TARGET, jax.random.key(0))
    config = drafter_from_recipe(RECIPE, "hspec", TARGET)
    vocab = build_draft_vocab(np.arange(50), TARGET.vocab_size, config.vocab_size)
    params = init_from_target(init_drafter(config, jax.random.key(1)), config, target_params, vocab)
    rows = target_lm_head(target_params, config, vocab)
    save_drafter(str(tmp_path / "d"), params, config, vocab, target_rows=rows)
    stored = safetensors.numpy.load_file(str(tmp_path / "d" / "model.safetensors"))
    assert "lm_head" not in stored and len(stored) == len(jax.tree.leaves(params)) - 1
    assert json.loads((tmp_path / "d" / "hspec_drafter.json").read_text())["from_target"] == ["lm_head"]
    with pytest.raises(CheckpointError, match="lm_head is the target's rows \\(not stored\\): load it with"):
        restore_drafter(str(tmp_path / "d"), TARGET)
    _, restored, _ = restore_drafter(str(tmp_path / "d"), TARGET, target_params)
    jax.tree.map(np.testing.assert_array_equal, restored, params)
    # A trained (different) lm_head is kept in the file.
    save_drafter(str(tmp_path / "e"), {**params, "lm_head": params["lm_head"] + 1}, config, vocab, target_rows=rows)
    assert "lm_head" in safetensors.numpy.load_file(str(tmp_path / "e" / "model.safetensors"))
    assert "from_target" not in json.loads((tmp_path / "e" / "hspec_drafter.json").read_text())
    _, restored, _ = restore_drafter(str(tmp_path / "e"), TARGET, target_params)
    np.testing.assert_array_equal(restored["lm_head"], params["lm_head"] + 1)


def test_convert_resaves_a_training_export_as_the_shipped_drafters_are_stored(tmp_path, capsys):
    """`convert --format drafter` from a drafter checkpoint (a training run's fp32 export, its lm_head stored)
    writes it in bfloat16 with the lm_head left to the target and its `training.json` beside it; `--dtype` stays
    refused for a speculators import."""
    import ml_dtypes
    import safetensors.numpy

    from hspec_jax.checkpoints.convert import main as convert_main
    from hspec_jax.checkpoints.hf import export_hf_target
    from hspec_jax.cli import run

    target_params = init_params(TARGET, jax.random.key(0))
    export_hf_target(target_params, TARGET, str(tmp_path / "target"))
    config = drafter_from_recipe(RECIPE, "hspec", TARGET)
    vocab = build_draft_vocab(np.arange(200) % 90, TARGET.vocab_size, config.vocab_size)
    params = init_from_target(init_drafter(config, jax.random.key(1)), config, target_params, vocab)
    save_drafter(str(tmp_path / "run"), params, config, vocab)
    (tmp_path / "run" / "training.json").write_text('{"step": 7}')
    target = ["--target", str(tmp_path / "target")]
    argv = ["--from", str(tmp_path / "run"), "--to", str(tmp_path / "bf16"), "--format", "drafter", *target]
    assert convert_main([*argv, "--dtype", "bfloat16"]) == 0
    assert "wrote hspec drafter in bfloat16" in capsys.readouterr().out
    stored = safetensors.numpy.load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert "lm_head" not in stored and {v.dtype for v in stored.values()} == {np.dtype(ml_dtypes.bfloat16)}
    assert json.loads((tmp_path / "bf16" / "hspec_drafter.json").read_text())["from_target"] == ["lm_head"]
    assert json.loads((tmp_path / "bf16" / "training.json").read_text()) == {"step": 7}
    _, restored, _ = restore_drafter(str(tmp_path / "bf16"), TARGET, target_params)
    rounded = jax.tree.map(lambda p: np.asarray(p).astype(ml_dtypes.bfloat16).astype(np.float32), params)
    jax.tree.map(np.testing.assert_array_equal, restored, {**rounded, "lm_head": params["lm_head"]})
    assert run(convert_main, [*argv[:3], str(tmp_path / "other"), *argv[4:]]) == 0  # without --dtype: as stored
    jax.tree.map(
        np.testing.assert_array_equal, restore_drafter(str(tmp_path / "other"), TARGET, target_params)[1], params
    )
    spec = ["--from", str(tmp_path / "spec"), "--to", str(tmp_path / "x"), "--format", "drafter", *target]
    with pytest.raises(SystemExit) as exit_status:
        convert_main([*spec, "--dtype", "bfloat16"])
    assert exit_status.value.code == 2
    assert "--dtype does not apply to importing from speculators" in capsys.readouterr().err


@pytest.mark.slow
def test_shipped_drafters_load_by_name(smollm2):
    target, target_params = smollm2
    names = trained_drafters()
    assert "smollm2-hspec" in names
    for name in names:
        assert resolve_drafter(name).endswith(f"trained/{name}")
        assert read_drafter_config(name).target.hidden_size == 576  # every shipped drafter drafts for SmolLM2
        config, params, vocab = restore_drafter(name, target, target_params)
        assert np.array_equal(params["lm_head"], target_lm_head(target_params, config, vocab).astype(np.float32))
    assert resolve_drafter("some/dir") == "some/dir"
