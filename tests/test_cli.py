"""Command-line tools: eval.generate and hspec_jax.checkpoints.convert, end to end on the embedded model."""

import re
import subprocess
import sys

import pytest

from eval import generate
from hspec_jax import cli
from hspec_jax.checkpoints import convert

DECODE_LINE = re.compile(r"^decode: (\d+) tokens in ([0-9.]+) s \(([0-9.]+) tok/s\)$", re.M)
PREFILL_LINE = re.compile(r"^prefill: (\d+) tokens in ([0-9.]+) s \(([0-9.]+) tok/s\)$", re.M)


def run_generate(capsys, *args):
    assert cli.run(generate.main, ["--max-new-tokens", "16", "--prompt", "What is the capital of France?", *args]) == 0
    out = capsys.readouterr().out
    match = DECODE_LINE.search(out)
    assert match and PREFILL_LINE.search(out), out
    return out[: PREFILL_LINE.search(out).start()].strip(), int(match.group(1))


@pytest.mark.slow
def test_generate_and_convert_round_trip(capsys, tmp_path):
    text, n = run_generate(capsys, "--target", "smollm2")
    assert "Paris" in text and 0 < n <= 16
    for fmt in ("orbax", "hf"):
        out_dir = str(tmp_path / fmt)
        assert cli.run(convert.main, ["--from", "smollm2", "--to", out_dir, "--format", fmt]) == 0
        capsys.readouterr()
        assert run_generate(capsys, "--target", out_dir) == (text, n)


def test_bad_target_exits_with_a_clear_message(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "eval.generate", "--target", str(tmp_path / "missing"), "--prompt", "hi"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1
    assert "error: target" in proc.stderr and "neither an embedded model" in proc.stderr


def test_convert_refuses_to_overwrite(tmp_path, capsys):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert cli.run(convert.main, ["--from", "smollm2", "--to", str(tmp_path / "full")]) == 1
    assert "exists and is not empty" in capsys.readouterr().err


SPEC_LINE = re.compile(
    r"^spec: tau=([0-9.]+) steps=(\d+) accept_by_position=((?:[0-9.]+|-)(?:,(?:[0-9.]+|-)){2})$", re.M
)


@pytest.mark.slow
def test_generate_with_a_random_drafter_is_lossless(capsys):
    plain, _ = run_generate(capsys, "--target", "smollm2")
    assert (
        cli.run(
            generate.main,
            [
                "--max-new-tokens",
                "16",
                "--prompt",
                "What is the capital of France?",
                "--target",
                "smollm2",
                "--drafter",
                "random:dspark",
                "--k",
                "3",
            ],
        )
        == 0
    )
    out = capsys.readouterr().out
    match = SPEC_LINE.search(out)
    assert match, out
    assert out[: PREFILL_LINE.search(out).start()].strip() == plain
    assert 1.0 <= float(match.group(1)) <= 4.0 and int(match.group(2)) >= 1
