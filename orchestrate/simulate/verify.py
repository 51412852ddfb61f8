"""`verify_plan(plan)`: simulate the chosen candidate and set it against the analytical estimate.

The simulation sees tensor storages; on GPU plans their allocations and frees are replayed through
the caching-allocator model (replay.py) with the plan's `expandable_segments` setting, so the
simulated side is the device memory the allocator needs, fragmentation included. What it cannot see
on a GPU (CUDA context, cuBLAS workspace, NCCL buffers) is added from the analytical model's own named
constants, so both sides of the ratio cover the same things.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from orchestrate.errors import Problem, UserError
from orchestrate.hardware.units import format_bytes
from orchestrate.methods.registry import active_methods, method_terms
from orchestrate.planner.memory import estimate_memory
from orchestrate.planner.plan import RunPlan
from orchestrate.simulate.in_subprocess import simulate
from orchestrate.simulate.result import SimulationResult
from orchestrate.simulate.run_spec import OFFLOAD_NOTE


@dataclass(frozen=True)
class VerificationReport:
    strategy: str
    simulated_bytes: int
    """Per-rank peak the simulation saw: on GPU plans the device memory the replayed allocator needs
    with the plan's expandable_segments setting (`allocator[setting]["needed"]`), else the storages."""
    unseen_bytes: dict[str, int]
    """Added from the analytical model: cuda_context, workspace, nccl_buffers (GPU plans)."""
    simulated_total: int
    analytical_total: int
    """The plan's per-rank estimate (`MemoryEstimate.gpu_total`)."""
    analytical_over_simulated: float
    """> 1: the analytical model is conservative; < 1: it under-predicts."""
    comparable: bool
    """False when offload had to be simulated as resident (the two sides measure different things)."""
    simulation: SimulationResult
    analytical: dict[str, int]
    expandable_segments: bool = True
    """The allocator setting the plan models (HardwareProfile.expandable_segments)."""
    gpu: bool = False
    """A GPU plan: the simulated side is the replayed CUDA allocator's."""
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        seen = "the CUDA allocator needs for the tensors" if self.gpu else "of tensors"
        line = (f"{self.strategy}: simulated {format_bytes(self.simulated_total, in_gib=True)} per rank "
                f"({format_bytes(self.simulated_bytes, in_gib=True)} {seen} + {format_bytes(sum(self.unseen_bytes.values()), in_gib=True)} "
                f"not visible to a simulation), analytical {format_bytes(self.analytical_total, in_gib=True)}, "
                f"ratio analytical/simulated {self.analytical_over_simulated:.2f}")
        return "\n".join([line, *self._allocator_lines(), *(f"  note: {n}" for n in self.notes)])

    def _allocator_lines(self) -> list[str]:
        if not self.gpu:  # a CPU plan: no CUDA allocator
            return []
        lines = []
        for name, on in (("expandable", True), ("segments", False)):
            peaks = self.simulation.allocator[name]
            gib = {key: format_bytes(value, in_gib=True) for key, value in peaks.items()}
            lines.append(f"  CUDA allocator, expandable_segments:{on}{' (planned)' if on == self.expandable_segments else ''}: "
                         f"allocated {gib['allocated']}, reserved {gib['reserved']} on a device with room to spare, "
                         f"runs in {gib['needed']}")
        return lines


def _unseen(plan: RunPlan, analytical: dict[str, int], reserve: bool = False) -> dict[str, int]:
    """What the run holds beyond the simulated storages, from the analytical terms: the attention mask of
    packed or padded rows (the harness trains rows of one unpadded sequence each; the counter answers
    fake data's padding checks as such rows do), the weights of a method's frozen models (a DPO
    reference copy, a teacher), and on a GPU what no tensor shows; `reserve`: the
    analytical allocator reserve too (for a simulated side without the allocator replay)."""
    models = [model.name for terms in method_terms(plan.config, plan.shape, plan.hardware) for model in terms.auxiliary]
    # the frozen models a method runs beside (planner/auxiliary.py): the harness builds the trained one only
    keys = ["attention_mask", *(f"{name}_{part}" for name in models for part in ("weights", "gathered"))]
    out = {key: analytical[key] for key in keys if analytical.get(key)}
    if not plan.hardware.has_gpu:
        return out
    out.update({key: analytical.get(key, 0) for key in ("cuda_context", "workspace", "nccl_buffers")})
    if reserve:
        out["allocator_reserve"] = analytical.get("allocator_reserve", 0)
    return out


def allocator_setting(hw) -> str:
    """The replay (SimulationResult.allocator key) of the setting a GPU launch on `hw` runs with."""
    return "expandable" if hw.expandable_segments else "segments"


def verify_plan(plan: RunPlan, *, timeout_s: float = 900) -> VerificationReport:
    """Simulate `plan.chosen` (one rank, rank 0) and compare its peak with the plan's estimate."""
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
        plan.shape, plan.hardware, cand.strategy, plan.config.train.seq_len, cand.gradient_accumulation,
        methods=method_terms(plan.config, plan.shape, plan.hardware)).gpu
    sim = simulate(plan, timeout_s=timeout_s)
    hw = plan.hardware
    seen = sim.allocator[allocator_setting(hw)]["needed"] if hw.has_gpu else sim.peak_bytes
    unseen = _unseen(plan, analytical)
    total = seen + sum(unseen.values())
    analytical_total = sum(analytical.values())
    return VerificationReport(
        strategy=cand.strategy.name, simulated_bytes=seen, unseen_bytes=unseen, simulated_total=total,
        analytical_total=analytical_total, analytical_over_simulated=analytical_total / total if total else float("nan"),
        comparable=OFFLOAD_NOTE not in sim.notes, simulation=sim, analytical=analytical,
        expandable_segments=hw.expandable_segments, gpu=hw.has_gpu, notes=list(sim.notes))
