"""The documentation's examples run: every code block of README.md and docs/*.md.

Python blocks of one file run in order, in one namespace, from a scratch directory (what they write lands there);
shell blocks (`bash`, `sh`, `shell`, `console`) run as written, with `python` this interpreter, from a scratch
directory that links the repository's folders (`configs/`, `data/`, ...), so relative paths work and `runs/` is
scratch. A block that cannot run here (an accelerator, many hosts, minutes of CPU) has the line
`<!-- not run: REASON -->` right before it; any other block that is not run fails `test_every_block_runs_or_says_why`.
Blocks of other languages (`text`, `json`, ...) show output or file contents and are not code. Relative links must
name files that exist, and the README stays short."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import subprocess
import sys
import types

import pytest

from hspec_jax.drafters import family

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PYTHON = ("python",)
SHELL = ("bash", "sh", "shell", "console")
NOT_RUN = re.compile(r"^<!-- not run: (.+?) -->$")
FENCE = re.compile(r"^```(\S*)\s*$")
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")
LINKED_FOLDERS = (
    "configs",
    "data",
    "train",
    "eval",
    "benchmarks",
    "hspec_jax",
    "scripts",
    "Makefile",
    "pyproject.toml",
)
MAX_README_LINES = 250


@dataclasses.dataclass
class Block:
    path: pathlib.Path
    line: int  # of the opening fence
    lang: str
    code: str
    not_run: str | None  # the reason, when marked

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: pathlib.Path) -> list[Block]:
    """Every fenced block of a Markdown file, with the `not run` reason of the line before it."""
    lines = path.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        assert end is not None, f"{path.relative_to(ROOT)}:{i + 1}: unclosed code block"
        before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = NOT_RUN.match(before)
        found.append(Block(path, i + 1, match.group(1), "\n".join(lines[i + 1 : end]) + "\n", marker and marker[1]))
        i = end + 1
    return found


ALL = [b for path in DOCS for b in blocks(path)]


def test_every_block_runs_or_says_why():
    assert any(b.lang in PYTHON for b in ALL) and any(b.lang in SHELL for b in ALL)
    untyped = [b.where for b in ALL if not b.lang]
    assert not untyped, f"code blocks without a language (```python, ```bash, ```text ...): {untyped}"
    pointless = [b.where for b in ALL if b.not_run and b.lang not in PYTHON + SHELL]
    assert not pointless, f"'not run' marks a block that is not code: {pointless}"
    for path in DOCS:
        text = path.read_text().splitlines()
        marks = [n for n, line in enumerate(text, 1) if NOT_RUN.match(line.strip())]
        marked = {b.line for b in blocks(path) if b.not_run}
        for n in marks:  # each mark stands right before a block (blank lines allowed)
            nxt = next((m for m in range(n + 1, len(text) + 1) if text[m - 1].strip()), None)
            assert nxt in marked, f"{path.relative_to(ROOT)}:{n}: a 'not run' mark with no code block after it"


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """A directory with the repository's folders linked in, as the working directory, and `python` on PATH."""
    for name in LINKED_FOLDERS:
        (tmp_path / name).symlink_to(ROOT / name)
    bin_dir = tmp_path / ".bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')  # a link would leave the venv
    (bin_dir / "python").chmod(0o755)
    monkeypatch.chdir(tmp_path)
    return tmp_path, bin_dir


@pytest.fixture
def registry():
    """Drafter families and kinds registered by an example are removed afterwards."""
    families, kinds = dict(family.DRAFTER_FAMILIES), dict(family.DRAFTER_KINDS)
    yield
    for table, saved in ((family.DRAFTER_FAMILIES, families), (family.DRAFTER_KINDS, kinds)):
        table.clear()
        table.update(saved)


def files_with(langs) -> list[pathlib.Path]:
    return [p for p in DOCS if any(b.lang in langs and not b.not_run for b in blocks(p))]


@pytest.mark.parametrize("path", files_with(PYTHON), ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run(path, scratch, registry, monkeypatch):
    module = types.ModuleType(f"docs_example_{path.stem}")  # a real module: dataclasses defined there resolve
    monkeypatch.setitem(sys.modules, module.__name__, module)
    for block in blocks(path):
        if block.lang in PYTHON and not block.not_run:
            code = compile("\n" * block.line + block.code, str(path), "exec")  # tracebacks name the doc's line
            exec(code, module.__dict__)


@pytest.mark.parametrize("path", files_with(SHELL), ids=lambda p: str(p.relative_to(ROOT)))
def test_shell_blocks_run(path, scratch):
    tmp, bin_dir = scratch
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", PYTHONPATH=str(ROOT))
    for block in blocks(path):
        if block.lang in SHELL and not block.not_run:
            proc = subprocess.run(
                ["bash", "-euo", "pipefail", "-c", block.code],
                cwd=tmp,
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert proc.returncode == 0, f"{block.where}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"


def test_links_name_existing_files():
    broken = []
    for path in [*DOCS, ROOT / "benchmarks" / "results" / "README.md", ROOT / "CHANGELOG.md"]:
        for target, _ in LINK.findall(path.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (path.parent / target).exists():
                broken.append(f"{path.relative_to(ROOT)}: {target}")
    assert not broken, broken


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= MAX_README_LINES
