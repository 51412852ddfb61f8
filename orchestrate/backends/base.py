"""The one small Protocol every backend implements, and the registry that finds them.

A backend has two halves that live in one file:
- `render(plan)`: pure, launcher side. Returns the backend's config files (name -> text), e.g.
  DeepSpeed's JSON, so the user can read, diff and reuse exactly what will run.
- `setup(plan, rank, model_dir, objective, build_model)`: worker side. Asks `build_model` (the run's
  base method's, orchestrate/methods/runtime.py) for the model as a `ModelRequest` says (built from
  `model_dir` without N full copies in CPU RAM), wraps it, creates the optimizer and schedule, and
  returns a `TrainEngine` training `objective`. It never asks which method trains: the method's
  builder and transforms decide, and the method saves what it owns from `TrainEngine.model_state`.

Adding a backend = one new file defining `BACKEND`, named in `orchestrate.backends.registry`
(or, from another package, in the `orchestrate.backends` entry-point group), plus its tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from orchestrate.errors import Problem, UserError

if TYPE_CHECKING:
    import torch

    from orchestrate.backends.hf_io import StateLayout
    from orchestrate.backends.rank import Rank
    from orchestrate.planner.plan import RunPlan
    from orchestrate.planner.strategy import Sharding, Strategy
    from orchestrate.run.checkpoints import CheckpointMeta


class Objective(Protocol):
    """What a batch's loss is, and what evaluation measures (one per model.task in
    orchestrate/worker/objective.py; a training method's in its folder)."""

    name: str

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The scalar loss of one micro-batch (already on the model's device)."""
        ...

    def eval_sums(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """Additive evaluation sums of one batch, "loss" among them; the same keys on every rank."""
        ...

    def metrics(self, sums: dict[str, float], batches: int) -> dict[str, float]:
        """The record's eval_* entries from the sums over `batches` batches of all ranks."""
        ...


@runtime_checkable
class StepObjective(Objective, Protocol):
    """An objective that sees a step's micro-batches before the first one's loss: every engine calls
    `begin_step` at the start of `train_step`, on every rank (GRPO's rollout phase samples the whole
    step's completions there, with the weights gathered once: methods/grpo/objective.py)."""

    def begin_step(self, model: torch.nn.Module, micro_batches: list[dict[str, torch.Tensor]]) -> None:
        """Called with the wrapped model and the step's micro-batches (on the rank's device); may be collective."""
        ...


@runtime_checkable
class StatefulObjective(Objective, Protocol):
    """An objective that carries state from one step to the next which a resumed run needs to train as
    the uninterrupted one would (GRPO's rollouts, kept over a num_iterations cycle: methods/grpo/
    objective.py). Every checkpoint holds each rank's `state_dict()` (ranks/objective-NNNNN.pt, written
    with torch.save: tensors, numbers, strings, lists and dicts of them), and a run resumed on as many
    ranks hands it back to `load_state_dict` (read with torch.load(weights_only=True), on the rank's
    device) before its first step. A checkpoint without that file (written before objectives kept state,
    or on another number of ranks) calls nothing: the objective goes on as built and says what that
    changes. Its state is taken after the step's callbacks measured it (worker/callbacks/base.py: the
    checkpoint is the PERSIST phase)."""

    def state_dict(self) -> dict[str, Any]:
        """This rank's state after the step just ended (may be empty)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's `state_dict` of this rank."""
        ...


def stateful_objective(engine: object) -> StatefulObjective | None:
    """The engine's objective where it keeps state a checkpoint must hold (None: it keeps none; an
    engine stand-in without an objective keeps none)."""
    objective = getattr(engine, "objective", None)
    return objective if isinstance(objective, StatefulObjective) else None


def begin_step(engine: TrainEngine, micro_batches: list[dict[str, torch.Tensor]]) -> None:
    """The objective's look at the step before its first loss (`StepObjective`): every engine's
    `train_step` starts with it."""
    if isinstance(engine.objective, StepObjective):
        engine.phase = "rollout"
        engine.objective.begin_step(engine.model, micro_batches)


@dataclass(frozen=True)
class ModelRequest:
    """How a backend wants the model it wraps.

    replicated: whole on `device` in `dtype` (DDP: fp32 weights; the frozen input embedding on the
      CPU with `embedding_offload`).
    sharded: on the meta device, to be `fully_shard`ed; `BuiltModel.fill` then allocates the shards
      (on the CPU with `cpu_offload`) and reads each rank's rows (FSDP2).
    engine: for `deepspeed.initialize`, which casts, moves and partitions it: loaded whole on
      `device` in `dtype`, or, with `zero_init` (ZeRO-3's engine config), built inside
      `deepspeed.zero.Init` and loaded shard by shard into the partitions.
    """

    layout: Literal["replicated", "sharded", "engine"]
    device: torch.device
    rank: int
    model_dir: Path
    """The initial weights (config.json, and the weights unless the backend builds from the config)."""
    dtype: torch.dtype | None = None
    embedding_offload: bool = False
    cpu_offload: bool = False
    zero_init: dict[str, Any] | None = None


@dataclass
class BuiltModel:
    model: torch.nn.Module
    """Transformed (adapters...), not yet wrapped."""
    config: Any
    """What the saved model's config.json is written from: the Hugging Face config, or your module's
    description (methods/custom/module.py ModuleConfig)."""
    layout: StateLayout | None = None
    """The untransformed model's state-dict keys and ties (checkpoints, the merged export); None for an
    engine build, whose engine keeps its own."""
    fill: Callable[[torch.nn.Module], None] | None = None
    """sharded: allocate the shards and fill them, called once `fully_shard` wrapped the model."""
    keep_alive: Any = None
    """An object that must live as long as the engine (transformers' HfDeepSpeedConfig weakref)."""


ModelBuilder = Callable[[ModelRequest], BuiltModel]
"""The run's base method's model builder (`MethodRuntime.build_model` given the plan), handed to
`Backend.setup` by the worker."""


@dataclass(frozen=True)
class StepResult:
    loss: float
    """Mean training loss over this rank's micro-batches of the step (not yet averaged over ranks)."""
    grad_norm: float
    """Global gradient norm before clipping (nan when unknown)."""
    lr: float
    """Learning rate used for this step."""
    skipped: bool = False
    """True when fp16 loss scaling found inf/nan and skipped the update."""


@runtime_checkable
class TrainEngine(Protocol):
    model: torch.nn.Module
    """The wrapped module; calling it with input_ids/labels returns an HF output with `.loss`."""

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> StepResult:
        """One optimizer step over the given micro-batches (gradient accumulation inside)."""
        ...

    objective: Objective
    """What a batch's loss and evaluation metrics are."""

    phase: str
    """Where `train_step` is: "rollout" (a `StepObjective`'s `begin_step`), "forward", "backward" or
    "optimizer" (set as it goes; an out-of-memory
    error is reported with it, worker/oom.py)."""

    def eval_sums(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """The objective's evaluation sums of one batch without gradients (this rank only; "loss" among them)."""
        ...

    model_dir: Path
    """The initial weights it started from (a method that trains on a frozen base re-reads it there)."""

    hf_config: Any
    """What a saved model's config.json is written from (`BuiltModel.config`)."""

    def model_state(self, trainable_only: bool = False) -> dict[str, torch.Tensor]:
        """The consolidated state dict of the model as it trains, on rank 0 (empty on the others);
        `trainable_only`: its parameters that train (`requires_grad`), nothing frozen. Collective."""
        ...

    def save_hf_model(self, out_dir: Path) -> None:
        """Write the model as it trains as a consolidated Hugging Face model directory (safetensors +
        config.json) from rank 0. Collective: every rank must call it."""
        ...

    def save_checkpoint(self, ckpt_dir: Path, client_state: dict[str, Any]) -> None:
        """Write a resumable sharded checkpoint (model, optimizer, scheduler, scaler) into ckpt_dir; of
        a model whose base is frozen, its trainable parameters only (the base is re-read from
        `model_dir`). Collective. `client_state` is small picklable-free JSON-able state (step,
        sampler, rng)."""
        ...

    def load_checkpoint(self, ckpt_dir: Path) -> dict[str, Any]:
        """Restore what `save_checkpoint` wrote; returns the client_state. Collective."""
        ...


class Backend(Protocol):
    """One training backend. Its launcher-side half is pure and light (no torch at import):
    `problems`, `render`, `resume_conflicts`; its worker-side half imports what it needs inside
    `setup` and `full_state_dict`."""

    name: str
    zero_stages: tuple[int, ...]
    """The ZeRO-style stages it implements, in the planner's search order."""
    tie_break: int
    """Tie-break between equally fast candidates, lower first: simpler to run and debug."""
    priced_as: str
    """The built-in backend whose memory and speed terms describe it (planner/memory.py, speed.py):
    its own name for the built-in ones."""
    knobs: frozenset[str]
    """The memory knobs its engine is verified to run (planner/knobs.py: loss_chunks,
    activation_offload, adamw8bit, embedding_offload; docs/memory-knobs.md)."""

    def shards_parameters(self, sharding: Sharding) -> bool:
        """Whether every parameter is sharded (flattened, gathered per use) under `sharding`, frozen
        ones too. Pure."""
        ...

    def problems(self, sharding: Sharding) -> list[Problem]:
        """Why it cannot run `sharding` (empty: it can). The one rule set the planner's candidate
        generation, its pin check and `render` all use. Pure."""
        ...

    def render(self, plan: RunPlan) -> dict[str, str]:
        """Backend config files for this plan, file name -> content. Pure: no I/O, no devices."""
        ...

    def process_group(self, plan: RunPlan) -> str:
        """The `torch.distributed.init_process_group` backend the worker starts for this plan
        (e.g. "nccl", "gloo", "cuda:nccl,cpu:gloo"). Pure."""
        ...

    def reads_weights(self, plan: RunPlan) -> bool:
        """Whether `setup` loads the initial weights from files in model_dir. False: a model
        trained from its config is built by `setup` itself (seeded, from model_dir/config.json),
        so none are written and read back before step 1. Pure."""
        ...

    def setup(self, plan: RunPlan, rank: Rank, model_dir: Path, objective: Objective,
              build_model: ModelBuilder) -> TrainEngine:
        """Build model (by `build_model`, from `model_dir`: a Hugging Face model directory with the
        initial weights, or only config.json when `reads_weights` is False), wrapper, optimizer and
        schedule on this rank. Collective."""
        ...

    def resume_conflicts(self, saved: dict[str, Any], strategy: Strategy) -> list[Problem]:
        """Why a checkpoint written under `saved` (its Strategy.to_dict(), same backend) cannot
        continue under `strategy`, beyond what every backend shares (orchestrate.run.checkpoints)."""
        ...

    def full_state_dict(self, ckpt_dir: Path, meta: CheckpointMeta) -> dict[str, torch.Tensor]:
        """The unsharded model state of one of its checkpoints, in this one process on the CPU
        (no process group): what `orchestrate export` writes."""
        ...


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Only what trains (`requires_grad`): what the checkpoint of a model with a frozen part holds."""
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}


def has_frozen_parameters(model: torch.nn.Module) -> bool:
    """Whether part of the model is frozen (a base that adapters train on): its checkpoints then hold
    the trainable parameters only, the frozen ones being re-read from the initial weights on resume."""
    return any(not p.requires_grad for p in model.parameters())


def device_process_group(plan: RunPlan) -> str:
    """nccl between GPUs, gloo between CPU processes: what a backend needs that keeps every tensor
    its collectives touch on the ranks' own devices."""
    return "nccl" if plan.hardware.has_gpu else "gloo"


def require_runnable(backend: Backend, sharding: Sharding, title: str) -> None:
    """UserError listing `backend.problems(sharding)`, for renderers handed a strategy by hand."""
    problems = backend.problems(sharding)
    if problems:
        raise UserError(f"unsupported {title} strategy", problems)
