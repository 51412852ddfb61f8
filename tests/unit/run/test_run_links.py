"""Nothing is written through a symbolic link in a run directory: the launcher (launch, --resume,
dry runs, `config`, `plan --out`) and every worker refuse a run directory with a link where
orchestrate writes, naming it, and the lock opens its file with O_NOFOLLOW, so a RUN_DIR/.lock
linked to a user's file never truncates that file."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from orchestrate.cli import cli
from orchestrate.errors import UserError

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "examples" / "tiny-gpt2.yaml"
PRECIOUS = "a user's file: must survive\n"


def _invoke(*args: object):
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A run directory as a dry run leaves it (marker, config, plan, ...)."""
    run = tmp_path / "run"
    result = _invoke("launch", "--gpus", 2, TINY, "--dry-run", "--run-dir", run,
                     "--set", f"train.output_dir={tmp_path / 'runs'}")
    assert result.exit_code == 0, result.output
    return run


@pytest.fixture
def precious(tmp_path: Path) -> Path:
    path = tmp_path / "precious.txt"
    path.write_text(PRECIOUS)
    return path


@pytest.mark.parametrize("name", [".lock", "plan.json.tmp", "REQUEUE", "metrics.jsonl"])
def test_a_resume_refuses_a_linked_file_and_leaves_its_target_alone(run_dir: Path, precious: Path, name: str):
    link = run_dir / name
    link.unlink(missing_ok=True)
    link.symlink_to(precious)
    result = _invoke("launch", "--gpus", 2, TINY, "--resume", "--run-dir", run_dir, "--dry-run")
    assert result.exit_code == 2, result.output
    assert str(link) in result.output and "symbolic link" in result.output and "Traceback" not in result.output
    assert precious.read_text() == PRECIOUS


def test_a_linked_checkpoints_directory_is_refused_by_config_and_plan_out(run_dir: Path, tmp_path: Path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run_dir / "checkpoints").symlink_to(elsewhere, target_is_directory=True)
    for command in (["config", "--gpus", 2, TINY, "--out", run_dir], ["plan", "--gpus", 2, TINY, "--out", run_dir]):
        result = _invoke(*command)
        assert result.exit_code == 2 and str(run_dir / "checkpoints") in result.output, result.output
    assert list(elsewhere.iterdir()) == []


def test_a_link_deeper_in_the_run_is_found_without_following_it(run_dir: Path, precious: Path):
    from orchestrate.run.layout import check_no_links

    (run_dir / "logs" / "attempt_0").mkdir(parents=True)
    (run_dir / "logs" / "attempt_0" / "stdout.log").symlink_to(precious)
    with pytest.raises(UserError) as err:  # what every worker checks at start (worker.stages.check_run_dir)
        check_no_links(run_dir)
    assert [p.where for p in err.value.problems] == [str(run_dir / "logs" / "attempt_0" / "stdout.log")]


def test_the_lock_refuses_a_linked_lock_file_on_its_own(tmp_path: Path, precious: Path):
    from orchestrate.run.lock import RunLock

    (tmp_path / ".lock").symlink_to(precious)
    with pytest.raises(UserError, match="lock file is a symbolic link"):
        RunLock.acquire(tmp_path, "test")
    assert precious.read_text() == PRECIOUS


def test_force_accepts_a_users_link_then_the_marked_run_refuses_every_link(tmp_path: Path, precious: Path):
    """An unmarked directory is checked at the names orchestrate writes only (`--force` may put a run
    among the user's files); once marked, all of it is the run's, links included (docs/security.md)."""
    run = tmp_path / "mixed"
    run.mkdir()
    (run / "my-data").symlink_to(precious)
    result = _invoke("launch", "--gpus", 2, TINY, "--dry-run", "--run-dir", run, "--force",
                     "--set", f"train.output_dir={tmp_path / 'runs'}")
    assert result.exit_code == 0, result.output
    resumed = _invoke("launch", "--gpus", 2, TINY, "--resume", "--run-dir", run, "--dry-run")
    assert resumed.exit_code == 2 and str(run / "my-data") in resumed.output, resumed.output
    assert precious.read_text() == PRECIOUS
