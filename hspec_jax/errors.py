"""The error type for input a user can fix, and how to recognise a full disk behind any wrapper.

`InputError` (a `ValueError`) carries a one-line message that says what is wrong and, for files, which
file; the command-line tools print it as `error: <message>` and exit 1 (`hspec_jax.cli.run`). Anything
else that escapes is a bug and keeps its traceback.
"""

from __future__ import annotations

import errno


class InputError(ValueError):
    """Bad input (argument, file, config value) with a one-line message the user can act on."""


def causes(exc: BaseException):
    """`exc` and every exception behind it: `__cause__`, `__context__` and the members of exception groups."""
    seen, stack = set(), [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        stack.extend([e.__cause__, e.__context__, *getattr(e, "exceptions", ())])


def is_no_space(exc: BaseException) -> bool:
    """Whether a full disk is behind `exc`, however deeply a library wrapped the OSError (or only its text)."""
    return any(
        (isinstance(e, OSError) and e.errno == errno.ENOSPC) or "No space left on device" in str(e) for e in causes(exc)
    )
