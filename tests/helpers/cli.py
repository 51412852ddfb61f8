"""The CLI in-process (click's runner) and what "one message" means for its output."""

from __future__ import annotations

from click.testing import CliRunner

from orchestrate.cli import cli


def invoke(*args: object):
    return CliRunner().invoke(cli, [str(a) for a in args])


def assert_one_message(result, *names: object) -> None:
    """Exit 2, no traceback, and every one of `names` in the output."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit), result.output
    for name in names:
        assert str(name) in result.output, result.output
