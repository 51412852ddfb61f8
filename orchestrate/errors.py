"""User-facing errors: everything a user can fix is raised as one of these, never as `assert`.

The CLI turns a `UserError` into one message listing every problem and exit code 2, without a
traceback. Library callers catch it like any exception.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from orchestrate.run.exits import EXIT_USER_ERROR

__all__ = ["EXIT_USER_ERROR", "Problem", "UserError"]


@dataclass(frozen=True)
class Problem:
    """One thing wrong with the user's input."""

    where: str  # a YAML path such as "train.seq_len" (with ":line" when known) or a flag such as "--gpus"
    message: str
    fix: str = ""

    def render(self) -> str:
        text = f"{self.where}: {self.message}"
        if self.fix:
            text += f"\n    fix: {self.fix}"
        return text


@dataclass
class UserError(Exception):
    """A problem with the user's input or request; carries every problem found, not just the first."""

    headline: str
    problems: list[Problem] = field(default_factory=list)
    details: str = ""  # extra text printed after the problems (for example the closest plans)

    def __post_init__(self) -> None:
        super().__init__(self.headline)

    def __str__(self) -> str:
        lines = [self.headline]
        lines += ["  - " + p.render() for p in self.problems]
        if self.details:
            lines.append(self.details)
        return "\n".join(lines)
