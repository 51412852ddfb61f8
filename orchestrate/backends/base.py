"""The one small Protocol every backend implements, and the registry that finds them.

A backend has two halves that live in one file:
- `render(plan)`: pure, launcher side. Returns the backend's config files (name -> text), e.g.
  DeepSpeed's JSON, so the user can read, diff and reuse exactly what will run.
- `setup(plan, ctx)`: worker side. Builds the model from `ctx.model_dir` without N full copies in
  CPU RAM, wraps it, creates the optimizer and schedule, and returns a `TrainEngine`.

Adding a backend = one new file that calls `register(...)` plus its tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from orchestrate.planner.plan import Plan


@dataclass(frozen=True)
class WorkerContext:
    """What a worker knows about itself; everything else comes from the plan."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    """cuda:<local_rank> on GPU machines, cpu otherwise."""
    run_dir: Path
    model_dir: Path
    """A Hugging Face model directory (config.json + safetensors) holding the initial weights."""


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

    def eval_loss(self, batch: dict[str, torch.Tensor]) -> float:
        """Loss on one batch without gradients (this rank only)."""
        ...

    def save_hf_model(self, out_dir: Path) -> None:
        """Write a consolidated Hugging Face model (safetensors + config.json) from rank 0.
        Collective: every rank must call it."""
        ...

    def save_checkpoint(self, ckpt_dir: Path, client_state: dict[str, Any]) -> None:
        """Write a resumable sharded checkpoint (model, optimizer, scheduler, scaler) into ckpt_dir.
        Collective. `client_state` is small picklable-free JSON-able state (step, sampler, rng)."""
        ...

    def load_checkpoint(self, ckpt_dir: Path) -> dict[str, Any]:
        """Restore what `save_checkpoint` wrote; returns the client_state. Collective."""
        ...


class Backend(Protocol):
    name: str

    def render(self, plan: Plan) -> dict[str, str]:
        """Backend config files for this plan, file name -> content. Pure: no I/O, no devices."""
        ...

    def setup(self, plan: Plan, ctx: WorkerContext) -> TrainEngine:
        """Build model, wrapper, optimizer and schedule on this rank. Collective."""
        ...


_REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    _REGISTRY[backend.name] = backend
    return backend


def get_backend(name: str) -> Backend:
    # Import the built-in backends lazily: deepspeed is heavy and optional.
    from orchestrate.backends import builtin  # noqa: F401  (registers them)

    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown backend {name!r}; known: {sorted(_REGISTRY)}") from None


def backend_names() -> list[str]:
    from orchestrate.backends import builtin  # noqa: F401

    return sorted(_REGISTRY)
