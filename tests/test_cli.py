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
def test_generate_compares_the_shipped_drafter_then_converted_targets_generate_the_same(capsys, tmp_path):
    """`generate --compare` on SmolLM2 with the shipped drafter: plain decoding answers the question, draft-and-verify
    prints the same text with its tau, steps and acceptance and a speedup over one warm run. Then SmolLM2 converted
    to HF, and that export converted to Orbax, generates that same text and token count: a fault in either
    conversion changes it (the plain run above is the reference; the converted target times its printed run,
    --repeats 0). Every run has the same cache length."""
    shapes = ["--cache-length", "64"]
    args = ["--target", "smollm2", "--drafter", "smollm2-hspec", "--k", "3", "--compare", "--repeats", "1", *shapes]
    assert cli.run(generate.main, ["--max-new-tokens", "16", "--prompt", "What is the capital of France?", *args]) == 0
    out = capsys.readouterr().out
    plain_part, rest = out.split("== draft-and-verify with smollm2-hspec, k=3\n")
    spec_text, timing = rest.split("== plain decoding: timing\n")
    plain_timing, spec_timing = timing.split("== draft-and-verify: timing\n")
    assert plain_part.startswith("== plain decoding\n")
    plain_text = plain_part.removeprefix("== plain decoding\n").strip()
    n = int(DECODE_LINE.search(plain_timing).group(1))
    assert "Paris" in plain_text and 0 < n <= 16
    assert spec_text.strip() == plain_text
    assert "in rounds over plain and draft-and-verify" in plain_timing
    match = SPEC_LINE.search(spec_timing)
    assert match, out
    assert 1.0 <= float(match.group(1)) <= 4.0 and int(match.group(2)) >= 1
    assert "same text as plain decoding: yes (greedy)" in out
    assert re.search(r"^speedup: [0-9.]+x decode tokens/s, draft-and-verify over plain \(median of 1 warm", out, re.M)
    hf_dir, orbax_dir = str(tmp_path / "hf"), str(tmp_path / "orbax")
    assert cli.run(convert.main, ["--from", "smollm2", "--to", hf_dir, "--format", "hf"]) == 0
    assert cli.run(convert.main, ["--from", hf_dir, "--to", orbax_dir, "--format", "orbax"]) == 0
    capsys.readouterr()
    assert run_generate(capsys, "--target", orbax_dir, "--repeats", "0", *shapes) == (plain_text, n)
