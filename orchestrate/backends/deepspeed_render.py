"""Render a plan's chosen strategy as a complete DeepSpeed JSON: every value concrete, none "auto".

Pure (no I/O, no devices, no deepspeed import) so the launcher can write it for the user to read,
diff and reuse, and the worker passes the very same dict to `deepspeed.initialize`.

The file carries "optimizer" (AdamW) and "scheduler" (WarmupCosineLR) blocks so it runs as it is
under a stock DeepSpeed script; with `train.num_epochs` no scheduler block (WarmupCosineLR needs the
total steps, which follow from the prepared data: the script sets its own). The orchestrate backend strips both (`engine_config`) and hands
DeepSpeed its own AdamW (DeepSpeedCPUAdam when offloaded) and the LambdaLR of
`orchestrate/backends/schedule.py`, so DeepSpeed, FSDP2 and DDP runs follow the very same curve.

How close WarmupCosineLR comes (deepspeed/runtime/lr_schedules.py, read in the installed 0.19):
DeepSpeed sets lr = ratio(i) x lr where i = the number of scheduler steps so far, starting at -1
(ratio 0 at construction, "before it has started"); linear warm-up ratio(i) = i / W for i < W,
then cosine with progress (i - W + 1) / (T - W) clamped to 1, floor cos_min_ratio. The optimizer
step k (0-based) therefore runs at ratio(k - 1). orchestrate's schedule (transformers'
"cosine_warmup_with_min_lr") runs step k at (k+1)/W in warm-up, then the cosine of
(k - W + 1) / (T - W). From step W+1 on DeepSpeed follows the same cosine one step late; during
warm-up it lags two steps (steps 0..W run at 0, 0, 1/W, ..., (W-1)/W instead of 1/W, ..., 1), and
no setting of WarmupCosineLR or WarmupDecayLR (linear decay) removes the lag: step 0 always runs
at 0. WarmupCosineLR also needs warmup_num_steps >= 1 (and uses at least 2). The HF Trainer
variant (`hf_trainer_render.py`) has no scheduler block and lets transformers build the exact one.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from orchestrate.errors import Problem, UserError
from orchestrate.planner import ds_buckets
from orchestrate.planner.constants import DS_SUB_GROUP_SIZE  # the memory model assumes it

if TYPE_CHECKING:
    from orchestrate.planner.plan import RunPlan
    from orchestrate.planner.strategy import Sharding

CONFIG_FILE = "deepspeed.json"

# DeepSpeed's own defaults, written out so the file shows everything that runs
# (deepspeed/runtime/zero/config.py, offload_config.py, swap_tensor/constants.py).
_OPTIMIZER_NVME_BUFFERS = 4  # Adam swaps 4 tensors per parameter: param, grad, exp_avg, exp_avg_sq
_PARAM_NVME_BUFFERS = 5
_PARAM_NVME_BUFFER_ELEMENTS = 10**8
_PARAM_MAX_IN_CPU = 10**9
_AIO = {
    "block_size": 1048576,
    "queue_depth": 8,
    # Called "thread_count" before DeepSpeed 0.15; deepspeed/runtime/swap_tensor/constants.py.
    "intra_op_parallelism": 1,
    "single_submit": False,
    "overlap_events": True,
}
_STEPS_PER_PRINT = 10**9  # the worker logs steps itself; DeepSpeed's own progress lines would duplicate them


def render_config(plan: RunPlan) -> dict[str, Any]:
    """The DeepSpeed config dict for `plan.chosen` (what `deepspeed.initialize(config=...)` receives)."""
    strategy = plan.strategy
    if strategy.backend != "deepspeed":
        raise ValueError(f"strategy {strategy.name} is not a deepspeed strategy")
    problems = sharding_problems(strategy.sharding)
    if problems:
        raise UserError("unsupported DeepSpeed strategy", problems)

    micro = strategy.micro_batch_size
    accumulation = plan.chosen.gradient_accumulation
    cfg: dict[str, Any] = {
        # DeepSpeed asserts train = micro x accumulation x world (runtime/config.py, _batch_assertion). Under
        # sequence parallelism it is given no groups (no mpu, no sequence_parallel_size): it takes every rank
        # for data parallel, shards and averages gradients over all, which the loss's reduction expects
        # (backends/sequence_parallel.py); its batch count then counts each sample once per slice.
        "train_batch_size": micro * accumulation * plan.world_size,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": plan.config.train.grad_clip,  # 0 disables clipping in DeepSpeed too
        "bf16": {"enabled": strategy.precision == "bf16"},
        "fp16": _fp16(strategy.precision == "fp16"),
        "zero_optimization": _zero(plan),
        "steps_per_print": _STEPS_PER_PRINT,
        "wall_clock_breakdown": False,
    }
    if "nvme" in (strategy.offload_optimizer, strategy.offload_params):
        cfg["aio"] = dict(_AIO)
    cfg["optimizer"] = _optimizer(plan)
    if plan.config.train.num_epochs is None:  # else the step count follows from the data (no total to write)
        cfg["scheduler"] = _scheduler(plan)
    return cfg


def sharding_problems(sharding: Sharding) -> list[Problem]:
    """What DeepSpeed's ZeRO cannot do, or orchestrate does not do with it."""
    out, stage = [], sharding.zero_stage
    if stage == 0 and sharding.offload_optimizer != "none":
        out.append(Problem("strategy.offload", "optimizer offload needs ZeRO stage 1-3", "set zero_stage: 1, 2 or 3"))
    if sharding.offload_params != "none" and stage != 3:
        out.append(Problem("strategy.offload_params", f"only ZeRO-3 / FSDP full shard offload parameters, "
                           f"not stage {stage}", "set zero_stage: 3"))
    if sharding.hybrid_shard:
        out.append(Problem("strategy", "hybrid shard is an FSDP2 mode", "use backend fsdp"))
    return out


def engine_config(plan: RunPlan) -> dict[str, Any]:
    """What the orchestrate backend passes to `deepspeed.initialize`: the file without "optimizer" and
    "scheduler". DeepSpeed would use the client optimizer and scheduler anyway (engine.py
    `_configure_optimizer`, `_configure_lr_scheduler`), but stripping them keeps the dict free of
    a second, unused optimizer description and the run identical to one from before the blocks existed."""
    cfg = render_config(plan)
    del cfg["optimizer"]
    cfg.pop("scheduler", None)
    return cfg


def _optimizer(plan: RunPlan) -> dict[str, Any]:
    # DeepSpeed builds torch.optim.AdamW, or DeepSpeedCPUAdam(adamw_mode=True) under optimizer offload
    # (engine.py `_configure_basic_optimizer`): the same optimizers the orchestrate backend creates.
    opt = plan.config.train.optimizer
    return {"type": "AdamW", "params": {"lr": opt.lr, "betas": list(opt.betas), "eps": opt.eps,
                                        "weight_decay": opt.weight_decay}}


def _scheduler(plan: RunPlan) -> dict[str, Any]:
    train = plan.config.train
    return {"type": "WarmupCosineLR", "params": {
        "total_num_steps": train.max_steps,
        "warmup_num_steps": max(1, train.schedule.warmup_steps),  # DeepSpeed requires >= 1
        "warmup_min_ratio": 0.0,
        "warmup_type": "linear",
        "cos_min_ratio": train.schedule.min_lr_ratio,
    }}


def render(plan: RunPlan) -> dict[str, str]:
    return {CONFIG_FILE: json.dumps(render_config(plan), indent=2) + "\n"}


def _fp16(enabled: bool) -> dict[str, Any]:
    if not enabled:
        return {"enabled": False}
    # Dynamic loss scaling from 2^16, halved on overflow after `hysteresis` overflows, doubled after
    # 1000 clean steps: DeepSpeed's documented defaults (runtime/precision_config.py FP16_FORMAT).
    return {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
            "hysteresis": 2, "min_loss_scale": 1}


def _zero(plan: RunPlan) -> dict[str, Any]:
    strategy = plan.strategy
    stage = strategy.zero_stage
    if stage == 0:
        return {"stage": 0}
    hidden = plan.shape.hidden_size
    gpu = plan.hardware.has_gpu
    pin = gpu  # pinned host memory only speeds up GPU copies; on CPU it just locks RAM
    # Bucket sizes and overlap are shared with the memory model (planner/ds_buckets.py, which says why
    # they differ): GPU hidden^2, CPU the whole model in one bucket.
    bucket = ds_buckets.bucket_elements(plan.shape, gpu)
    zero: dict[str, Any] = {
        "stage": stage,
        # GPU: reduction on a side stream hides behind backward. CPU/gloo: no streams, and the
        # second ipg buffer would only cost memory, and overlap does not speed gloo up
        # (docs/measurements.md#backendsdeepspeed_renderpy).
        "overlap_comm": ds_buckets.overlap_comm(gpu),
        # Gradients copied into the ipg buffer as they are produced: no fragmentation of the GPU
        # allocator by many small gradient tensors (DeepSpeed docs, "contiguous_gradients"); on CPU it
        # neither helps nor hurts (docs/measurements.md#backendsdeepspeed_renderpy), so one setting for both.
        "contiguous_gradients": True,
        # GPU: about one layer's weight matrix, what Accelerate and transformers fill in for "auto"
        # (accelerate/accelerator.py `_prepare_deepspeed`; transformers/integrations/deepspeed.py
        # `trainer_config_finalize`): the ipg buffers live in GPU memory. CPU: one collective per step;
        # hidden^2 buckets are slower on gloo (ds_buckets.py).
        "reduce_bucket_size": bucket,
        "allgather_bucket_size": bucket,
        # reduce_scatter (default true) and round_robin_gradients (default false) are left at
        # DeepSpeed's defaults: flipping either stays within the noise on CPU
        # (docs/measurements.md#backendsdeepspeed_renderpy), and both are what DeepSpeed tunes for GPUs.
        "sub_group_size": DS_SUB_GROUP_SIZE,  # planned with it: see planner/constants.py
    }
    if strategy.offload_optimizer != "none":
        zero["offload_optimizer"] = _offload_optimizer(plan, pin)
    if stage == 3:
        zero["stage3_prefetch_bucket_size"] = ds_buckets.prefetch_elements(plan.shape)
        zero["stage3_param_persistence_threshold"] = 10 * hidden
        # Release gathered parameters after use instead of DeepSpeed's 1e9 defaults, under which a model
        # below 1e9 parameters stays gathered from forward into backward (up to 2 GB of 16-bit weights
        # on an 8 GB card): prefetching stops at one block + one bucket gathered (at the LM head, so the
        # end of forward holds the head alone; the first backward gather is not overlapped), and a
        # parameter is kept only if reused within two blocks (checkpointing's recompute -> backward,
        # one gather saved). The coordinator's code behind each, and what the memory model charges,
        # are in planner/ds_buckets.py.
        zero["stage3_max_live_parameters"] = ds_buckets.stage3_max_live(plan.shape)
        zero["stage3_max_reuse_distance"] = ds_buckets.stage3_reuse_distance(plan.shape)
        # save_hf_model consolidates the partitioned weights on rank 0.
        zero["stage3_gather_16bit_weights_on_model_save"] = True
        if strategy.offload_params != "none":
            zero["offload_param"] = _offload_param(plan, pin)
    return zero


def _offload_optimizer(plan: RunPlan, pin: bool) -> dict[str, Any]:
    device = plan.strategy.offload_optimizer
    block: dict[str, Any] = {"device": device, "pin_memory": pin}
    if device == "nvme":
        block.update(nvme_path=_nvme_path(plan), buffer_count=_OPTIMIZER_NVME_BUFFERS, fast_init=False)
    return block


def _offload_param(plan: RunPlan, pin: bool) -> dict[str, Any]:
    device = plan.strategy.offload_params
    block: dict[str, Any] = {"device": device, "pin_memory": pin}
    if device == "nvme":
        # Each swap buffer must hold this rank's partition of the largest parameter
        # (partitioned_param_swapper.py asserts numel <= buffer_size); the partition is 1/world of it.
        largest_partition = -(-plan.shape.largest_layer_parameters // plan.world_size)
        block.update(nvme_path=_nvme_path(plan), buffer_count=_PARAM_NVME_BUFFERS,
                     buffer_size=max(_PARAM_NVME_BUFFER_ELEMENTS, largest_partition),
                     max_in_cpu=_PARAM_MAX_IN_CPU)
    return block


def _nvme_path(plan: RunPlan) -> str:
    path = plan.config.strategy.nvme_path or plan.hardware.nvme_path
    if not path:
        raise UserError("NVMe offload needs a directory", [Problem(
            "strategy.nvme_path", "the chosen strategy offloads to NVMe but no NVMe directory is known",
            "set strategy.nvme_path to a directory on a fast NVMe disk, or choose offload: cpu")])
    return str(plan.config.resolve_path(path)) if plan.config.strategy.nvme_path else path
