"""The README's Python example runs as written."""

import os
import re

import pytest

pytestmark = pytest.mark.slow


def test_readme_example_runs(capsys):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "README.md")) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    assert len(blocks) == 1
    exec(compile(blocks[0], "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "(1, 8, 16384)" in out
