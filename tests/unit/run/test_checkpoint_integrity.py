"""Checkpoints are never lost and never a traceback: discovery without `latest`, the
completeness manifest, the fallback past damaged checkpoints (truncated engine file or rank file,
bad meta.json), pruning that keeps the newest intact one, a full disk during a write, and a
checkpoint that passes its checks but fails to load. One process, no process group, except the
FSDP test (one gloo rank in this process, real DCP files)."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest
import torch

from orchestrate.errors import UserError
from orchestrate.planner.strategy import Strategy
from orchestrate.run import checkpoints as rc
from orchestrate.run.checkpoints import MANIFEST_FILE, manifest_problem, write_manifest
from orchestrate.run.layout import RunDir
from orchestrate.worker import checkpointing as ck
from tests.helpers.engines import cpu_rank, setup_engine
from tests.helpers.plans import make_plan

FSDP = Strategy("fsdp", 3, "none", "none", "fp32", False, 2)
SAMPLER = {"epoch": 0, "position": 0, "seed": 0, "num_blocks": 100}


class FakeEngine:
    """A TrainEngine's checkpoint half over one tensor; `save_error` is raised half way."""

    def __init__(self) -> None:
        self.weights = torch.zeros(4)
        self.save_error: BaseException | None = None
        self.load_error: BaseException | None = None

    def save_checkpoint(self, ckpt_dir: Path, client_state: dict) -> None:
        torch.save({"w": self.weights.clone()}, ckpt_dir / "engine.pt")
        if self.save_error is not None:
            raise self.save_error
        (ckpt_dir / "client_state.json").write_text(json.dumps(client_state))

    def load_checkpoint(self, ckpt_dir: Path) -> dict:
        if self.load_error is not None:
            raise self.load_error
        self.weights = torch.load(ckpt_dir / "engine.pt", weights_only=True)["w"]
        return json.loads((ckpt_dir / "client_state.json").read_text())


@pytest.fixture
def run(tmp_path):
    """(plan, engine, checkpointer, run_dir) for one process, its plan.json written."""
    model_dir = tmp_path / "init"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    plan = make_plan(FSDP, ranks=1, config={"train": {"keep_checkpoints": 2, "max_steps": 40},
                                            "data": {"generate_demo_corpus": True}})
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    plan.write(run_dir / "plan.json")
    engine = FakeEngine()
    return plan, engine, ck.Checkpointer(plan, engine, cpu_rank(), run_dir, model_dir), run_dir


def _save(checkpointer, engine, step: int) -> Path:
    engine.weights = torch.full((4,), float(step))
    return checkpointer.save(step, {**SAMPLER, "position": step * 8})


def _worker_resumes(plan, run_dir: Path, capsys) -> tuple[str | None, str]:
    """What a starting worker continues from, and what it printed."""
    from orchestrate.worker.stages import checkpoint_to_resume

    found = checkpoint_to_resume(plan, RunDir(run_dir), cpu_rank())
    return (found.name if found else None), capsys.readouterr().out


def _launcher_resumes(plan, run_dir: Path) -> str:
    """What `orchestrate launch --resume --run-dir RUN_DIR` says before any worker starts."""
    from orchestrate.launch.rundir import prepare_run_dir

    said: list[str] = []
    prepare_run_dir(plan.config, plan.hardware, "run", run_dir, True, said.append)
    return "\n".join(said)


def _steps(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))


# --- 1. checkpoints thrown away when `latest` is gone ---------------------------------------------


def test_without_latest_resume_continues_from_the_newest_and_a_fresh_launch_is_refused(run, capsys):
    from orchestrate.launch.resume import refuse_checkpointed

    plan, engine, checkpointer, run_dir = run
    _save(checkpointer, engine, 20)
    _save(checkpointer, engine, 33)
    (run_dir / "checkpoints" / "latest").unlink()
    assert _worker_resumes(plan, run_dir, capsys)[0] == "step-00000033"
    said = _launcher_resumes(plan, run_dir)
    assert "from step 33" in said and "no checkpoint yet" not in said
    with pytest.raises(UserError, match="--resume"):
        refuse_checkpointed(run_dir)
    # A dangling `latest` neither breaks discovery nor suggests deleting anything.
    (run_dir / "checkpoints" / "latest").write_text("step-00000099\n")
    assert _worker_resumes(plan, run_dir, capsys)[0] == "step-00000033"
    assert _steps(run_dir) == ["step-00000020", "step-00000033"]


# --- 2. damaged checkpoints: fallback, never a traceback -----------------------------------------


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGE = {
    "truncated engine file": (lambda c: _truncate(c / "engine.pt"), "engine.pt has"),
    "truncated rank file": (lambda c: _truncate(c / "ranks" / "rank-00000.json"), "rank-00000.json"),
    "meta.json is {}": (lambda c: (c / "meta.json").write_text("{}"), "missing format"),
    "meta.json is not JSON": (lambda c: (c / "meta.json").write_text("step: 33"), "Expecting value"),
    "same size, other bytes": (lambda c: (c / "client_state.json").write_text(
        (c / "client_state.json").read_text().replace("33", "34")), "checksum"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_newest_checkpoint_is_named_and_skipped_for_the_newest_intact(run, capsys, damage):
    plan, engine, checkpointer, run_dir = run
    _save(checkpointer, engine, 20)
    newest = _save(checkpointer, engine, 33)
    hurt, why = DAMAGE[damage]
    hurt(newest)
    name, printed = _worker_resumes(plan, run_dir, capsys)
    assert name == "step-00000020"
    assert "step-00000033 is damaged" in printed and why in printed
    said = _launcher_resumes(plan, run_dir)
    assert "step-00000033 is damaged" in said and why in said and "from step 20" in said
    assert checkpointer.load(run_dir / "checkpoints" / name)["step"] == 20


def test_when_every_checkpoint_is_damaged_resume_refuses_instead_of_starting_over(run, capsys):
    plan, engine, checkpointer, run_dir = run
    only = _save(checkpointer, engine, 20)
    _truncate(only / "engine.pt")
    with pytest.raises(UserError, match="no intact checkpoint") as err:
        _worker_resumes(plan, run_dir, capsys)
    assert "step-00000020" in str(err.value) and "engine.pt" in str(err.value)
    with pytest.raises(UserError, match="no intact checkpoint"):
        _launcher_resumes(plan, run_dir)
    assert _steps(run_dir) == ["step-00000020"]


def test_a_checkpoint_without_manifest_resumes_unverified_unless_older_ones_have_one(run, capsys):
    plan, engine, checkpointer, run_dir = run
    old = _save(checkpointer, engine, 20)
    (old / MANIFEST_FILE).unlink()  # as written before manifests existed
    name, printed = _worker_resumes(plan, run_dir, capsys)
    assert name == "step-00000020" and "unverified" in printed
    write_manifest(old)
    newest = _save(checkpointer, engine, 33)
    (newest / MANIFEST_FILE).unlink()  # newer than a manifested one: not a finished write
    name, printed = _worker_resumes(plan, run_dir, capsys)
    assert name == "step-00000020" and "step-00000033 is damaged" in printed


def test_the_manifest_lists_every_file_and_is_written_last(run):
    _, engine, checkpointer, run_dir = run
    ckpt = _save(checkpointer, engine, 20)
    manifest = json.loads((ckpt / MANIFEST_FILE).read_text())
    on_disk = {p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file()} - {MANIFEST_FILE}
    assert set(manifest["files"]) == on_disk
    assert manifest["bytes"] == sum(f["size"] for f in manifest["files"].values())
    assert manifest_problem(ckpt) is None
    (ckpt / "extra.bin").write_bytes(b"x")  # files the manifest does not know are not judged
    assert manifest_problem(ckpt) is None
    (ckpt / "engine.pt").unlink()
    assert manifest_problem(ckpt, full=False) == "engine.pt is missing"


# --- pruning ----------------------------------------------------------------------------------


def test_pruning_never_deletes_the_newest_intact_checkpoint(run):
    _, engine, checkpointer, run_dir = run  # keep_checkpoints: 2
    _save(checkpointer, engine, 1)
    _truncate(_save(checkpointer, engine, 2) / "engine.pt")
    _save(checkpointer, engine, 3)
    # 3 is intact, 2 damaged: 1 is one of the two newest intact ones and stays.
    assert _steps(run_dir) == ["step-00000001", "step-00000002", "step-00000003"]
    _save(checkpointer, engine, 4)
    assert _steps(run_dir) == ["step-00000003", "step-00000004"]


def test_a_step_saved_again_after_a_fallback_keeps_the_old_one_aside(run, capsys):
    """Step 33 lost only its manifest; the resume falls back to 20 and saves 33 again: the old 33's
    intact weights are moved aside, not deleted."""
    plan, engine, checkpointer, run_dir = run
    _save(checkpointer, engine, 20)
    old = _save(checkpointer, engine, 33)
    (old / MANIFEST_FILE).unlink()
    assert _worker_resumes(plan, run_dir, capsys)[0] == "step-00000020"
    weights = (old / "engine.pt").read_bytes()
    _save(checkpointer, engine, 33)
    aside = run_dir / "checkpoints" / "damaged-step-00000033"
    assert (aside / "engine.pt").read_bytes() == weights and "damaged-step-00000033" in capsys.readouterr().out
    assert rc.inspect_checkpoint(run_dir / "checkpoints" / "step-00000033").intact
    assert _steps(run_dir) == ["step-00000020", "step-00000033"]  # discovery does not count the one aside


# --- 3. disk full during a write -----------------------------------------------------------------


def test_disk_full_while_writing_keeps_the_previous_checkpoint_and_says_so(run, capsys, monkeypatch):
    from orchestrate.launch.resume import failure_notice

    plan, engine, checkpointer, run_dir = run
    _save(checkpointer, engine, 20)
    engine.save_error = OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(UserError, match="step 30 could not be written: no space left on device") as err:
        _save(checkpointer, engine, 30)
    text = str(err.value)
    assert "step-00000020 (step 20) is kept, intact" in text and "df -h" in text
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", "step-00000020"]
    assert rc.inspect_checkpoint(run_dir / "checkpoints" / "step-00000020").intact
    assert _worker_resumes(plan, run_dir, capsys)[0] == "step-00000020"
    # What the launcher adds after the workers failed, when the disk is (nearly) full.
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(100, 100, 0))
    notice = failure_notice(run_dir)
    assert "step-00000020 (step 20): --resume continues from it" in notice
    assert "No space left on device" in notice and "only 0 MiB are free" in notice


def test_the_launcher_reports_the_kept_checkpoint_when_the_workers_fail(run, monkeypatch):
    """`launch`'s second half with a transport whose "workers" hit the full disk in their save."""
    from orchestrate.launch import session
    from orchestrate.launch.session import Prepared, start

    plan, engine, checkpointer, run_dir = run
    _save(checkpointer, engine, 20)

    class DiskFullWorkers:
        def prepare(self, plan, run_dir, env, max_restarts, dry_run):
            return Prepared(command="workers", script="true", script_comment="test")

        def run(self, plan, run_dir, say, console):
            engine.save_error = OSError(errno.ENOSPC, "No space left on device")
            try:
                _save(checkpointer, engine, 30)
            except UserError:
                return 2  # the worker's exit code for a UserError
            return 0

    monkeypatch.setattr("orchestrate.data.pipeline.prepare_for_plan", lambda *a, **k: "data ready")
    monkeypatch.setattr(session, "requeue_code", lambda run_dir, code, say: code)
    result = start(plan, run_dir, DiskFullWorkers())
    assert result.exit_code == 2
    assert any("newest intact checkpoint is" in m and "step-00000020" in m for m in result.messages)


# --- loading errors after verification ----------------------------------------------------------


def test_an_engine_that_fails_to_load_a_verified_checkpoint_is_a_user_error(run):
    _, engine, checkpointer, run_dir = run
    ckpt = _save(checkpointer, engine, 20)
    engine.load_error = RuntimeError("Failed to read the DCP shard")
    with pytest.raises(UserError, match="passed its checks but cannot be loaded") as err:
        checkpointer.load(ckpt)
    assert "Failed to read the DCP shard" in str(err.value) and "--step N" in str(err.value)
    engine.load_error = KeyError("step")
    with pytest.raises(UserError, match="cannot be loaded"):
        checkpointer.load(ckpt)


# --- real DCP files: FSDP2 on one gloo rank in this process ---------------------------------------


@pytest.fixture
def fsdp_run(tmp_path):
    """A run with FSDP2 checkpoints of steps 1 and 2 (real .distcp shards), made on one gloo rank."""
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    from orchestrate.backends.fsdp import FSDPBackend
    from tests.helpers.plans import TINY_GPT2

    arch = dict(TINY_GPT2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(arch.pop("model_type"), **arch)).save_pretrained(
        tmp_path / "init")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        plan = make_plan(FSDP, ranks=1)
        engine = setup_engine(FSDPBackend(), plan, cpu_rank(), tmp_path / "init")
        checkpointer = ck.Checkpointer(plan, engine, cpu_rank(), tmp_path / "run", tmp_path / "init")
        ids = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(0))
        for step in (1, 2):
            engine.train_step([{"input_ids": ids, "labels": ids}] * plan.chosen.gradient_accumulation)
            checkpointer.save(step, dict(SAMPLER))
        yield tmp_path / "run"
    finally:
        dist.destroy_process_group()


def test_export_skips_a_truncated_distcp_and_a_verified_but_unreadable_one_is_a_user_error(fsdp_run, tmp_path):
    from orchestrate.export import export_checkpoint

    newest = fsdp_run / "checkpoints" / "step-00000002"
    shard = sorted(newest.rglob("*.distcp"))[0]
    _truncate(shard)
    said: list[str] = []
    used = export_checkpoint(fsdp_run, tmp_path / "out", say=said.append)
    assert used.name == "step-00000001" and (tmp_path / "out" / "model.safetensors").is_file()
    assert any("step-00000002 is damaged" in s and shard.name in s for s in said)
    with pytest.raises(UserError, match="step 2 is damaged"):
        export_checkpoint(fsdp_run, tmp_path / "out2", step=2)
    # Damage the manifest agrees with (as if the write itself had been wrong): DCP fails to read it.
    shard.write_bytes(shard.read_bytes()[:64])
    write_manifest(newest)
    with pytest.raises(UserError, match="passed its checks but cannot be read") as err:
        export_checkpoint(fsdp_run, tmp_path / "out3")
    assert "--step N" in str(err.value)


def test_disk_full_inside_dcp_is_recognised_through_its_checkpoint_exception(run):
    """DCP gathers each rank's failure as an (exception, traceback summary) pair."""
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    _, engine, checkpointer, run_dir = run
    _save(checkpointer, engine, 20)
    try:
        raise OSError(errno.ENOSPC, "No space left on device")
    except OSError as exc:
        wrapped = _wrap_exception(exc)
    engine.save_error = CheckpointException("write_data", {0: wrapped, 1: wrapped})
    with pytest.raises(UserError, match="no space left on device"):
        _save(checkpointer, engine, 30)
    assert _steps(run_dir) == ["step-00000020"] and not list((run_dir / "checkpoints").glob(".tmp-*"))


@pytest.mark.parametrize(("free", "said"), [(0, "no space left on device"), (2**40, "Input/output error")])
def test_torch_saves_runtime_error_on_a_refused_write_is_recognised(run, monkeypatch, free: int, said: str):
    """torch.save(obj, path) (DeepSpeed's files, DDP's trainer_state.pt) reports a refused write as a
    RuntimeError without errno; here a real one, from writing to /dev/full (ENOSPC on every write)."""
    _, engine, checkpointer, run_dir = run
    _save(checkpointer, engine, 20)
    with pytest.raises(RuntimeError) as real:
        torch.save({"w": torch.zeros(100_000)}, "/dev/full")
    engine.save_error = real.value
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(2**41, 2**41 - free, free))
    with pytest.raises(UserError, match=f"step 30 could not be written: {said}") as err:
        _save(checkpointer, engine, 30)
    assert "step-00000020 (step 20) is kept, intact" in str(err.value)
    assert _steps(run_dir) == ["step-00000020"] and not list((run_dir / "checkpoints").glob(".tmp-*"))


# --- a run still training prunes checkpoints under the export -----------------------------------


def test_export_falls_back_when_the_run_prunes_the_checkpoint_it_is_reading(fsdp_run, tmp_path, monkeypatch):
    """keep_checkpoints 1 of a running job: step 2 is pruned while export reads it; it exports step 1
    (in the real race, the step that replaced it) instead of failing."""
    from orchestrate import export

    real = export.read_model_state
    calls: list[Path] = []

    def pruned_while_read(ckpt: Path):
        calls.append(ckpt)
        if len(calls) == 1:
            shutil.rmtree(ckpt)  # what _prune does, after renaming it to .old-*
        return real(ckpt)

    monkeypatch.setattr(export, "read_model_state", pruned_while_read)
    said: list[str] = []
    used = export.export_checkpoint(fsdp_run, tmp_path / "out", say=said.append)
    assert [c.name for c in calls] == ["step-00000002", "step-00000001"] and used.name == "step-00000001"
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert any("was removed while it was read" in s for s in said)


def test_discovery_rescans_when_the_only_checkpoint_is_replaced_during_the_scan(fsdp_run, tmp_path, monkeypatch):
    """keep_checkpoints 1: between listing and reading, step 2 is pruned and step 3 published."""
    from orchestrate.export import export_checkpoint

    root = fsdp_run / "checkpoints"
    shutil.rmtree(root / "step-00000001")
    real = rc.inspect_checkpoint

    def replaced_meanwhile(ckpt: Path, full: bool = True):
        if ckpt.name == "step-00000002":
            newer = root / "step-00000003"
            (ckpt / "manifest.json").unlink()
            ckpt.rename(newer)
            meta = json.loads((newer / "meta.json").read_text())
            (newer / "meta.json").write_text(json.dumps({**meta, "step": 3}))
            write_manifest(newer)
        return real(ckpt, full)

    monkeypatch.setattr(rc, "inspect_checkpoint", replaced_meanwhile)
    said: list[str] = []
    used = export_checkpoint(fsdp_run, tmp_path / "out", say=said.append)
    assert used.name == "step-00000003" and not any("damaged" in s for s in said), said
