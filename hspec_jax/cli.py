"""What every command-line tool shares: argument types checked at parse time, one-line errors, exit codes.

Each tool (`eval.generate`, `eval.params`, `eval.memory`, `hspec_jax.checkpoints.convert`) parses with
`ArgumentParser`, checks every argument before it loads anything, and runs its `main` through `run`:

    error: <one line>      on stderr, exit 2 for a malformed argument, 1 for bad input (`InputError`, a file
                           that cannot be read or written: the message names it; a full disk: "no space left")
    interrupted[: where]   on Ctrl-C, exit 130 (a tool may say where it stopped in the KeyboardInterrupt)
    a traceback            for anything else: that is a bug
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections.abc import Callable

from hspec_jax.errors import InputError, is_no_space
from hspec_jax.user_cache import user_cache_dir

FLOAT_DTYPES = ("float32", "bfloat16", "float16")
# Where the tools keep compiled XLA programs between runs (a rerun loads them instead of compiling again).
DEFAULT_COMPILE_CACHE = str(user_cache_dir("xla"))
EXIT_INTERRUPTED = 130
MAX_K = 15  # the most drafted tokens per step `--k` takes
AUTO = "auto"  # --k auto: the adaptive draft length


def use_compile_cache(directory: str | None) -> None:
    """Keep this process's compiled XLA programs in `directory` (None or '' for none), so that the next run of
    the same program reads it instead of compiling it again. Programs that took under a second to compile are
    not kept. An explicit `JAX_COMPILATION_CACHE_DIR` in the environment wins."""
    if directory and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        import jax

        jax.config.update("jax_compilation_cache_dir", directory)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def portable(text: str, base: str | None = None) -> str:
    """`text` with the absolute path of the current directory (or of `base`) taken off every path under it, so that a
    command or a drafter name recorded in a result reads the same on any machine: run from a clone at CLONE,
    `--out CLONE/runs/x` is recorded as `--out runs/x`. Other paths are kept as given."""
    base = os.path.abspath(base or os.getcwd())
    return text if base == os.sep else text.replace(base + os.sep, "")


def usage_error(prog: str, message: str) -> str:
    """The one line for a malformed argument (printed with exit status 2)."""
    return f"error: {message} (see {prog} --help)\n"


class ArgumentParser(argparse.ArgumentParser):
    """argparse with a one-line error instead of usage + error."""

    def error(self, message: str):
        self.exit(2, usage_error(self.prog, message))


def _number(kind: type, text: str):
    try:
        value = kind(text)
    except ValueError:
        expected = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def positive_int(text: str) -> int:
    value = _number(int, text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = _number(int, text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def non_negative_float(text: str) -> float:
    value = _number(float, text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def probability(text: str) -> float:
    """A number in (0, 1]."""
    value = _number(float, text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def float_dtype(text: str) -> str:
    """A floating-point weight/cache dtype name."""
    if text not in FLOAT_DTYPES:
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r}; choose from {', '.join(FLOAT_DTYPES)}")
    return text


BYTE_UNITS = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "ki": 1024, "mi": 1024**2, "gi": 1024**3}


def byte_size(text: str) -> int:
    """A positive number of bytes: `123456`, `1.5e9`, `512MiB`, `2GB` (k/m/g: powers of 1000; Ki/Mi/Gi: of 1024)."""
    match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([kKmMgG]i?)?[bB]?\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"expected bytes such as 123456, 512MiB or 2GB, got {text!r}")
    value = int(_number(float, match.group(1)) * BYTE_UNITS[(match.group(2) or "").lower()])
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return value


def int_list(text: str) -> list[int]:
    """A comma-separated list of positive integers, e.g. `1,2,4,8`."""
    values = [positive_int(part) for part in text.split(",")]
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"values repeat in {text!r}")
    return values


def draft_length(text: str) -> str | int:
    """`--k`: "auto" or a positive integer."""
    return AUTO if text == AUTO else positive_int(text)


def add_drafter_arguments(parser: argparse.ArgumentParser) -> None:
    """`--drafter`, `--recipe` and `--k` as the tools that serve one drafter take them (`eval.generate`,
    `hspec_jax.serve`)."""
    parser.add_argument(
        "--drafter", default=None, help="drafter directory, shipped name (smollm2-hspec) or random:<kind>"
    )
    parser.add_argument(
        "--recipe", default=None, help="recipe name or file for random:<kind> drafters (default: the target's)"
    )
    parser.add_argument(
        "--k",
        type=draft_length,
        default=None,
        help=f"drafted tokens per step, 1..{MAX_K}, or auto: chosen per step up to the drafter's k, at most 3 on CPU "
        "(the default)",
    )


def parse_ks(text: str) -> tuple[int | str, ...]:
    """`--k auto,2,7` -> ("auto", 2, 7): distinct draft lengths in 1..MAX_K, or auto (the adaptive policy)."""
    try:
        ks = tuple(AUTO if x == AUTO else int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--k takes comma-separated integers or auto, got {text!r}") from None
    if not all(k == AUTO or 1 <= k <= MAX_K for k in ks) or len(set(ks)) != len(ks):
        raise argparse.ArgumentTypeError(f"--k takes distinct integers in 1..{MAX_K}, got {text!r}")
    return ks


def check_output_dir(path: str, flag: str = "--out") -> None:
    """`path` is a directory or can be created as one (not a file, under a writable directory): checked before
    any work, an `InputError` naming `flag` otherwise."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise InputError(f"{flag} {path} is not a directory")
    parent = os.path.abspath(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise InputError(f"{flag} {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"{flag} {path}: {parent} is not writable")


def os_error_line(e: OSError) -> str:
    """One line for a failed file operation, naming the file (and for a full disk, its directory)."""
    name = e.filename if e.filename is not None else None
    if is_no_space(e):
        return f"no space left on {os.path.dirname(os.path.abspath(name)) if name else 'device'}"
    reason = e.strerror or str(e)
    return f"{reason}: {name}" if name else reason


def run(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    """Call a tool's `main(argv)`, turning known errors into one line on stderr and an exit status."""
    try:
        return main(argv)
    except KeyboardInterrupt as e:
        print(f"interrupted: {e}" if str(e) else "interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        if e.filename is None and not is_no_space(e):
            raise
        print(f"error: {os_error_line(e)}", file=sys.stderr)
        return 1
