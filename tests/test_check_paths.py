"""No development-machine paths in tracked text: `scripts/check_paths.py` (run by `make lint`) fails on one and
passes legitimate absolute paths, and the tools record paths relative to where they run."""

import os
import subprocess
import sys

import pytest

from hspec_jax.cli import portable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKER = os.path.join(ROOT, "scripts", "check_paths.py")
# Written in pieces, so that this file holds no such path itself.
RUN_DIR = "/".join(["", "work", "runs", "smollm2-hspec"])
SCRATCH = "/".join(["", "tmp", "eval-smoke"])


def check(tmp_path, text: str) -> subprocess.CompletedProcess:
    (tmp_path / "notes.md").write_text(text)
    return subprocess.run(
        [sys.executable, CHECKER, "notes.md"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("line", [f"python -m eval.main --out {SCRATCH}", f"--workdir={RUN_DIR}", f"`{RUN_DIR}/x`"])
def test_a_machine_path_fails_naming_file_and_line(tmp_path, line):
    proc = check(tmp_path, f"# Notes\n\n{line}\n")
    assert proc.returncode == 1
    assert proc.stdout.startswith("notes.md:3: " + ("/tmp" if "tmp" in line else "/work"))
    assert "1 absolute path(s)" in proc.stderr


def test_legitimate_paths_pass(tmp_path):
    lines = [
        "/usr/bin/time -v python -m eval.main",
        "grep model /proc/cpuinfo > /dev/null",
        "https://github.com/x/work/tree/main and file:///tmp/x",
        "runs/tmp/x, data/smollm2_heldout.jsonl, ~/work/x, $HOME/work/x",
        'SITE="${TMPDIR:-/tmp}/site"',
    ]
    proc = check(tmp_path, "\n".join(lines) + "\n")
    assert proc.returncode == 0, proc.stdout


def test_the_repository_has_none():
    proc = subprocess.run([sys.executable, CHECKER], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout


def test_recorded_paths_are_relative_to_where_a_tool_runs(tmp_path):
    here = str(tmp_path)
    command = f"python -m eval.main --drafter {here}/runs/a --out {here}/runs/b --target {RUN_DIR}"
    assert portable(command, here) == f"python -m eval.main --drafter runs/a --out runs/b --target {RUN_DIR}"
    assert portable(f"{here}x/y", here) == f"{here}x/y"  # only paths inside the directory
    assert portable("/a/b", "/") == "/a/b"
