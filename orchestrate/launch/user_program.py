"""`orchestrate launch CONFIG -- python train.py ARGS`: the user's own program, checked and made
into what `orchestrate.loop_api.run` runs on every rank (`SCRIPT ARGS` or `-m MODULE ARGS`).

The interpreter word is dropped: torchrun starts every rank with the launcher's Python (`--python`
on remote nodes), the one that has orchestrate and torch installed, so a different one named after
`--` is refused rather than silently replaced. The script's path is made absolute, so ranks find it
whatever their working directory.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from orchestrate.errors import Problem, UserError

_WHERE = "-- PROGRAM"
_FIX = "give `-- python train.py ARGS`, `-- python -m package.module ARGS` or `-- train.py ARGS`"


def _is_interpreter(word: str) -> bool:
    return Path(word).name.startswith("python") and not word.endswith(".py")


def user_program(argv: tuple[str, ...] | list[str], cwd: Path | None = None,
                 python: str | None = None) -> tuple[str, ...]:
    """`argv` (everything after `--`) as `(SCRIPT, *ARGS)` with SCRIPT absolute, or
    `("-m", MODULE, *ARGS)`; UserError listing what is wrong. `python`: the interpreter the ranks
    run (default: this one)."""
    words = list(argv)
    if not words:
        raise UserError("nothing to run after `--`", [Problem(_WHERE, "empty", _FIX)])
    if _is_interpreter(words[0]):
        named, python = words.pop(0), python or sys.executable
        if os.sep in named and Path(named).resolve() != Path(python).resolve():
            raise UserError("the program names another Python", [Problem(
                _WHERE, f"{named} is not {python}, the interpreter torchrun starts the ranks with",
                "write just `python` (the ranks run the launcher's interpreter), or run orchestrate "
                f"from that environment ({named} -m orchestrate launch ...)")])
    if words[:1] == ["-m"]:
        if len(words) < 2 or not words[1] or words[1].startswith("-"):
            raise UserError("`-m` needs a module", [Problem(_WHERE, "no module after -m", _FIX)])
        return tuple(words)
    if not words or words[0].startswith("-"):
        raise UserError("no script to run after `--`", [Problem(
            _WHERE, f"expected a script, got {' '.join(words) or 'only the interpreter'}", _FIX)])
    script = (cwd or Path.cwd()) / words[0]
    if not script.is_file():
        raise UserError("the training script does not exist", [Problem(
            _WHERE, f"{script} is not a file", "check the path (relative to where you run orchestrate)")])
    return (str(script.resolve()), *words[1:])
