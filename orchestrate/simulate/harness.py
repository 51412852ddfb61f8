"""Build the real HF model, wrap it the way the backends do, and run training steps under a counter.

The same code runs a simulation (fake tensors, fake process group) and a real measurement (real CPU
tensors, gloo): only the modes around it differ, which is what lets the tests compare them byte for
byte. Wrapping follows `orchestrate/backends/fsdp.py` and `deepspeed_backend.py`: checkpoint_wrapper
per block then `fully_shard` per block and root with a MixedPrecisionPolicy; DeepSpeed with its
rendered config and a client AdamW; DDP with `torch.autocast` (what the analytical model assumes).
The patches around it (CUDA-like dropout, fake-tensor workarounds, FSDP's comm phase) are in
`orchestrate.simulate.patches`.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import math
from typing import Any

import torch
from torch import nn
from torch._guards import active_fake_mode

from orchestrate.methods.registry import apply_transforms
from orchestrate.simulate.counter import LiveStorageCounter
from orchestrate.simulate.patches import cuda_like_dropout, fsdp_comm_phase, hf_config_for_simulation
from orchestrate.simulate.run_spec import RunSpec, plan_from_parts

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# DeepSpeed optimizer attributes (deepspeed 0.19: runtime/zero/stage_1_and_2.py, stage3.py) and what
# they hold. Anything else DeepSpeed allocates is attributed by the phase it was born in.
_DS_ATTRS = {
    "bit16_groups_flat": "parameters", "fp16_partitioned_groups_flat": "parameters",
    "lp_param_buffer": "parameters",
    "single_partition_of_fp32_groups": "master_weights", "fp32_partitioned_groups_flat": "master_weights",
    "averaged_gradients": "gradients", "grads_in_partition": "gradients",
    "grad_partitions_flat_buffer": "gradients",
    "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition": "gradients",
}


def make_mesh(spec: RunSpec):
    """The FSDP2 mesh; built before FakeTensorMode is entered (DeviceMesh reads its rank list)."""
    from torch.distributed.device_mesh import init_device_mesh

    if spec.strategy["backend"] != "fsdp":
        return None
    names = ("shard",) if len(spec.mesh_shape) == 1 else ("replicate", "shard")
    return init_device_mesh("cpu", spec.mesh_shape, mesh_dim_names=names)


class _NoRebuildReducer:
    """DDP re-buckets once, before the second forward, in the order gradients arrived; syncing that
    order across ranks reads tensor data in C++ (reducer.cpp, `rebuild_buckets`), which fake
    tensors lack. Same total bucket bytes either way; the swap happens before the forward, away from
    the peak. Skipped in simulations only."""

    def __init__(self, reducer: Any) -> None:
        self._reducer = reducer

    def _rebuild_buckets(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reducer, name)


def _adamw_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    # No decay for biases and norm weights (ndim < 2), as the backends do.
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


class Trainer:
    """One rank's model, wrapper and optimizer; `step()` runs one forward/backward/optimizer step."""

    def __init__(self, spec: RunSpec, counter: LiveStorageCounter | None = None, mesh: Any = None) -> None:
        from transformers import AutoModelForCausalLM

        from orchestrate.backends.hf_io import checkpoint_blocks, find_blocks, model_block_class_names
        from orchestrate.loading.tiled_mlp import tile_mlps

        self.spec, self.counter = spec, counter
        s = spec.strategy_obj
        self.backend, self.precision = s.backend, s.precision
        self.cfg = hf_config_for_simulation(spec.model_config)
        # Built-in model types only (hf_config_for_simulation): their own code, never an auto_map's; given
        # explicitly, so transformers never asks at a TTY.
        model = AutoModelForCausalLM.from_config(self.cfg, attn_implementation="sdpa", dtype=torch.float32,
                                                 trust_remote_code=False)
        model.train()
        self.hf_model = model
        self._install_phase_hooks(model)
        model = self._apply_adapters(model, spec)
        tile_mlps(model, s.mlp_tiles, repeated_accumulation=s.backend != "ddp")  # as the backends do
        classes = list(spec.block_classes or model_block_class_names(model, self.cfg.model_type))
        self.optimizer: Any = None
        self.engine: Any = None
        self.kept: list[Any] = []
        if s.backend == "deepspeed":
            self._setup_deepspeed(model, s)
            return
        if s.activation_checkpointing:
            blocks = checkpoint_blocks(model, classes)
        else:
            blocks = [m for _, m in find_blocks(model, classes)]
        if s.backend == "fsdp":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            dtype = _DTYPES.get(s.precision)
            mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype else MixedPrecisionPolicy()
            kwargs = {"mesh": mesh, "reshard_after_forward": s.zero_stage == 3, "mp_policy": mp}
            for block in blocks:
                fully_shard(block, **kwargs)
            fully_shard(model, **kwargs)
            self.model = model
        elif spec.world_size == 1:  # as the DDP backend trains one rank (backends/single_rank.py)
            from orchestrate.backends.single_rank import SingleRank

            self.model = SingleRank(model)
        else:
            from torch.nn.parallel import DistributedDataParallel

            self.model = DistributedDataParallel(model)
            fake = active_fake_mode() is not None
            self.model.register_comm_hook(None, self._allreduce_hook_fake if fake else self._allreduce_hook)
            if fake:
                self.model.reducer = _NoRebuildReducer(self.model.reducer)
        adam: dict[str, Any] = {"lr": 1e-4, "fused": spec.fused_adam or None, "foreach": spec.foreach_adam}
        self.optimizer = torch.optim.AdamW(_adamw_groups(model, spec.weight_decay), **adam)

    @staticmethod
    def _apply_adapters(model: nn.Module, spec: RunSpec) -> nn.Module:
        """A LoRA / QLoRA run: the backends' own transform (peft, bitsandbytes), between building and
        wrapping as they call it; the hooks above stay on the same modules, which peft wraps in place."""
        if spec.adapters is None:
            return model

        plan = plan_from_parts(spec.model_config, spec.strategy_obj, spec.seq_len, spec.world_size,
                               adapters=spec.adapters)
        return apply_transforms(model, plan)

    def _setup_deepspeed(self, model: nn.Module, s) -> None:
        import deepspeed

        if s.activation_checkpointing:
            kwargs = {"use_reentrant": False}
            if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.24
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        config = dict(self.spec.deepspeed_config or {})
        trainable = [p for p in model.parameters() if p.requires_grad]  # a LoRA base is frozen, as in the backend
        optimizer = torch.optim.AdamW(trainable, lr=1e-4, weight_decay=self.spec.weight_decay,
                                      foreach=self.spec.foreach_adam)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                                                 dist_init_required=False)
        self.model = self.engine

    # -- DDP communication ----------------------------------------------------------------------
    # DDP's reducer keeps its gradient buckets in C++; the hook is where Python sees them.
    # No annotations on purpose: DDP checks them against its own types.
    def _allreduce_hook(self, state, bucket):
        """torch's default: divide the bucket by the world size and all-reduce it, both in place
        (torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py, `allreduce_hook`)."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        if self.counter is not None:
            self.counter.tag("comm_buckets", [bucket.buffer()])
        return allreduce_hook(state, bucket)

    def _allreduce_hook_fake(self, state, bucket):
        """A fake process group's work carries no value, which the reducer rejects: the in-place
        result is the bucket itself."""
        if self.counter is not None:
            self.counter.tag("comm_buckets", [bucket.buffer()])
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    # -- phases ------------------------------------------------------------------------------
    def _phase(self, name: str) -> None:
        if self.counter is not None:
            self.counter.phase = name

    def _install_phase_hooks(self, model: nn.Module) -> None:
        """Storages born from the LM head's forward until the gradient of its output exists are the
        logits part (LM head output, loss temporaries, their gradients); the head's own backward
        (its weight gradient, the gradient of its input) belongs to the backward like any layer's."""
        head = model.get_output_embeddings()

        def on_output_grad(_grad: torch.Tensor) -> None:
            self._phase("backward")

        def pre_forward(_module: nn.Module, _args: tuple) -> None:
            if self.counter is not None and self.counter.phase == "forward":
                self._phase("logits")

        def post_forward(_module: nn.Module, _args: tuple, output: Any) -> None:
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(on_output_grad)

        head.register_forward_pre_hook(pre_forward)
        head.register_forward_hook(post_forward)

    # -- one step ----------------------------------------------------------------------------
    def _mark(self, name: str) -> None:
        if self.counter is not None:
            self.counter.mark(name)

    def step(self) -> None:
        """One optimizer step over `spec.gradient_accumulation` micro-batches, as the backends'
        `train_step` runs it, after the methods' phases (`run_phases`)."""
        self._mark("step_start")
        self.run_phases()
        for i in range(self.spec.gradient_accumulation):
            self.forward_backward(i)
        self.optimizer_step()

    def run_phases(self) -> None:
        """Each method phase of the spec (methods/spec.py SimulatedPhase) once per micro-batch of the step,
        in its own counter phase, as a GRPO step samples every micro-batch's rollouts first; what they
        return is kept until the next step's phases have run, as the method keeps its rollouts."""
        if not self.spec.phases:
            return
        kept = []
        for phase in self.spec.phases:
            module, name = phase["function"].split(":")
            function = getattr(importlib.import_module(module), name)
            for _ in range(self.spec.gradient_accumulation):
                self._phase(phase["name"])
                kept.append(function(self.model, phase["settings"]))
        self._phase("idle")
        self.kept = kept

    def forward_backward(self, index: int = 0) -> None:
        """Micro-batch `index` of the step: {"input_ids", "labels"}, as orchestrate/data/pipeline.py
        batches it. DeepSpeed counts micro-steps itself (`engine.step()` after each; only the
        boundary one steps); DDP (and FSDP2 if its settings say so) sync only on the last."""
        n = self.spec.gradient_accumulation
        last = index == n - 1
        self._phase("forward")
        rows = self.spec.rows or self.spec.strategy["micro_batch_size"]
        ids = torch.randint(0, self.cfg.vocab_size, (rows, self.spec.seq_len))
        labels = ids.clone()
        sync: Any = contextlib.nullcontext()
        if self.spec.sync_last_micro_batch_only and self.backend == "fsdp":
            self.model.set_requires_gradient_sync(last)
        elif self.spec.sync_last_micro_batch_only and self.backend == "ddp" and not last:
            sync = self.model.no_sync()
        autocast = (torch.autocast("cpu", dtype=_DTYPES[self.precision])
                    if self.backend == "ddp" and self.precision in _DTYPES else contextlib.nullcontext())
        with sync:
            with autocast:
                loss = self.model(input_ids=ids, labels=labels).loss  # the output (and its logits) is dropped
            self._mark("forward_end")
            self._phase("logits")  # backward starts with the loss and the LM head
            if self.engine is not None:
                self.engine.backward(loss)  # divides by the accumulation itself
            else:
                (loss / n).backward()
        del ids, labels, loss
        self._mark("backward_end")
        self._phase("optimizer")
        self.tag_state()
        if self.engine is not None and not last:
            self._phase("idle")
            self.engine.step()

    def optimizer_step(self) -> None:
        self._phase("optimizer")
        if self.engine is not None:
            self.engine.step()  # the boundary micro-step: clips, steps and zeroes the gradients
            self.tag_state()
        else:
            from torch.distributed.tensor import DTensor

            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.spec.grad_clip or math.inf)
            if isinstance(norm, DTensor):
                norm = norm.full_tensor()
            self.optimizer.step()
            self.tag_state()
            self.optimizer.zero_grad(set_to_none=True)
        self._phase("idle")
        self._mark("step_end")

    # -- what the model state is -------------------------------------------------------------
    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Tensors holding the model state now, by kind; DTensors are given as their local shards."""
        from torch.distributed.tensor import DTensor

        def local(t: torch.Tensor) -> torch.Tensor:
            return t._local_tensor if isinstance(t, DTensor) else t

        out: dict[str, list[torch.Tensor]] = {k: [] for k in (
            "parameters", "master_weights", "gradients", "optimizer_states", "comm_buckets", "buffers")}
        params = list(self.hf_model.parameters())
        for p in params:
            ds_part = getattr(p, "ds_tensor", None)  # ZeRO-3: this rank's partition
            out["parameters"].append(local(ds_part if ds_part is not None else p))
            if p.grad is not None:
                out["gradients"].append(local(p.grad))
        out["buffers"] = [local(b) for b in self.hf_model.buffers()]
        inner = self.optimizer
        if self.engine is not None:
            for name, value in vars(self.optimizer).items():
                kind = _DS_ATTRS.get(name) or ("comm_buckets" if "ipg" in name else None)
                if kind:
                    out[kind] += _tensors_in(value)
            for t in _tensors_in(getattr(self.optimizer, "single_partition_of_fp32_groups", []))\
                    + _tensors_in(getattr(self.optimizer, "fp32_partitioned_groups_flat", [])):
                if t.grad is not None:
                    out["gradients"].append(t.grad)
            inner = getattr(self.optimizer, "optimizer", self.optimizer)
        for state in inner.state.values():
            out["optimizer_states"] += [local(v) for v in state.values() if isinstance(v, torch.Tensor)]
        return out

    def tag_state(self) -> None:
        if self.counter is None:
            return
        state = self.state_tensors()
        # Buckets first so a parameter or gradient view into the same storage wins.
        for kind in ("comm_buckets", "buffers", "optimizer_states", "gradients", "master_weights", "parameters"):
            self.counter.tag(kind, state[kind])


def _tensors_in(value: Any, depth: int = 0) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if depth > 2:
        return []
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors_in(v, depth + 1)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors_in(v, depth + 1)]
    return []


def run(spec: RunSpec, counter: LiveStorageCounter, mesh: Any = None) -> Trainer:
    """Build and train `spec.steps` steps inside `counter` (entered by the caller, with FakeTensorMode
    under it for a simulation). The peak counts training only: model construction on the CPU is
    not what a GPU holds."""
    # Python's cyclic garbage collector runs when allocation counts say so, which differ between
    # processes: a few small tensors caught in reference cycles would die at different moments.
    # Collected at step boundaries only, so every run frees them at the same point.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        comm = fsdp_comm_phase(counter) if spec.strategy["backend"] == "fsdp" else contextlib.nullcontext()
        with cuda_like_dropout(), comm:
            trainer = Trainer(spec, counter, mesh)
            gc.collect()
            counter.phase = "idle"
            counter.reset_peak()
            for _ in range(spec.steps):
                trainer.step()
                gc.collect()
    finally:
        if gc_was_enabled:
            gc.enable()
    return trainer
