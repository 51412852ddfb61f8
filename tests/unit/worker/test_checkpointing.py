"""Checkpoint protocol (orchestrate.worker.checkpointing): atomic publish, `latest` last, pruning,
crashes at every stage leaving the previous checkpoint loadable, RNG restore, resume compatibility
checks, metrics truncation, weights-only loading, stop signals and the REQUEUE marker, choosing the
run to resume; and (slow) a rank killed while 2 FSDP ranks write a DCP checkpoint."""

from __future__ import annotations

import json
import os
import pickle
import random
import signal
from pathlib import Path

import pytest
import torch

from orchestrate.errors import UserError
from orchestrate.planner.strategy import Strategy
from orchestrate.run import checkpoints as rc
from orchestrate.run.checkpoints import CheckpointMeta
from orchestrate.run.resume_rules import resume_problems
from orchestrate.worker import checkpointing as ck
from tests.helpers.engines import cpu_rank, setup_engine
from tests.helpers.plans import make_plan

FSDP = Strategy("fsdp", 3, "none", "none", "fp32", False, 2)
DEEPSPEED = Strategy("deepspeed", 2, "none", "none", "fp32", False, 2)


class FakeEngine:
    """A TrainEngine's checkpoint half over one tensor."""

    def __init__(self) -> None:
        self.weights = torch.zeros(4)
        self.fail_save = False

    def save_checkpoint(self, ckpt_dir: Path, client_state: dict) -> None:
        torch.save({"w": self.weights.clone()}, ckpt_dir / "engine.pt")
        if self.fail_save:
            raise RuntimeError("injected crash while writing")
        (ckpt_dir / "client_state.json").write_text(json.dumps(client_state))

    def load_checkpoint(self, ckpt_dir: Path) -> dict:
        self.weights = torch.load(ckpt_dir / "engine.pt", weights_only=True)["w"]
        return json.loads((ckpt_dir / "client_state.json").read_text())


@pytest.fixture
def single(tmp_path):
    """(plan, engine, checkpointer) for one process without a process group."""
    model_dir = tmp_path / "init"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    plan = make_plan(FSDP, ranks=1, config={"train": {"keep_checkpoints": 2}})
    engine = FakeEngine()
    return plan, engine, ck.Checkpointer(plan, engine, cpu_rank(), tmp_path / "run", model_dir)


def _save(checkpointer, engine, step: int) -> Path:
    engine.weights = torch.full((4,), float(step))
    return checkpointer.save(step, {"epoch": 0, "position": step * 8, "seed": 0, "num_blocks": 100})


def _names(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def test_saves_publish_atomically_keep_the_last_k_and_restore_everything(single, tmp_path):
    plan, engine, checkpointer = single
    run_dir = tmp_path / "run"
    for step in (1, 2, 3, 4):
        _save(checkpointer, engine, step)
    assert _names(run_dir) == ["latest", "step-00000003", "step-00000004"]
    latest = rc.latest_checkpoint(run_dir)
    assert latest.name == "step-00000004"
    meta = rc.read_meta(latest)
    assert (meta.step, meta.world_size, meta.backend) == (4, 1, "fsdp")
    assert meta.sampler["position"] == 32
    assert json.loads((latest / "plan.json").read_text())["chosen"] == plan.chosen.name

    expected = (torch.rand(3), random.random())
    torch.manual_seed(123)
    random.seed(123)
    engine.weights = torch.zeros(4)
    restored = checkpointer.load(latest)
    assert restored == {"step": 4, "sampler": {"epoch": 0, "position": 32, "seed": 0, "num_blocks": 100}}
    assert torch.equal(engine.weights, torch.full((4,), 4.0))
    # The generators continue exactly where they were when the checkpoint was written.
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]


class _KeepingObjective:
    """An objective keeping state between steps (backends/base.py `StatefulObjective`)."""

    name = "keeping"

    def __init__(self, state: dict | None = None) -> None:
        self.state = state or {}
        self.loaded: list[dict] = []

    def loss(self, model, batch):
        raise NotImplementedError("never trained here: only its state is checkpointed")

    def eval_sums(self, model, batch):
        raise NotImplementedError("never evaluated here")

    def metrics(self, sums, batches):
        raise NotImplementedError("never evaluated here")

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.loaded.append(state)


def test_an_objective_s_state_is_saved_per_rank_and_read_back_weights_only(single, tmp_path):
    _, engine, checkpointer = single
    kept = {"kept": [{"ids": torch.arange(6).view(2, 3), "positions": 4}], "divisor": 2.5}
    engine.objective = _KeepingObjective(kept)
    ckpt = _save(checkpointer, engine, 1)
    assert rc.inspect_checkpoint(ckpt).verified  # the manifest lists it: complete or absent with the rest
    assert "ranks/objective-00000.pt" in json.loads((ckpt / rc.MANIFEST_FILE).read_text())["files"]

    engine.objective = _KeepingObjective()
    checkpointer.load(ckpt)
    [state] = engine.objective.loaded
    assert state["divisor"] == 2.5 and state["kept"][0]["positions"] == 4
    assert torch.equal(state["kept"][0]["ids"], kept["kept"][0]["ids"])

    # Code in the file is refused (weights_only), as a checkpoint that cannot be loaded.
    torch.save({"x": _Evil()}, rc.objective_file(ckpt, 0))
    with pytest.raises(UserError, match="cannot be loaded"):
        checkpointer.load(ckpt)


def test_a_checkpoint_from_before_objectives_kept_state_still_loads(single, tmp_path):
    """A checkpoint without the objective's file (as written before objectives kept state) loads; the
    objective is not handed anything (it goes on as built and says what that changes)."""
    _, engine, checkpointer = single
    ckpt = _save(checkpointer, engine, 1)  # an engine whose objective keeps no state writes no file
    assert not rc.objective_file(ckpt, 0).exists()
    engine.objective = _KeepingObjective()
    assert checkpointer.load(ckpt)["step"] == 1
    assert engine.objective.loaded == []


def test_a_crash_while_writing_leaves_the_previous_checkpoint(single, tmp_path):
    _, engine, checkpointer = single
    run_dir = tmp_path / "run"
    _save(checkpointer, engine, 4)
    engine.fail_save = True
    with pytest.raises(RuntimeError, match="injected"):
        _save(checkpointer, engine, 5)
    assert _names(run_dir) == [".tmp-step-00000005", "latest", "step-00000004"]
    assert checkpointer.load(rc.latest_checkpoint(run_dir))["step"] == 4
    assert torch.equal(engine.weights, torch.full((4,), 4.0))
    engine.fail_save = False
    _save(checkpointer, engine, 5)  # the next save clears what the crash left
    assert _names(run_dir) == ["latest", "step-00000004", "step-00000005"]


def test_a_crash_between_rename_and_latest_keeps_latest_on_the_previous(single, tmp_path, monkeypatch):
    _, engine, checkpointer = single
    run_dir = tmp_path / "run"
    _save(checkpointer, engine, 4)

    def crash(root, name):
        raise KeyboardInterrupt("killed before `latest` moved")

    monkeypatch.setattr(ck, "_point_latest", crash)
    with pytest.raises(KeyboardInterrupt):
        _save(checkpointer, engine, 8)
    assert (run_dir / "checkpoints" / "step-00000008").is_dir()  # complete, but not named by latest
    assert rc.latest_checkpoint(run_dir).name == "step-00000004"
    monkeypatch.undo()
    assert checkpointer.load(rc.latest_checkpoint(run_dir))["step"] == 4
    _save(checkpointer, engine, 8)  # the resumed run writes step 8 again over the stale copy
    assert rc.latest_checkpoint(run_dir).name == "step-00000008"
    assert checkpointer.load(rc.latest_checkpoint(run_dir))["step"] == 8


def test_a_run_directory_other_nodes_cannot_see_is_refused_at_the_first_save(single, tmp_path):
    plan, engine, checkpointer = single
    # Rank 1 of 2 "wrote" its files on another node's local disk: rank 0 cannot see them.
    checkpointer.rank = cpu_rank(0, 2)
    with pytest.raises(UserError, match="shared file system"):
        _save(checkpointer, engine, 1)
    assert rc.latest_checkpoint(tmp_path / "run") is None


def test_missing_checkpoints_are_clear_errors(single, tmp_path):
    _, engine, checkpointer = single
    run_dir = tmp_path / "run"
    assert rc.latest_checkpoint(run_dir) is None
    with pytest.raises(UserError, match="no checkpoint to use"):
        rc.find_checkpoint(run_dir)
    _save(checkpointer, engine, 2)
    with pytest.raises(UserError, match="steps: 2"):
        rc.find_checkpoint(run_dir, step=3)
    # A dangling `latest` is only a hint gone stale: discovery still finds step 2.
    (run_dir / "checkpoints" / "latest").write_text("step-00000009\n")
    assert rc.latest_checkpoint(run_dir) is None
    assert rc.find_checkpoint(run_dir).chosen.path.name == "step-00000002"


def test_resume_problems_name_what_differs():
    base = make_plan(FSDP, ranks=2)
    meta = CheckpointMeta.of(base, 4, 2, {}, torch.__version__)
    assert resume_problems(meta, base) == []
    assert resume_problems(meta, make_plan(FSDP, ranks=1)) == []  # a new world size reshards
    cases = {
        "train.seq_len": make_plan(FSDP, config={"train": {"seq_len": 16}}),
        "train.global_batch_size": make_plan(FSDP, config={"train": {"global_batch_size": 16}}),
        "train.max_steps": make_plan(FSDP, config={"train": {"max_steps": 3}}),
        "strategy.backend": make_plan(DEEPSPEED),
        "train.precision": make_plan(Strategy("fsdp", 3, "none", "none", "bf16", False, 2)),
        "model": make_plan(FSDP, config={"model": {"architecture": {
            "model_type": "gpt2", "n_embd": 64, "n_layer": 3, "n_head": 4, "n_positions": 64, "vocab_size": 257}}}),
    }
    for where, plan in cases.items():
        problems = resume_problems(meta, plan)
        assert [p.where for p in problems] == [where], (where, problems)
    stage = resume_problems(CheckpointMeta.of(make_plan(DEEPSPEED), 4, 2, {}, torch.__version__),
                               make_plan(Strategy("deepspeed", 3, "none", "none", "fp32", False, 2)))
    assert [p.where for p in stage] == ["strategy.zero_stage"]
    assert "num_layers 2 -> 3" in resume_problems(meta, cases["model"])[0].message


def test_metrics_writer_keeps_steps_up_to_the_resumed_one(tmp_path):
    from orchestrate.worker.metrics import MetricsWriter

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": float(s)}) + "\n" for s in range(1, 7)) + '{"step": 7, "lo')
    writer = MetricsWriter(path, resume_step=4)
    writer.write({"step": 5, "loss": 50.0})
    writer.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in records] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 50.0)]
    MetricsWriter(path).close()  # a fresh run starts the file afresh
    assert path.read_text() == ""


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo this-must-not-run",))


def test_checkpoint_loads_are_weights_only_even_inside_deepspeed_and_dcp(tmp_path):
    from orchestrate.backends.safe_load import weights_only_loads

    evil = tmp_path / "evil.pt"
    torch.save({"model": {}, "x": _Evil()}, evil)
    original = torch.load
    with weights_only_loads(), pytest.raises(pickle.UnpicklingError, match="posix.system|os.system"):
        torch.load(evil, weights_only=False)  # what DeepSpeed and DCP's planner ask for
    assert torch.load is original
    fine = tmp_path / "fine.pt"
    torch.save({"w": torch.ones(2), "lr": 0.1, "betas": (0.9, 0.95)}, fine)
    with weights_only_loads():
        assert torch.load(fine, weights_only=False)["betas"] == (0.9, 0.95)


def test_ddp_checkpoint_with_foreign_code_is_refused(tmp_path):
    from orchestrate.backends.ddp import DDPEngine

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    torch.save({"model": _Evil()}, ckpt / "trainer_state.pt")
    engine = DDPEngine.__new__(DDPEngine)
    engine.rank = cpu_rank()
    with pytest.raises(pickle.UnpicklingError):
        engine.load_checkpoint(ckpt)


def test_stop_request_signal_marker_and_grace(single, tmp_path):
    from orchestrate.run.layout import clear_requeue, read_requeue
    from orchestrate.worker.signals import StopRequest

    plan, engine, checkpointer = single
    run_dir = tmp_path / "run"
    # Earlier in-process launches (torchrun's elastic agent) may have installed their own SIGUSR1
    # handler: uninstall must restore whatever was there, not necessarily the default.
    before = signal.getsignal(signal.SIGUSR1)
    stop = StopRequest().install()
    try:
        assert stop.agreed(torch.device("cpu"), None) == (False, 0.0, None)
        os.kill(os.getpid(), signal.SIGUSR1)
        stopping, waited, save_s = stop.agreed(torch.device("cpu"), 2.5)
        assert stopping and waited >= 0 and save_s == 2.5 and stop.signal_name == "SIGUSR1"
    finally:
        stop.uninstall()
    assert signal.getsignal(signal.SIGUSR1) is before

    _save(checkpointer, engine, 4)
    grace = plan.config.train.preemption_grace_s
    # Writing would outlast the grace period: no new checkpoint, resume from step 4.
    record = _stop_early(plan, checkpointer, 6, grace - 1.0, 5.0, stop, run_dir)
    assert record["step"] == 4 and record["stopped_at"] == 6
    assert read_requeue(run_dir)["step"] == 4 and rc.latest_checkpoint(run_dir).name == "step-00000004"
    # It fits: checkpoint at the step the ranks agreed on.
    record = _stop_early(plan, checkpointer, 7, 1.0, 5.0, stop, run_dir)
    assert record["step"] == 7 == rc.read_meta(rc.latest_checkpoint(run_dir)).step
    clear_requeue(run_dir)
    assert read_requeue(run_dir) is None


def _stop_early(plan, checkpointer, step, waited_s, save_s, stop, run_dir):
    """The stop-signal callback at a step without a checkpoint of its own, as the loop calls it."""
    from orchestrate.run.layout import RunDir
    from orchestrate.worker.callbacks.base import StepEnd, Training
    from orchestrate.worker.callbacks.standard import StopOnSignal

    callback = StopOnSignal()
    end = StepEnd(step, final=False, stopping=True, record={}, signal_waited_s=waited_s, slowest_save_s=save_s)
    training = Training(plan, cpu_rank(), RunDir(run_dir), checkpointer.engine, _Data(), checkpointer, stop, 0)
    callback.on_step_end(training, end)
    assert end.stop
    return callback.record


class _Data:
    class sampler:  # noqa: N801  (stands in for TrainData.sampler)
        @staticmethod
        def state_dict():
            return {"epoch": 0, "position": 0, "seed": 0, "num_blocks": 100}


def test_resume_picks_the_newest_run_of_the_config_and_refuses_checkpointed_dirs(tmp_path):
    from orchestrate.config.load import config_from_dict
    from orchestrate.launch.resume import refuse_checkpointed, run_to_resume

    config = config_from_dict({"model": {"architecture": {"model_type": "gpt2"}},
                               "train": {"seq_len": 8, "global_batch_size": 2, "output_dir": "runs"}}, tmp_path)
    with pytest.raises(UserError, match="no run of 'tiny'"):
        run_to_resume(config, "tiny", None)
    for name in ("tiny-20260101-120000", "tiny-20260101-120000-2", "tiny-large-20270101-000000",
                 "tiny-20251231-235959"):
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "plan.json").write_text("{}")
    assert run_to_resume(config, "tiny", None).name == "tiny-20260101-120000-2"
    with pytest.raises(UserError, match="holds no plan.json"):
        run_to_resume(config, "tiny", tmp_path / "elsewhere")

    run_dir = tmp_path / "runs" / "tiny-20260101-120000"
    refuse_checkpointed(run_dir)  # no checkpoint: a new launch may reuse the directory
    ckpt = run_dir / "checkpoints" / "step-00000003"
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_text(json.dumps({"step": 3}))
    (run_dir / "checkpoints" / "latest").write_text("step-00000003")
    with pytest.raises(UserError, match="--resume"):
        refuse_checkpointed(run_dir)


# --- 2 gloo ranks --------------------------------------------------------------------------------


def _crash_while_writing(model_dir: str, run_dir: str, phase: str) -> dict:
    """Rank function: FSDP2 trains, checkpoints (step 2), trains on; then either rank 1 dies while
    the ranks write step 3 (phase "crash"), or a fresh engine resumes the latest checkpoint and
    saves step 3 cleanly (phase "resume")."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from orchestrate.backends.fsdp import FSDPBackend
    from tests.helpers.dist import init_gloo

    torch.set_num_threads(1)
    rank, world = init_gloo()
    plan = make_plan(FSDP, ranks=2)
    engine = setup_engine(FSDPBackend(), plan, cpu_rank(rank, world), model_dir)
    checkpointer = ck.Checkpointer(plan, engine, cpu_rank(rank, world), Path(run_dir), Path(model_dir))
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, 257, (2, 32), generator=g)
    batches = [{"input_ids": ids, "labels": ids}] * plan.chosen.gradient_accumulation

    def full() -> dict:
        return get_model_state_dict(engine.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    if phase == "crash":
        for _ in range(2):
            engine.train_step(batches)
        checkpointer.save(2, {"position": 2})
        weights = full()  # collective: every rank gathers, rank 0 keeps them
        if rank == 0:
            torch.save(weights, Path(run_dir) / "weights_at_2.pt")
        engine.train_step(batches)
        save = engine.save_checkpoint

        def dies_half_way(ckpt_dir, client_state):
            save(ckpt_dir, client_state)  # its DCP shard is on disk; the barrier after it never comes
            if rank == 1:
                os._exit(17)

        engine.save_checkpoint = dies_half_way
        checkpointer.save(3, {"position": 3})
        return {}
    restored = checkpointer.load(rc.latest_checkpoint(Path(run_dir)))
    weights = full()
    checkpointer.save(3, restored["sampler"])
    return {"restored": restored, "weights": weights if rank == 0 else None}


@pytest.mark.slow
def test_a_rank_dying_while_fsdp_writes_leaves_the_previous_checkpoint_loadable(tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.helpers.dist import run_on_ranks
    from tests.helpers.plans import TINY_GPT2

    arch = dict(TINY_GPT2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(arch.pop("model_type"), **arch)).save_pretrained(
        tmp_path / "init")
    run_dir = tmp_path / "run"
    with pytest.raises(ChildFailedError):
        run_on_ranks(_crash_while_writing, 2, str(tmp_path / "init"), str(run_dir), "crash")
    assert rc.latest_checkpoint(run_dir).name == "step-00000002"
    assert (run_dir / "checkpoints" / ".tmp-step-00000003").is_dir()  # the half-written one, unpublished

    out = run_on_ranks(_crash_while_writing, 2, str(tmp_path / "init"), str(run_dir), "resume")
    assert out[0]["restored"]["step"] == 2 and out[1]["restored"]["sampler"] == {"position": 2}
    expected = torch.load(run_dir / "weights_at_2.pt", weights_only=True)
    assert all(torch.equal(out[0]["weights"][k], expected[k]) for k in expected)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "latest", "step-00000002", "step-00000003"]
