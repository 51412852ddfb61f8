"""When nothing fits: the `UserError` naming the closest candidates, by how much each overflows,
and remedies computed by re-planning variations of the config and hardware, and the configs the
training methods offer instead (`Alternative`).

Pure, like the rest of the planner: a variation's config has training methods' terms of its own, so
the caller, which computes them (orchestrate/planning.py), hands in how to plan one (`Replan`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from orchestrate.config.schema import RunConfig
from orchestrate.errors import Problem, UserError
from orchestrate.hardware.profile import HardwareProfile
from orchestrate.hardware.units import GiB, gib
from orchestrate.model.shape import ModelShape
from orchestrate.planner.memory import node_host_bytes
from orchestrate.planner.plan import Candidate, Refusal, RunPlan
from orchestrate.planner.search import Limits, describe_hardware, nvme_available, overflow_score
from orchestrate.planner.terms import Alternative

_CLOSEST = 3
_UNLIMITED = 2**62


class Replan(Protocol):
    """Plans a variation: a config with its training methods' terms, on a hardware profile (a
    UserError for one that cannot be planned)."""

    def __call__(self, config: RunConfig, hw: HardwareProfile, shape: ModelShape, *,
                 fitting_only: bool = False) -> RunPlan | Refusal: ...


def _replan(replan: Replan, config: RunConfig, hw: HardwareProfile, shape: ModelShape) -> Candidate | None:
    """The chosen candidate of a variation, keeping the global batch divisible by the world size."""
    world, batch = hw.world_size, config.train.global_batch_size
    if batch % world:
        config = config.model_copy(update={"train": config.train.model_copy(
            update={"global_batch_size": -(-batch // world) * world})})
    try:
        plan = replan(config, hw, shape, fitting_only=True)
    except UserError:
        return None
    return plan.chosen if isinstance(plan, RunPlan) else None


def _fit_summary(c: Candidate, hw: HardwareProfile) -> str:
    parts = [f"GPU {gib(c.memory.gpu_total)}/rank"] if hw.has_gpu else []
    parts.append(f"CPU {gib(node_host_bytes(c.memory, hw))}/node")
    if c.memory.nvme_bytes:
        parts.append(f"NVMe {gib(c.memory.nvme_bytes)}")
    return f"{c.name} fits ({', '.join(parts)})"


def _method_remedy(replan: Replan, config: RunConfig, hw: HardwareProfile, shape: ModelShape,
                   alternative: Alternative) -> Problem | None:
    """What the plan would be with another training method (a method's `alternatives`)."""
    try:
        plan = replan(alternative.config, hw, shape)
    except UserError:  # e.g. a family LoRA is not planned for, or pins the method cannot train under
        return None
    where, what, fix = alternative.where, alternative.what, alternative.fix
    if isinstance(plan, RunPlan):
        return Problem(where, f"with {what}, {_fit_summary(plan.chosen, hw)}", fix)
    closest = min(plan.candidates, key=lambda c: overflow_score(c, Limits.of(config, hw), hw))
    return Problem(where, f"with {what}, the closest, {closest.name}, still overflows: {closest.reason}",
                   f"{fix}, with one of the other remedies")


def _remedies(plan: Refusal, limits: Limits, replan: Replan, alternatives: Sequence[Alternative]) -> list[Problem]:
    config, hw, shape = plan.config, plan.hardware, plan.shape
    out: list[Problem] = []
    only = {what: [c for c in plan.candidates if [o[0] for o in limits.overflows(c.memory, hw)] == [what]]
            for what in ("GPU", "CPU", "NVMe")}

    if not nvme_available(config, hw) and hw.has_gpu:
        nvme_hw = hw.model_copy(update={"nvme_path": "<nvme>", "nvme_free_bytes": _UNLIMITED})
        if (c := _replan(replan, config, nvme_hw, shape)) is not None:
            out.append(Problem("--nvme", f"with an NVMe offload directory, {_fit_summary(c, nvme_hw)}",
                               f"pass --nvme /path/on/nvme (strategy.nvme_path) with >= "
                               f"{gib(c.memory.nvme_bytes)} free"))
    if only["NVMe"]:
        c = min(only["NVMe"], key=lambda c: c.memory.nvme_bytes)
        out.append(Problem("--nvme", f"{c.name} needs {gib(c.memory.nvme_bytes)} on NVMe, "
                                     f"{gib(limits.nvme or 0)} is free", "free space there or use another disk"))
    if only["CPU"]:
        c = min(only["CPU"], key=lambda c: node_host_bytes(c.memory, hw))
        need = node_host_bytes(c.memory, hw) / config.strategy.cpu_memory_headroom
        out.append(Problem("hardware (RAM)", f"{c.name} needs {gib(node_host_bytes(c.memory, hw))} host RAM "
                                             f"per node; it fits with >= {need / GiB:.0f} GiB RAM per node",
                           "add RAM, or use more nodes"))
    if only["GPU"] and hw.has_gpu:
        c = min(only["GPU"], key=lambda c: c.memory.gpu_total)
        need = c.memory.gpu_total / config.strategy.gpu_memory_headroom
        if need <= 2 * hw.gpu.memory_bytes:  # a realistic next card, not a data-centre one
                out.append(Problem("hardware (GPU)", f"{c.name} fits on GPUs with >= {need / GiB:.1f} GiB each",
                               "use larger GPUs or more of them"))
    if hw.has_gpu:
        for gpus in (g for g in (2, 4, 8) if g > hw.gpus_per_node):
            if (c := _replan(replan, config, hw.model_copy(update={"gpus_per_node": gpus}), shape)) is not None:
                out.append(Problem("--gpus", f"with {gpus} GPUs per node, {_fit_summary(c, hw)}", f"--gpus {gpus}"))
                break
    for nodes in (n for n in (2, 4, 8) if n > hw.nodes):
        more = hw.model_copy(update={"nodes": nodes})
        if (c := _replan(replan, config, more, shape)) is not None:
            out.append(Problem("hardware (nodes)", f"on {nodes} such nodes, {_fit_summary(c, more)}",
                               f"add nodes to the hardware profile ({nodes} in all)"))
            break
    seq = config.train.seq_len // 2
    while seq >= 64:
        shorter = config.model_copy(update={"train": config.train.model_copy(update={"seq_len": seq})})
        if (c := _replan(replan, shorter, hw, shape)) is not None:
            out.append(Problem("train.seq_len", f"at seq_len {seq}, {_fit_summary(c, hw)}",
                               f"train.seq_len: {seq}"))
            break
        seq //= 2
    pins = {"backend": "auto", "zero_stage": "auto", "offload": "auto", "offload_params": "auto"}
    if any(getattr(config.strategy, key) != "auto" for key in pins):
        free = config.model_copy(update={"strategy": config.strategy.model_copy(update=pins)})
        if (c := _replan(replan, free, hw, shape)) is not None:
            out.append(Problem("strategy", f"the strategy pins exclude a plan that fits: {_fit_summary(c, hw)}",
                               "set backend, zero_stage, offload and offload_params to auto"))
    out += [p for alternative in alternatives if (p := _method_remedy(replan, config, hw, shape, alternative))]
    return out + _knob_remedies(replan, config, hw, shape)


def _knob_remedies(replan: Replan, config: RunConfig, hw: HardwareProfile, shape: ModelShape) -> list[Problem]:
    """The memory knobs (planner/knobs.py, long_context.py) pinned off that would make a plan fit, set to auto."""
    train, out = config.train, []
    for where, pinned_off, update in (
            ("train.optimizer.name", train.optimizer.name == "adamw",
             {"optimizer": train.optimizer.model_copy(update={"name": "auto"})}),
            ("train.loss_chunks", train.loss_chunks == 0, {"loss_chunks": "auto"}),
            ("train.activation_offload", train.activation_offload is False, {"activation_offload": "auto"}),
            ("train.embedding_offload", train.embedding_offload is False, {"embedding_offload": "auto"}),
            ("train.mlp_tiles", train.mlp_tiles == 0, {"mlp_tiles": "auto"}),
            ("train.fused_kernels", train.fused_kernels is False, {"fused_kernels": "auto"}),
            ("train.sequence_parallel", train.sequence_parallel == 1, {"sequence_parallel": "auto"})):
        if pinned_off:
            changed = config.model_copy(update={"train": train.model_copy(update=update)})
            if (c := _replan(replan, changed, hw, shape)) is not None:
                out.append(Problem(where, f"set to auto, {_fit_summary(c, hw)}", f"{where}: auto"))
    return out


def infeasible_error(plan: Refusal, replan: Replan, alternatives: Sequence[Alternative]) -> UserError:
    """The `UserError` (exit 2) for a plan without a fitting candidate: the closest candidates, by how much
    each overflows, and concrete remedies, each a variation planned with `replan`; `alternatives`: the
    configs the training methods offer instead (Method.alternatives)."""
    hw, shape = plan.hardware, plan.shape
    limits = Limits.of(plan.config, hw)
    closest = plan.candidates[:_CLOSEST]
    lines = ["Closest candidates (GPU per rank, CPU per node):"]
    lines += [f"  {c.name}: {c.reason}" for c in closest]
    best = closest[0]
    words = {"GPU": "GPU memory", "CPU": "CPU RAM", "NVMe": "NVMe space"}
    over = " and ".join(f"{words[what]} by {gib(need - have)}"
                        for what, need, have, _ in limits.overflows(best.memory, hw))
    headline = (f"Nothing fits: {shape.parameters / 1e9:.2f}B-parameter {shape.model_type} at seq_len "
                f"{plan.config.train.seq_len} on {describe_hardware(hw)}; the closest, {best.name}, "
                f"overflows {over}")
    return UserError(headline, _remedies(plan, limits, replan, alternatives), "\n".join(lines))
