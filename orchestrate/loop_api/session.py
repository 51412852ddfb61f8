"""`orchestrate.prepare` / `backward` / `save` / `load`: the user's loop under the plan of the launch
that started this process (`orchestrate.loop_api.run` recorded its path).

prepare: the plan -> the lock check -> the process group the backend asks for
(`Backend.process_group`, as the worker starts it) -> rank 0's weights everywhere -> the backend
(`wrap.py`) -> the optimizer that accumulates and clips as planned (`optim.py`) -> the loader with a
DistributedSampler and the planned micro-batch (`loader.py`).

save / load reuse the worker's checkpoint protocol (`orchestrate.worker.checkpointing.Checkpointer`:
atomic write, manifest, `latest`, pruning, RNG of every rank) with the backend's engine state
(DeepSpeed's own checkpoint, DCP for FSDP2/DDP), into DIR/checkpoints/step-N. DIR defaults to the
run directory, so `orchestrate launch CONFIG --resume --run-dir RUN_DIR -- python train.py`
continues where the script saved.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orchestrate.loop_api.launch_state as launch_state
from orchestrate.backends.deepspeed_backend import DeepSpeedTrainEngine
from orchestrate.errors import Problem, UserError
from orchestrate.loop_api.loader import distributed_loader
from orchestrate.loop_api.optim import DeepSpeedOptimizer, PlannedOptimizer
from orchestrate.loop_api.torch_state import TorchLoopState
from orchestrate.loop_api.wrap import broadcast_from_rank0, grad_scaler, wrap_ddp, wrap_deepspeed, wrap_fsdp
from orchestrate.run.layout import RunDir
from orchestrate.worker.objective import plain_objective

if TYPE_CHECKING:
    import torch

    from orchestrate.backends.rank import Rank
    from orchestrate.loop_api.loader import EpochLoader
    from orchestrate.planner.plan import RunPlan

_LAUNCH_FIX = "start the script with `orchestrate launch CONFIG.yaml -- python SCRIPT ARGS`"


@dataclass
class Session:
    plan: RunPlan
    rank: Rank
    run: RunDir
    model: Any
    optimizer: Any
    """optim.PlannedOptimizer or optim.DeepSpeedOptimizer: what the user's loop steps."""
    loader: EpochLoader | None
    state: Any
    """What the Checkpointer saves the engine with: torch_state.TorchLoopState or the backend's DeepSpeedTrainEngine."""


def _plan_path() -> Path:
    if launch_state.session is not None:
        raise UserError("orchestrate.prepare was called twice", [Problem(
            "orchestrate.prepare", "this process has prepared a model, optimizer and loader already",
            "call prepare once, with the model, the optimizer and the loader together")])
    if launch_state.plan_path is None:
        raise UserError("orchestrate.prepare needs a plan: this script was not started by `orchestrate launch`", [
            Problem("orchestrate.prepare", "no plan was handed to this process", _LAUNCH_FIX)])
    return launch_state.plan_path


def _check_size(plan: RunPlan, parameters: int, warn: bool) -> None:
    """The plan's memory is for the YAML's model. `model.module` names the script's own module: it must
    be that module (an error with the numbers); an HF model stands in for it: a warning when far off."""
    planned, module = plan.shape.parameters, plan.config.model.module
    if module is not None and parameters != planned:
        raise UserError("orchestrate.prepare got another module than the plan's", [Problem(
            "model.module", f"the plan is for {module} with {planned:,} parameters; the module given to prepare "
            f"has {parameters:,}", "build the script's model as model.module and model.kwargs describe it "
            "(the same class and arguments), or change them to match the script")])
    if warn and not planned / 2 <= parameters <= planned * 2:
        print(f"orchestrate: warning: the plan's memory estimate is for the YAML's model ({planned:,} parameters); "
              f"the module given to prepare has {parameters:,}: name it in model.module (docs/own-loop.md)", flush=True)


def _input_dtype(plan: RunPlan) -> Any:
    """The dtype float inputs need: DeepSpeed's bf16/fp16 modes cast the module itself and do not
    autocast (DDP autocasts, FSDP2's MixedPrecisionPolicy casts the inputs), so its inputs must match."""
    import torch

    strategy = plan.strategy
    if strategy.backend != "deepspeed":
        return None
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(strategy.precision)


def _wrap(plan: RunPlan, model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: Rank,
          run: RunDir) -> tuple[Any, Any, Any]:
    """(wrapped model, the optimizer the loop steps, the engine state a checkpoint saves)."""
    backend = plan.strategy.backend
    if backend == "deepspeed":
        engine = wrap_deepspeed(plan, model, optimizer)
        # Your loop computes its own loss: the engine's objective is never called (a placeholder); your
        # module has no Hugging Face config (orchestrate.save writes its checkpoints, never save_hf_model).
        return engine, DeepSpeedOptimizer(engine), DeepSpeedTrainEngine(engine, plan, rank, run.path,
                                                                         plain_objective(plan), hf_config=None)

    wrapped = wrap_fsdp(plan, model, optimizer, rank.device) if backend == "fsdp" else \
        wrap_ddp(plan, model, rank.device)
    scaler = grad_scaler(plan, rank.device)
    stepper = PlannedOptimizer(optimizer, wrapped, plan.chosen.gradient_accumulation, plan.config.train.grad_clip,
                               scaler)
    return wrapped, stepper, TorchLoopState(wrapped, optimizer, scaler, rank.rank)


def prepare(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loader: Any = None) -> tuple[Any, Any, Any]:
    """The model, optimizer and loader wrapped for the plan's backend, precision, offload and
    gradient accumulation; the loader (optional) sharded with a DistributedSampler. Collective."""
    import torch

    from orchestrate.worker import stages

    plan, run = stages.read_plan(_plan_path())
    stages.check_run_dir(run)
    rank = stages.start_process_group(plan)
    chosen, train = plan.chosen, plan.config.train
    # Every rank checks (each raises, none waits in a collective); rank 0 alone warns.
    _check_size(plan, sum(p.numel() for p in model.parameters()), rank.is_main)
    broadcast_from_rank0(model)
    wrapped, stepper, state = _wrap(plan, model, optimizer, rank, run)
    sharded = None
    if loader is not None:
        sharded = distributed_loader(loader, chosen.strategy.micro_batch_size, rank.rank, rank.world_size,
                                     train.seed, rank.device, _input_dtype(plan))
        if rank.is_main and loader.batch_size != sharded.batch_size:
            print(f"orchestrate: batches of {sharded.batch_size} per rank (the plan's micro-batch; the loader asked "
                  f"for {loader.batch_size}), {chosen.gradient_accumulation} per step on {rank.world_size} "
                  f"rank(s): {train.global_batch_size} samples per optimizer step", flush=True)
    torch.manual_seed(train.seed + rank.rank)  # as the worker: dropout differs per rank (other data), reproducibly
    launch_state.session = Session(plan, rank, run, wrapped, stepper, sharded, state)
    return wrapped, stepper, sharded


def _session(what: str) -> Session:
    if launch_state.session is None:
        raise UserError(f"orchestrate.{what} before orchestrate.prepare", [Problem(
            f"orchestrate.{what}", "nothing is prepared in this process",
            "call `model, optimizer, loader = orchestrate.prepare(model, optimizer, loader)` first")])
    return launch_state.session


def backward(loss: torch.Tensor) -> None:
    """`loss.backward()` as the plan needs it: divided over the accumulated micro-batches, fp16
    loss-scaled, or DeepSpeed's `engine.backward`."""
    _session("backward").optimizer.backward(loss)


def _checkpointer(session: Session, directory: str | Path | None) -> Any:
    from orchestrate.worker.checkpointing import Checkpointer

    root = Path(directory).resolve() if directory is not None else session.run.path
    return Checkpointer(session.plan, session.state, session.rank, root, root)


def save(directory: str | Path | None = None, **state: Any) -> Path:
    """A resumable checkpoint of model, optimizer, loader position, every rank's RNG and `state`
    (JSON values, e.g. epoch=3) into DIRECTORY/checkpoints/step-N (default: the run directory), named
    by the optimizer steps taken; atomic. Collective: every rank calls it at the same point."""
    try:
        json.dumps(state)
    except (TypeError, ValueError) as exc:
        raise UserError("orchestrate.save keeps JSON values only", [Problem(
            "orchestrate.save(**state)", str(exc),
            "pass numbers, strings, lists or dicts (model, optimizer, loader and RNG are saved already)")]) from None
    session = _session("save")
    loader = session.loader.state_dict() if session.loader is not None else None
    return _checkpointer(session, directory).save(session.optimizer.steps, {"loader": loader, "user": state})


def load(directory: str | Path | None = None) -> dict[str, Any] | None:
    """Restore the newest intact checkpoint of DIRECTORY (default: the run directory); returns the
    `state` given to `save` plus "step", or None when there is none (a fresh start). Collective."""
    from orchestrate.worker.stages import checkpoint_to_resume

    session = _session("load")
    checkpointer = _checkpointer(session, directory)
    found = checkpoint_to_resume(session.plan, RunDir(checkpointer.run_dir), session.rank)
    if found is None:
        return None
    restored = checkpointer.load(found)
    session.optimizer.restore(restored["step"])
    saved = restored["sampler"]
    if session.loader is not None and saved["loader"] is not None:
        session.loader.load_state_dict(saved["loader"])
    return {**saved["user"], "step": restored["step"]}
