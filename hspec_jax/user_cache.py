"""The per-user cache directory, `$XDG_CACHE_HOME/hspec_jax/` (default `~/.cache/hspec_jax/`): what is slow to
compute and safe to reuse across processes (measured step costs, tokenizers converted from GGUF files, the
command-line tools' compiled XLA programs). Every entry is keyed by everything it depends on, so a stale one is
never read; deleting the directory is always safe."""

from __future__ import annotations

import os
from pathlib import Path


def user_cache_dir(name: str) -> Path:
    """`$XDG_CACHE_HOME/hspec_jax/<name>` (not created)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "hspec_jax" / name
