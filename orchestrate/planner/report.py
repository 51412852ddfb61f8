"""Human and machine views of a plan: rich tables for `orchestrate plan`, a dict for `--json`.

Schema of `plan_json` is documented in docs/plan-json.md. What the plan's training methods say about
themselves comes in as values (planner/terms.py `MethodReport`, from orchestrate/planning.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.console import Console, Group
from rich.table import Table

from orchestrate.hardware.profile import HardwareProfile
from orchestrate.hardware.units import gib, parameter_count
from orchestrate.planner.memory import node_host_bytes
from orchestrate.planner.plan import Candidate, PlanResult, RunPlan
from orchestrate.planner.search import Limits, describe_hardware
from orchestrate.planner.terms import MethodReport


def _size(n: int) -> str:
    return gib(n) if n else "-"


def candidates_table(plan: PlanResult) -> Table:
    """Every candidate: name, fits, GPU peak per rank, CPU peak per node, tokens/s, reason; chosen
    highlighted. On CPU-only profiles the per-rank column is the rank's RAM and the node column the
    whole node (ranks x rank + host terms)."""
    hw = plan.hardware
    per_rank = "GPU/rank" if hw.has_gpu else "RAM/rank"
    table = Table(title=f"Candidates for {parameter_count(plan.shape.parameters)} {plan.shape.model_type} "
                        f"on {describe_hardware(hw)}")
    table.add_column("")
    # Names are what users pin and grep for: folded onto more lines on a narrow terminal, never
    # truncated; numbers never wrap; the reason wraps.
    table.add_column("candidate", overflow="fold")
    for header, justify in (("fits", "center"), (per_rank, "right"), ("CPU/node", "right"),
                            ("NVMe", "right"), ("tokens/s", "right")):
        table.add_column(header, justify=justify, no_wrap=True)
    table.add_column("reason")
    for c in plan.candidates:
        chosen = isinstance(plan, RunPlan) and c.name == plan.chosen.name
        table.add_row("*" if chosen else "", c.name, "yes" if c.fits else "no", gib(c.memory.gpu_total),
                      gib(node_host_bytes(c.memory, hw)), gib(c.memory.nvme_bytes) if c.memory.nvme_bytes else "",
                      f"{c.speed.tokens_per_s:,.0f}", c.reason,
                      style="bold green" if chosen else ("" if c.fits else "dim"))
    return table


def memory_table(candidate: Candidate, hw: HardwareProfile) -> Table:
    """The candidate's memory by component: per rank on the device, per node on the host, NVMe."""
    table = Table(title="Memory breakdown (chosen plan)")
    for header, justify in (("where", "left"), ("component", "left"), ("bytes", "right")):
        table.add_column(header, justify=justify)
    device = "GPU/rank" if hw.has_gpu else "RAM/rank"
    for key, value in candidate.memory.gpu.items():
        table.add_row(device, key, _size(value))
    table.add_row(device, "total", gib(candidate.memory.gpu_total), style="bold")
    for key, value in candidate.memory.cpu.items():
        table.add_row("CPU/node", key, _size(value))
    if not hw.has_gpu:
        table.add_row("CPU/node", f"{hw.ranks_per_node} rank(s) x RAM/rank",
                      gib(hw.ranks_per_node * candidate.memory.gpu_total))
    table.add_row("CPU/node", "total", gib(node_host_bytes(candidate.memory, hw)), style="bold")
    if candidate.memory.nvme_bytes:
        table.add_row("NVMe/node", "offloaded states", gib(candidate.memory.nvme_bytes), style="bold")
    return table


def speed_table(candidate: Candidate) -> Table:
    """Seconds per step by component (before overlap) and the resulting step time."""
    table = Table(title=f"Step time (chosen, accumulation {candidate.gradient_accumulation})")
    table.add_column("component")
    table.add_column("s/step", justify="right")
    for key, value in candidate.speed.breakdown.items():
        table.add_row(key, f"{value:.3f}")
    table.add_row("step (after overlap)", f"{candidate.speed.step_time_s:.3f}", style="bold")
    return table


def render_plan(plan: PlanResult, methods: Sequence[MethodReport] = ()) -> Group:
    """Everything `orchestrate plan` prints: the candidates, then the chosen plan's breakdowns, then
    what its methods say about themselves (`methods`, in their order)."""
    parts: list[Any] = [candidates_table(plan), *plan.notes]
    if isinstance(plan, RunPlan):
        parts += [memory_table(plan.chosen, plan.hardware), speed_table(plan.chosen)]
    for lines, _ in methods:
        parts += lines
    return Group(*parts)


def print_plan(plan: PlanResult, console: Console | None = None, methods: Sequence[MethodReport] = ()) -> None:
    (console or Console()).print(render_plan(plan, methods))


def plan_json(plan: PlanResult, methods: Sequence[MethodReport] = ()) -> dict[str, Any]:
    """`orchestrate plan --json`: `RunPlan.to_dict()` (a Refusal's: chosen null) plus the limits each candidate was checked against,
    each candidate's whole-node host bytes and what the plan's methods add (`methods`; see docs/plan-json.md)."""
    data = plan.to_dict()
    limits = Limits.of(plan.config, plan.hardware)
    data["limits"] = {"gpu_bytes_usable_per_rank": limits.gpu, "cpu_bytes_usable_per_node": limits.cpu,
                      "nvme_bytes_free_per_node": limits.nvme}
    for _, keys in methods:
        data.update(keys)
    for entry, cand in zip(data["candidates"], plan.candidates, strict=True):
        entry["host_bytes_per_node"] = node_host_bytes(cand.memory, plan.hardware)
    return data
