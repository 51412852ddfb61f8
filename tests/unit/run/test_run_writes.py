"""Writes into a run directory refuse a symbolic link at the moment of the write (issue 38, item 2):
RUN_DIR/model or RUN_DIR/checkpoints replaced by a link while the run trains is one message naming
the link, and nothing is written where it points (orchestrate/run/writes.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from orchestrate.errors import UserError
from orchestrate.planner.strategy import Strategy
from orchestrate.run.writes import STAGING_DIR, staged_dir, write_file
from orchestrate.worker import checkpointing as ck
from orchestrate.worker import stages
from tests.helpers.engines import cpu_rank
from tests.helpers.plans import make_plan

FSDP = Strategy("fsdp", 3, "none", "none", "fp32", False, 2)


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory of the user's, outside the run: nothing may be written into it."""
    path = tmp_path / "elsewhere"
    path.mkdir()
    (path / "mine.txt").write_text("a user's file\n")
    return path


def _untouched(outside: Path) -> None:
    assert sorted(p.name for p in outside.iterdir()) == ["mine.txt"]
    assert (outside / "mine.txt").read_text() == "a user's file\n"


def _refused(err: pytest.ExceptionInfo, link: Path) -> None:
    text = str(err.value)
    assert "symbolic link" in text and str(link) in text and f"rm {link}" in text and "--resume" in text


def test_write_file_refuses_a_linked_directory_and_replaces_a_link_at_the_name(tmp_path: Path, outside: Path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").symlink_to(outside, target_is_directory=True)
    with pytest.raises(UserError) as err:
        write_file(run, run / "checkpoints" / "latest", "step-00000002\n")
    _refused(err, run / "checkpoints")
    _untouched(outside)
    (run / "latest").symlink_to(outside / "mine.txt")
    write_file(run, run / "latest", "step-00000002\n")  # the link is replaced, its target left alone
    assert not (run / "latest").is_symlink() and (run / "latest").read_text() == "step-00000002\n"
    _untouched(outside)


def test_a_model_staged_then_placed_replaces_an_earlier_one_and_leaves_no_staging(tmp_path: Path):
    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    (run / "model" / "old.bin").write_text("old")
    with staged_dir(run, ["model", "adapter"]) as staging:
        (staging / "model").mkdir()
        (staging / "model" / "model.safetensors").write_bytes(b"weights")
    assert sorted(p.name for p in run.iterdir()) == ["model"]  # no adapter written, no .tmp-save, no .old-
    assert [p.name for p in (run / "model").iterdir()] == ["model.safetensors"]


@pytest.mark.parametrize("when", ["before the save", "during the save"])
def test_a_model_directory_linked_elsewhere_is_refused_and_nothing_is_written_there(tmp_path: Path, outside: Path,
                                                                                    when: str):
    run = tmp_path / "run"
    run.mkdir()
    link = run / "model"
    if when == "before the save":
        link.symlink_to(outside, target_is_directory=True)
    with pytest.raises(UserError) as err:
        with staged_dir(run, ["model"]) as staging:
            (staging / "model").mkdir()
            (staging / "model" / "model.safetensors").write_bytes(b"weights")
            if when == "during the save":
                link.symlink_to(outside, target_is_directory=True)
    _refused(err, link)
    _untouched(outside)
    assert not (run / STAGING_DIR).exists()


class _SavingRuntime:
    """A method's save half: writes the model where the run directory it is handed says."""

    saves_tokenizer = False

    def save(self, plan, engine, run, rank):
        run.model.mkdir(parents=True)
        (run.model / "model.safetensors").write_bytes(b"weights")
        return []


def test_the_final_save_refuses_a_model_directory_linked_while_the_run_trained(tmp_path: Path, outside: Path,
                                                                                monkeypatch):
    from orchestrate.run.layout import RunDir

    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.model.symlink_to(outside, target_is_directory=True)
    monkeypatch.setattr(stages, "runtimes", lambda config: [_SavingRuntime()])
    plan = make_plan(FSDP, ranks=1)

    class _Data:
        label_names = None

    with pytest.raises(UserError) as err:
        stages.save_model(plan, run, cpu_rank(), engine=None, data=_Data())
    _refused(err, run.model)
    _untouched(outside)
    run.model.unlink()
    stages.save_model(plan, run, cpu_rank(), engine=None, data=_Data())
    assert (run.model / "model.safetensors").read_bytes() == b"weights" and not run.model.is_symlink()


class _Engine:
    """A TrainEngine's checkpoint half; `plant` places a link in the checkpoint while it is written."""

    def __init__(self, plant: Path | None = None) -> None:
        self.plant = plant

    def save_checkpoint(self, ckpt_dir: Path, client_state: dict) -> None:
        torch.save({"w": torch.zeros(2)}, ckpt_dir / "engine.pt")
        if self.plant is not None:
            (ckpt_dir / "shard.bin").symlink_to(self.plant)


def _checkpointer(tmp_path: Path, engine) -> ck.Checkpointer:
    model_dir = tmp_path / "init"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text("{}")
    return ck.Checkpointer(make_plan(FSDP, ranks=1), engine, cpu_rank(), tmp_path / "run", model_dir)


SAMPLER = {"epoch": 0, "position": 8, "seed": 0, "num_blocks": 100}


def test_a_checkpoints_directory_linked_elsewhere_while_the_run_trained_is_refused(tmp_path: Path, outside: Path):
    checkpointer = _checkpointer(tmp_path, _Engine())
    checkpointer.save(2, SAMPLER)
    root = tmp_path / "run" / "checkpoints"
    root.rename(tmp_path / "moved")
    root.symlink_to(outside, target_is_directory=True)
    with pytest.raises(UserError) as err:
        checkpointer.save(4, SAMPLER)
    _refused(err, root)
    _untouched(outside)


def test_a_link_placed_in_a_checkpoint_while_it_is_written_is_refused_and_not_published(tmp_path: Path,
                                                                                       outside: Path):
    checkpointer = _checkpointer(tmp_path, _Engine(plant=outside / "mine.txt"))
    with pytest.raises(UserError) as err:
        checkpointer.save(2, SAMPLER)
    assert "shard.bin" in str(err.value) and "symbolic link" in str(err.value)
    root = tmp_path / "run" / "checkpoints"
    assert not (root / "step-00000002").exists() and not (root / "latest").exists()
    _untouched(outside)
    assert json.loads((root / ".tmp-step-00000002" / "meta.json").read_text())["step"] == 2  # left to look at
