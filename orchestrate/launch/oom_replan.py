"""Recovering from an out-of-memory error (docs/fault-tolerance.md): the workers' records
(RUN_DIR/oom/rank-<N>.json, worker/oom.py) -> a MemoryCorrection with the shortfall -> a new plan
for the same config on the same hardware with that correction -> the run directory rewritten with
it -> the launcher starts the workers again, which resume from the newest intact checkpoint.

The correction is the ratio measured / predicted of the rank that fell shortest, applied to every
strategy family: the cause of an under-prediction is not known at the OOM (an allocator reserve, the
CUDA context, a library's temporaries are the same whichever backend runs), and predicting high costs
speed where predicting low costs another OOM. On a GPU the measured lower bound (the reserved bytes
plus the failed request plus the context) exceeds the card, so the plan that failed no longer fits
and the planner's own ranking picks the next one (a smaller micro-batch, more checkpointing, more
offload). A checkpoint pins what its optimizer state depends on (launch/resume.py pinned_config).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrate.errors import UserError
from orchestrate.hardware.profile import MemoryCorrection
from orchestrate.hardware.units import format_bytes
from orchestrate.launch.calibration_record import record_oom_ratio
from orchestrate.launch.resume import pinned_config
from orchestrate.launch.rundir import prepare_run
from orchestrate.planner.memory import node_host_bytes
from orchestrate.planner.plan import RunPlan
from orchestrate.planning import feasible_plan
from orchestrate.run.checkpoints import newest_checkpoint
from orchestrate.run.exits import HOST_MEMORY_HELP
from orchestrate.run.layout import read_oom_records
from orchestrate.run.resume_rules import check_resumable


@dataclass(frozen=True)
class OutOfMemory:
    """The rank records of one failed attempt, summarised by the rank that fell shortest."""

    records: list[dict[str, Any]]

    @property
    def worst(self) -> dict[str, Any]:
        return max(self.records, key=lambda r: r["needed_at_least_bytes"] / max(1, r["predicted_bytes"]))

    def correction(self) -> MemoryCorrection:
        worst = self.worst
        ratio = max(1.0, worst["needed_at_least_bytes"] / max(1, worst["predicted_bytes"]))
        return MemoryCorrection(ratio=ratio, source=f"out-of-memory at step {worst['step']}",
                                reason=self.why())

    def why(self) -> str:
        w = self.worst
        return (f"rank {w['rank']} ran out of memory at step {w['step']} ({w['phase']}): it needed at least "
                f"{format_bytes(w['needed_at_least_bytes'])} where {w['strategy']} predicted "
                f"{format_bytes(w['predicted_bytes'])}")


def host_out_of_memory(record: dict[str, Any], plan: RunPlan) -> str:
    """The launcher's message on a rank out of host memory: which rank, where, how much it asked
    for, what the plan predicted for the node's RAM, and what would help (no re-plan: the planner's
    host prediction did not fail, the host did)."""
    where = f"at step {record['step']} ({record['phase']})" if record.get("step") is not None else record["phase"]
    asked = (f"; it asked for {format_bytes(record['requested_bytes'])} more" if record.get("requested_bytes") else "")
    node = node_host_bytes(plan.chosen.memory, plan.hardware)
    return (f"rank {record['rank']} (node {record['node']}) ran out of host memory (RAM) {where}{asked}; the plan "
            f"predicted {format_bytes(node)} of the node's {format_bytes(plan.hardware.cpu_memory_bytes)} "
            f"({record['message'].splitlines()[0][:200]}). What would help: {HOST_MEMORY_HELP}")


def read_out_of_memory(run_dir: Path) -> OutOfMemory | None:
    records = read_oom_records(run_dir)
    return OutOfMemory(records) if records else None


def describe_plan(plan: RunPlan) -> str:
    c = plan.chosen
    return (f"{c.name} (micro-batch {c.strategy.micro_batch_size}, accumulation {c.gradient_accumulation}, "
            f"activation checkpointing {'on' if c.strategy.activation_checkpointing else 'off'}, "
            f"offload optimizer {c.strategy.offload_optimizer}, parameters {c.strategy.offload_params}), "
            f"predicted {format_bytes(c.memory.gpu_total)} per rank")


def replan(plan: RunPlan, run_dir: Path, oom: OutOfMemory) -> RunPlan:
    """The plan for the next attempt, its run directory rewritten; UserError (the planner's refusal:
    by how much, what would fit) when nothing fits with the correction, or when the newest checkpoint
    cannot continue under it."""
    hardware = plan.hardware.model_copy(update={
        "memory_corrections": [*plan.hardware.memory_corrections, oom.correction()]})
    found = newest_checkpoint(run_dir, full=True)
    config = pinned_config(plan.config, found.chosen.meta) if found.chosen else plan.config
    new = feasible_plan(config, hardware)
    if found.chosen is not None:
        check_resumable(found.chosen.path, new)
    return prepare_run(new, run_dir)


def recover(plan: RunPlan, run_dir: Path, attempt: int, say) -> RunPlan | None:
    """After the workers ended: None when they did not run out of memory, or ran out of host memory,
    or when retries are off or used up, or nothing fits any more (each said); else the new plan,
    said with why."""
    oom = read_out_of_memory(run_dir)
    if oom is None:
        return None
    host = next((r for r in oom.records if r.get("memory") == "host"), None)
    if host is not None:
        say(host_out_of_memory(host, plan))
        return None
    retries = plan.config.train.oom_retries
    say(f"out of memory: {oom.why()}")
    recorded = record_oom_ratio(plan, oom.worst)
    if recorded:
        say(recorded)
    if attempt >= retries:
        say(f"not re-planning: {'train.oom_retries is 0' if retries == 0 else f'{retries} re-plan(s) used'} "
            f"(records in {run_dir / 'oom'})")
        return None
    try:
        new = replan(plan, run_dir, oom)
    except UserError as refusal:
        say(f"no plan fits with the measured x{oom.correction().ratio:.2f} correction:\n{refusal}")
        return None

    found = newest_checkpoint(run_dir, full=False).chosen
    where = f"the checkpoint of step {found.meta.step}" if found else "step 0 (no checkpoint yet)"
    say(f"re-plan {attempt + 1} of {retries}: x{oom.correction().ratio:.2f} on the per-rank prediction; "
        f"new plan: {describe_plan(new)}; resuming from {where}")
    return new
