"""Run directories are orchestrate's: a user's files are never replaced by a launch, a
dry run, `config --out` or `export --out`; OS errors on those paths are one message, exit 2; the
model files follow the user's umask."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner

from orchestrate.cli import cli

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "examples" / "tiny-gpt2.yaml"


def _invoke(*args: object):
    return CliRunner().invoke(cli, [str(a) for a in args])


def _dry_run(run_dir: Path, config: Path = TINY, *extra: object):
    return _invoke("launch", "--gpus", 2, config, "--run-dir", run_dir, "--dry-run",
                   "--set", f"train.output_dir={run_dir.parent / 'runs'}", *extra)


def test_a_dry_run_into_a_directory_of_user_files_replaces_nothing(tmp_path: Path):
    run_dir = tmp_path / "d"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("mine\n")
    result = _dry_run(run_dir)
    assert result.exit_code == 2, result.output
    assert "config.yaml" in result.output and "--run-dir NEW" in result.output
    assert "Traceback" not in result.output
    assert (run_dir / "config.yaml").read_text() == "mine\n"
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml"]  # no plan.json, launch.sh, lock


def test_force_adds_a_run_to_a_directory_only_when_nothing_would_be_replaced(tmp_path: Path):
    run_dir = tmp_path / "d"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("mine\n")
    refused = _dry_run(run_dir)
    assert refused.exit_code == 2 and "--force" in refused.output, refused.output
    assert not (run_dir / "plan.json").exists()
    forced = _dry_run(run_dir, TINY, "--force")
    assert forced.exit_code == 0, forced.output
    assert (run_dir / "notes.txt").read_text() == "mine\n" and (run_dir / "plan.json").is_file()
    (run_dir / "config.yaml").write_text("edited by orchestrate's own run: may be replaced\n")
    again = _dry_run(run_dir)  # now a marked run directory: its own files are replaced, no --force needed
    assert again.exit_code == 0, again.output
    assert (run_dir / "config.yaml").read_text().startswith("# The validated config")


def test_the_config_files_own_directory_is_never_a_run_directory(tmp_path: Path):
    config = tmp_path / "config.yaml"
    shutil.copy(TINY, config)
    before = config.read_text()
    for force in ((), ("--force",)):
        result = _dry_run(tmp_path, config, *force)
        assert result.exit_code == 2 and "own directory" in result.output, result.output
        assert config.read_text() == before
    written = _invoke("config", "--gpus", 2, config, "--out", tmp_path)
    assert written.exit_code == 2 and "--out NEW" in written.output, written.output
    assert config.read_text() == before and sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


def test_config_out_refuses_user_files_and_rewrites_its_own(tmp_path: Path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "plan.json").write_text("{}")
    refused = _invoke("config", "--gpus", 2, TINY, "--out", out)
    assert refused.exit_code == 2 and "plan.json" in refused.output, refused.output
    assert (out / "plan.json").read_text() == "{}"
    fresh = tmp_path / "fresh"
    assert _invoke("config", "--gpus", 2, TINY, "--out", fresh).exit_code == 0
    assert _invoke("config", "--gpus", 2, TINY, "--out", fresh).exit_code == 0  # its own run directory


def test_export_out_refuses_a_directory_it_did_not_write(tmp_path: Path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text('{"mine": true}')
    result = _invoke("export", tmp_path, "--out", out)  # refused before the run is even looked at
    assert result.exit_code == 2 and "--out NEW" in result.output and "config.json" in result.output, result.output
    assert (out / "config.json").read_text() == '{"mine": true}'


def test_export_out_accepts_a_new_directory_and_an_earlier_export(tmp_path: Path):
    from orchestrate.errors import UserError
    from orchestrate.export import check_export_dir
    from orchestrate.run.layout import EXPORT_MARKER_FILE

    out = tmp_path / "hf"
    check_export_dir(out)  # new
    out.mkdir()
    (out / "model.safetensors").write_text("")
    with pytest.raises(UserError, match="did not write"):
        check_export_dir(out)
    (out / EXPORT_MARKER_FILE).write_text("")
    check_export_dir(out)  # an earlier export's files


def test_a_run_directory_that_cannot_be_created_is_one_message(tmp_path: Path):
    (tmp_path / "file").write_text("")
    result = _dry_run(tmp_path / "file" / "run")
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert str(tmp_path / "file") in result.output


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
@pytest.mark.parametrize("where", ["run_dir", "output_dir", "config_out"])
def test_read_only_directories_are_one_message_naming_the_path(tmp_path: Path, where: str):
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        if where == "run_dir":
            result = _dry_run(parent / "run")
        elif where == "output_dir":
            result = _invoke("launch", "--gpus", 2, TINY, "--dry-run", "--set", f"train.output_dir={parent}")
        else:
            result = _invoke("config", "--gpus", 2, TINY, "--out", parent / "out")
        assert result.exit_code == 2 and "Traceback" not in result.output, result.output
        assert str(parent) in result.output
    finally:
        parent.chmod(0o755)


def test_model_files_follow_the_umask(tmp_path: Path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from orchestrate.backends.hf_io import StateLayout, save_hf_dir

    model = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, n_positions=16, vocab_size=32,
                                       bos_token_id=0, eos_token_id=0))
    old = os.umask(0o022)
    try:
        save_hf_dir({k: v.detach() for k, v in model.state_dict().items()}, model.config, tmp_path / "m",
                    StateLayout.of(model))
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "m" / "model.safetensors").stat().st_mode) == 0o644


@pytest.mark.parametrize("where", ["run_dir", "output_dir", "config_out"])
def test_a_read_only_filesystem_is_one_message_naming_the_path(tmp_path: Path, monkeypatch, where: str):
    """As above, for root too: the write fails as on a read-only mount (EROFS)."""
    import errno

    real_mkdir = Path.mkdir
    blocked = tmp_path / "ro"

    def mkdir(self, *args, **kwargs):
        if self == blocked or blocked in self.parents:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    if where == "run_dir":
        result = _dry_run(blocked / "run")
    elif where == "output_dir":
        result = _invoke("launch", "--gpus", 2, TINY, "--dry-run", "--set", f"train.output_dir={blocked}")
    else:
        result = _invoke("config", "--gpus", 2, TINY, "--out", blocked / "out")
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert str(blocked) in result.output and "Read-only file system" in result.output
