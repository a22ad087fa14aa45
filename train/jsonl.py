"""An append-only JSONL file that survives being killed at any moment (the output of the data tools).

Records are appended as complete lines in one write, then flushed and fsynced. Opening an existing file keeps
every complete line and cuts a partial last line (a write interrupted by kill -9 or a power loss), so a rerun
continues after the last complete record and never writes a record twice or half.
"""

from __future__ import annotations

import json
import logging
import os

from hspec_jax.errors import InputError

log = logging.getLogger(__name__)


def jsonl_lines(text: str) -> list[str]:
    """The lines of JSON Lines text, split at "\\n" only: `str.splitlines` would also split at U+2028, U+2029 and
    U+0085, which `json.dumps(..., ensure_ascii=False)` leaves unescaped inside strings (a final "\\n" ends the
    last line, it does not start an empty one)."""
    lines = text.split("\n")
    return lines[:-1] if lines and lines[-1] == "" else lines


class JsonlAppender:
    """`records` holds what the file already had; `append` adds complete lines durably."""

    def __init__(self, path: str, check=None):
        """Open `path` for appending. `check(records, path)`, if given, may refuse what the file holds (raise);
        it runs before a partial last line is cut, so a refused file is left exactly as it was."""
        self.path = path
        self.records: list[dict] = []
        self.cut_bytes = 0
        if os.path.exists(path):
            with open(path, "rb") as f:
                data = f.read()
            keep = data.rfind(b"\n") + 1
            for number, line in enumerate(jsonl_lines(data[:keep].decode("utf-8")), 1):
                try:
                    self.records.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise InputError(
                        f"{path}:{number} is not a JSON record ({e.msg}); not a file of this tool?"
                    ) from None
            if check is not None:
                check(self.records, path)
            self.cut_bytes = len(data) - keep
            if self.cut_bytes:
                log.warning("%s: cutting a partial last line of %d bytes", path, self.cut_bytes)
                with open(path, "r+b") as f:
                    f.truncate(keep)
                    os.fsync(f.fileno())
        else:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._file = open(path, "ab")  # noqa: SIM115 (held open across appends, closed by close())

    def append(self, records: list[dict]) -> None:
        if not records:
            return
        self._file.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8"))
        self._file.flush()
        os.fsync(self._file.fileno())
        self.records.extend(records)

    def close(self) -> None:
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def check_out_file(path: str) -> None:
    """`--out` is a file (or can be created as one) in a writable directory."""
    if os.path.isdir(path):
        raise InputError(f"--out {path} is a directory, not a JSONL file")
    folder = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK | os.X_OK):
        raise InputError(f"--out {path}: {folder} is not a writable directory")
