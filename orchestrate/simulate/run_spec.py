"""What one simulated (or real, measured) training run does: every knob as a plain JSON-able value.

A `RunSpec` is derived from a `RunPlan` through the backends' own pure renderers (`fsdp_settings`,
`ddp_settings`, DeepSpeed's `render_config`), so the simulation wraps the model as the worker will.
It is JSON so it can cross into the subprocess that runs the simulation.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from orchestrate.backends.ddp import ddp_settings
from orchestrate.backends.deepspeed_render import engine_config
from orchestrate.backends.fsdp import fsdp_settings
from orchestrate.config.load import config_from_dict
from orchestrate.hardware.presets import load_preset
from orchestrate.methods.lora.method import LORA
from orchestrate.methods.registry import active_methods, method_terms
from orchestrate.model.meta import load_model_config, shape_from_config
from orchestrate.planner.estimate import MemoryEstimate, SpeedEstimate
from orchestrate.planner.memory import forward_rows
from orchestrate.planner.plan import Candidate, RunPlan
from orchestrate.planner.strategy import Strategy

OFFLOAD_NOTE = "not simulated: offload moves state to CPU — simulated as if resident"


@dataclass(frozen=True)
class RunSpec:
    model_config: dict[str, Any]
    """`PretrainedConfig.to_dict()` of the model (has `model_type`)."""
    strategy: dict[str, Any]
    """`Strategy.to_dict()` of what is simulated (offload already removed, see `notes`)."""
    seq_len: int
    world_size: int
    mesh_shape: tuple[int, ...]
    """FSDP2 device mesh ((world,) or (nodes, ranks_per_node) for hybrid shard); (world,) otherwise."""
    rank: int = 0
    steps: int = 2
    """Two steps, so the optimizer states exist (AdamW creates them lazily in the first step)."""
    gradient_accumulation: int = 1
    """Micro-batches per step (at most 2: from the second on, every micro-batch repeats the same
    memory pattern with the accumulated gradients held)."""
    sync_last_micro_batch_only: bool = False
    """DDP / FSDP2: skip the gradient all-reduce / reduce-scatter on all but the last micro-batch
    (the backend's rendered `gradient_sync`)."""
    grad_clip: float = 1.0
    fused_adam: bool = False
    """torch AdamW `fused=True` (the fsdp/ddp backends on GPU: no full-size temporaries)."""
    foreach_adam: bool | None = None
    """torch AdamW `foreach` (None: torch's choice for the tensors' device; CUDA picks foreach)."""
    weight_decay: float = 0.1
    deepspeed_config: dict[str, Any] | None = None
    block_classes: tuple[str, ...] | None = None
    """Transformer-block class names for fully_shard / activation checkpointing (None: the model's
    `_no_split_modules`)."""
    adapters: dict[str, Any] | None = None
    """A LoRA / QLoRA run: {"method", "lora", "quantization"} as in `train` (None: full fine-tuning).
    The harness applies the backends' own transform (orchestrate/methods/lora/transform.py) before wrapping."""
    rows: int | None = None
    """Sequences per micro-batch the trained model's forward sees where a method makes them more than
    micro_batch_size (GRPO's num_generations per prompt, a preference pair's two: planner/memory.py
    `forward_rows`); None: micro_batch_size."""
    phases: tuple[dict[str, Any], ...] = ()
    """The methods' phases before each micro-batch (methods/spec.py `SimulatedPhase`, as dicts)."""
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def strategy_obj(self) -> Strategy:
        return Strategy.from_dict(self.strategy)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunSpec:
        data = dict(data)
        data["mesh_shape"] = tuple(data["mesh_shape"])
        data["notes"] = tuple(data.get("notes", ()))
        data["phases"] = tuple(data.get("phases", ()))
        if data.get("block_classes") is not None:
            data["block_classes"] = tuple(data["block_classes"])
        return cls(**data)

    def with_layers(self, num_layers: int) -> RunSpec:
        """The same run on a model with `num_layers` blocks (same widths and vocabulary)."""
        from transformers import AutoConfig

        cfg = AutoConfig.for_model(**self.model_config)
        cfg.num_hidden_layers = num_layers  # gpt2 maps it to n_layer through attribute_map
        types = getattr(cfg, "layer_types", None)
        if isinstance(types, list):  # per-layer attention kinds must match the layer count
            cfg.layer_types = types[:num_layers]
        return dataclasses.replace(self, model_config=cfg.to_dict())


def _without_offload(strategy: Strategy) -> tuple[Strategy, tuple[str, ...]]:
    if strategy.offload_optimizer == "none" and strategy.offload_params == "none":
        return strategy, ()
    # A CPU-only simulation has one memory: what offload moves off the GPU cannot be told apart,
    # and DeepSpeedCPUAdam reads real data pointers (C++ kernel), which fake tensors do not have.
    resident = dataclasses.replace(strategy, offload_optimizer="none", offload_params="none")
    return resident, (OFFLOAD_NOTE,)


def spec_from_plan(plan: RunPlan, candidate: Candidate | None = None, *, steps: int = 2, rank: int = 0) -> RunSpec:
    """The run `plan` would make for `candidate` (default: the chosen one), as the backends set it up."""
    cand = candidate or plan.chosen
    if cand is None:
        raise ValueError("the plan has no chosen candidate to simulate")
    strategy, notes = _without_offload(cand.strategy)
    # Two micro-batches show what accumulation costs: gradients held from the first while the
    # second runs; further ones repeat the second.
    accumulation = min(cand.gradient_accumulation, 2)
    if cand.gradient_accumulation > accumulation:
        notes += (f"simulated with {accumulation} micro-batches per step (the plan accumulates "
                  f"{cand.gradient_accumulation}; later micro-batches repeat the second)",)
    resident = dataclasses.replace(cand, strategy=strategy, gradient_accumulation=accumulation)
    plan1 = plan.model_copy(update={"candidates": [resident], "chosen": resident})
    hf_config = load_model_config(plan.config)
    hw, train = plan.hardware, plan.config.train
    mesh: tuple[int, ...] = (plan.world_size,)
    fused, foreach, ds_config, blocks, sync_last = False, None, None, None, False
    if strategy.backend == "fsdp":
        settings = fsdp_settings(plan1)
        mesh = tuple(settings["mesh"]["shape"])
        fused = bool(settings["optimizer"]["fused"])
        blocks = settings["fully_shard"]["block_classes"]
        sync_last = settings["gradient_sync"] == "last_micro_batch"
    elif strategy.backend == "deepspeed":
        ds_config = engine_config(plan1)  # what the worker passes to deepspeed.initialize
        # The worker's client AdamW steps DeepSpeed's flat fp32 partition; on a GPU that tensor is
        # on CUDA, where torch's default is the foreach implementation.
        foreach = hw.has_gpu or None
    else:
        settings = ddp_settings(plan1)
        fused = bool(settings["optimizer"]["fused"])
        blocks = settings["block_classes"]
        sync_last = settings["gradient_sync"] == "last_micro_batch"
    rows, seq_len = _forward_rows(plan, strategy)
    phases = tuple(dataclasses.asdict(phase) for m in active_methods(plan.config)
                   if (phase := m.simulated_phase(plan)) is not None)
    return RunSpec(
        model_config=hf_config.to_dict(), strategy=strategy.to_dict(), seq_len=seq_len, rows=rows, phases=phases,
        world_size=plan.world_size, mesh_shape=mesh, rank=rank, steps=steps, gradient_accumulation=accumulation,
        sync_last_micro_batch_only=sync_last, grad_clip=train.grad_clip,
        fused_adam=fused, foreach_adam=foreach, weight_decay=train.optimizer.weight_decay,
        deepspeed_config=ds_config, block_classes=tuple(blocks) if blocks else None,
        adapters=adapter_settings(plan.config), notes=notes)


def _forward_rows(plan: RunPlan, strategy: Strategy) -> tuple[int | None, int]:
    """(rows, seq_len) of the micro-batch the trained model's forward sees, as the planner priced it
    (planner/memory.py `forward_rows` over the methods' terms); rows None where it is micro_batch_size."""
    terms = method_terms(plan.config, plan.shape, plan.hardware)
    rows, seq_len = forward_rows(terms, strategy, plan.config.train.seq_len)
    return (rows.micro_batch_size if rows.micro_batch_size != strategy.micro_batch_size else None), seq_len


def adapter_settings(config: Any) -> dict[str, Any] | None:
    """The `train` keys the LoRA transform reads (None unless the run trains adapters)."""
    if not LORA.active(config):
        return None
    t = config.train
    return {"method": t.method, "lora": t.lora.model_dump(), "quantization": t.quantization.model_dump()}


def plan_from_parts(hf_config: Any, strategy: Strategy, seq_len: int, world_size: int,
                    hardware: Any = None, adapters: dict[str, Any] | None = None) -> RunPlan:
    """A one-candidate plan for `strategy` (default hardware: the generic 8 GB GPU preset, one rank
    per GPU), so simulating parts goes through the same renderers as simulating a plan. `adapters`:
    `train` keys of a LoRA / QLoRA run (`adapter_settings`)."""
    arch = hf_config if isinstance(hf_config, dict) else hf_config.to_diff_dict()
    arch = {"model_type": arch.get("model_type") or hf_config.model_type, **arch}
    for key in ("architectures", "transformers_version", "_name_or_path"):
        arch.pop(key, None)
    if hardware is None:
        hardware = load_preset("generic-8gb").model_copy(update={"gpus_per_node": world_size})
    if hardware.world_size != world_size:
        raise ValueError(f"hardware has {hardware.world_size} ranks, world_size is {world_size}")
    cfg = config_from_dict({"model": {"architecture": arch},
                            "train": {"seq_len": seq_len, "global_batch_size": strategy.micro_batch_size * world_size,
                                      "precision": strategy.precision,
                                      "micro_batch_size": strategy.micro_batch_size, **(adapters or {})}}, None)
    shape = shape_from_config(load_model_config(cfg))
    cand = Candidate(strategy, MemoryEstimate({}, {}), SpeedEstimate(0.0, 0.0), 1, fits=True)
    return RunPlan(config=cfg, hardware=hardware, shape=shape, candidates=[cand], chosen=cand)
