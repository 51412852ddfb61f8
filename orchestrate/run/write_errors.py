"""OS errors while writing a run directory or an output directory (read-only, no space, not a
directory): one UserError naming the path and the fix, exit 2, no traceback (issue 10)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from orchestrate.errors import Problem, UserError


@contextmanager
def os_errors_as_user_errors(flag: str) -> Iterator[None]:
    """Turn an OSError raised inside into a UserError; `flag` is the option that names the directory."""
    try:
        yield
    except OSError as exc:
        path = exc.filename or "the output directory"
        raise UserError("cannot write the output", [Problem(
            str(path), exc.strerror or str(exc),
            f"make it writable, or give a directory you can write to ({flag} NEW)")]) from None
