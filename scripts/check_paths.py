"""Fail on absolute paths of a development machine in tracked text: they mean nothing on a user's machine.

    python scripts/check_paths.py            # every file `git ls-files` lists (run by `make lint`)
    python scripts/check_paths.py FILE ...   # these files

Prints `FILE:LINE: PATH` for every absolute path under the development machines' own folders (the repository
checkout, run directories, scratch and home folders: see `MACHINE_ROOTS`) and exits 1 if there is one. Write such
a path relative to the repository (`data/smollm2_heldout.jsonl`), or as a workdir of the reader's own
(`runs/smollm2-hspec`). A path is only flagged where it starts one: a URL (`https://host/work/...`), a relative
path (`runs/tmp/x`) or a shell default (`${TMPDIR:-/tmp}`) is not, and system paths outside those folders
(`/usr/bin/time`, `/proc/cpuinfo`, `/dev/null`) are never flagged. Binary files and the third-party texts quoted
verbatim in the data sets (`SKIPPED`) are not read.
"""

from __future__ import annotations

import fnmatch
import os
import re
import subprocess
import sys

# Top-level folders the development machines kept their checkouts, runs, scratch files and homes in.
MACHINE_ROOTS = ("work", "tmp", "root", "home")
# `/ROOT/` where it starts a path: not after a character that belongs to a URL, a word, a path or a variable.
PATTERN = re.compile(r"(?<![\w.~$%/:@+-])/(?:" + "|".join(MACHINE_ROOTS) + r")/[^\s\"'`)\]}>,;|]*")
# Data sets whose text is someone else's words (conversations, evaluation prompts), quoted verbatim.
SKIPPED = ("data/*.jsonl", "hspec_jax/prompt_data/*")


def tracked_files(root: str) -> list[str]:
    """The repository's tracked files, relative to `root`."""
    out = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
    return [name for name in out.decode().split("\0") if name]


def is_text(path: str) -> bool:
    """A file with no NUL byte in its first 8 KiB (images and archives have some)."""
    with open(path, "rb") as f:
        head = f.read(8192)
    return b"\0" not in head


def machine_paths(text: str) -> list[tuple[int, str]]:
    """(line number, path) of every development-machine path in `text`."""
    return [(n, m.group(0)) for n, line in enumerate(text.splitlines(), 1) for m in PATTERN.finditer(line)]


def check(paths: list[str], root: str = ".") -> list[str]:
    """`FILE:LINE: PATH` for every development-machine path in the text files among `paths` (relative to `root`)."""
    found = []
    for name in paths:
        if any(fnmatch.fnmatch(name, pattern) for pattern in SKIPPED):
            continue
        path = os.path.join(root, name)
        if not os.path.isfile(path) or not is_text(path):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        found += [f"{name}:{line}: {hit}" for line, hit in machine_paths(text)]
    return found


def main(argv: list[str]) -> int:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = argv or tracked_files(root)
    found = check(paths, "." if argv else root)
    for line in found:
        print(line)
    if found:
        print(
            f"error: {len(found)} absolute path(s) of a development machine in tracked text: write them relative to "
            "the repository or as the reader's own workdir (runs/...)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
