"""`verify_plan(plan)`: simulate the chosen candidate and set it against the analytical estimate.

The simulation sees only tensor storages. What it cannot see on a GPU (CUDA context, cuBLAS
workspace, NCCL buffers, allocator fragmentation) is added from the analytical model's own named
constants, so both sides of the ratio cover the same things.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from orchestrate.errors import Problem, UserError
from orchestrate.hardware.units import format_bytes
from orchestrate.methods.registry import active_methods
from orchestrate.planner.plan import RunPlan
from orchestrate.simulate.api import simulate
from orchestrate.simulate.result import SimulationResult
from orchestrate.simulate.spec import OFFLOAD_NOTE


@dataclass(frozen=True)
class VerificationReport:
    strategy: str
    simulated_bytes: int
    """Per-rank peak the simulation saw (storages rounded to CUDA's 512-byte blocks on GPU plans)."""
    unseen_bytes: dict[str, int]
    """Added from the analytical model: cuda_context, workspace, nccl_buffers, allocator_reserve."""
    simulated_total: int
    analytical_total: int
    """The plan's per-rank estimate (`MemoryEstimate.gpu_total`)."""
    analytical_over_simulated: float
    """> 1: the analytical model is conservative; < 1: it under-predicts."""
    comparable: bool
    """False when offload had to be simulated as resident (the two sides measure different things)."""
    simulation: SimulationResult
    analytical: dict[str, int]
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        line = (f"{self.strategy}: simulated {format_bytes(self.simulated_total, in_gib=True)} per rank "
                f"({format_bytes(self.simulated_bytes, in_gib=True)} of tensors + {format_bytes(sum(self.unseen_bytes.values()), in_gib=True)} "
                f"not visible to a simulation), analytical {format_bytes(self.analytical_total, in_gib=True)}, "
                f"ratio analytical/simulated {self.analytical_over_simulated:.2f}")
        return "\n".join([line, *(f"  note: {n}" for n in self.notes)])


def _unseen(plan: RunPlan, analytical: dict[str, int]) -> dict[str, int]:
    from orchestrate.planner import constants as k

    hw, strategy = plan.hardware, plan.chosen.strategy
    if not hw.has_gpu:
        return {}
    nccl = 0
    if hw.world_size > 1:  # memory.py: one communicator, two with hybrid shard
        nccl = (2 if strategy.hybrid_shard else 1) * k.NCCL_BUFFER_BYTES_PER_COMMUNICATOR
    return {"cuda_context": analytical.get("cuda_context", 0), "workspace": analytical.get("workspace", 0),
            "nccl_buffers": nccl, "allocator_reserve": analytical.get("allocator_reserve", 0)}


def verify_plan(plan: RunPlan, *, timeout_s: float = 900) -> VerificationReport:
    """Simulate `plan.chosen` (one rank, rank 0) and compare its peak with the plan's estimate."""
    from orchestrate.planner.memory import estimate_memory

    cand = plan.chosen
    if cand is None:
        raise ValueError("the plan has no chosen candidate to verify")
    if plan.config.model.task != "causal-lm":  # the harness builds AutoModelForCausalLM and next-token batches
        raise UserError("plan --simulate runs causal LMs only", [Problem(
            "model.task", f"the fake-tensor simulation builds the causal-LM class, not the {plan.config.model.task} "
            "head, so its peak would describe another model", "drop --simulate: the analytical estimate covers every task")])
    refusals = [p for m in active_methods(plan.config) if (p := m.simulation_refusal(plan.config)) is not None]
    if refusals:
        raise UserError("plan --simulate cannot run this training method", refusals)
    analytical = dict(cand.memory.gpu) or estimate_memory(
        plan.shape, plan.hardware, cand.strategy, plan.config.train.seq_len, cand.gradient_accumulation).gpu
    sim = simulate(plan, timeout_s=timeout_s)
    seen = sim.peak_bytes_cuda_rounded if plan.hardware.has_gpu else sim.peak_bytes
    unseen = _unseen(plan, analytical)
    total = seen + sum(unseen.values())
    analytical_total = sum(analytical.values())
    return VerificationReport(
        strategy=cand.strategy.name, simulated_bytes=seen, unseen_bytes=unseen, simulated_total=total,
        analytical_total=analytical_total, analytical_over_simulated=analytical_total / total if total else float("nan"),
        comparable=OFFLOAD_NOTE not in sim.notes, simulation=sim, analytical=analytical, notes=list(sim.notes))
