"""The DeepSpeed config for a stock Hugging Face `Trainer` (`orchestrate config --for hf-trainer`),
plus the `TrainingArguments` values that make it train like the plan.

Pure, like `deepspeed_render.py`, whose file this starts from. transformers fills every key set to
"auto" from `TrainingArguments` and refuses a concrete value that differs from them
(transformers/integrations/deepspeed.py, `HfTrainerDeepSpeedConfig.trainer_config_process` and
`trainer_config_finalize`, read in the installed 5.24): the batch sizes, gradient_clipping,
fp16/bf16 `enabled` and the optimizer's lr/betas/eps/weight_decay. Those are "auto" here, so the
file runs under any world size and any TrainingArguments; the ZeRO settings stay the plan's
(transformers only fills bucket sizes that are "auto", with the same hidden-size formulas).

No "scheduler" block: DeepSpeed's WarmupCosineLR cannot run orchestrate's schedule (its step 0
always runs at lr 0, see deepspeed_render.py), whereas without the block transformers builds its
own from `lr_scheduler_type` (`deepspeed_optim_sched`), and "cosine_warmup_with_min_lr" is
orchestrate's schedule exactly (orchestrate/backends/schedule.py). The plan's values for it, and
for everything else "auto" leaves to TrainingArguments, are in TRAINING_ARGS_FILE: keyword
arguments for `TrainingArguments(deepspeed=..., **those)`.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from orchestrate.backends.deepspeed_render import render_config
from orchestrate.errors import Problem, UserError

if TYPE_CHECKING:
    from orchestrate.planner.plan import RunPlan

TARGET = "hf-trainer"
DEEPSPEED_FILE = "deepspeed-hf-trainer.json"
TRAINING_ARGS_FILE = "hf-training-args.json"
SCHEDULER_TYPE = "cosine_warmup_with_min_lr"  # transformers.SchedulerType.COSINE_WARMUP_WITH_MIN_LR

_AUTO_TOP = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping")
_AUTO_OPTIMIZER = ("lr", "betas", "eps", "weight_decay")


def check_plan(plan: RunPlan) -> None:
    """UserError unless the plan chose DeepSpeed: the Trainer variant is a DeepSpeed config."""
    backend = plan.strategy.backend
    if backend != "deepspeed":
        raise UserError(f"config --for {TARGET} needs a DeepSpeed plan", [Problem(
            "strategy.backend", f"the chosen strategy uses {backend}; the HF Trainer file is a DeepSpeed config",
            "pin DeepSpeed: --set strategy.backend=deepspeed")])


def hf_deepspeed_config(plan: RunPlan) -> dict[str, Any]:
    """deepspeed.json with "auto" wherever the Trainer fills the value, and no scheduler block."""
    check_plan(plan)
    cfg = render_config(plan)
    cfg.pop("scheduler", None)
    for key in _AUTO_TOP:
        cfg[key] = "auto"
    cfg["bf16"]["enabled"] = "auto"
    cfg["fp16"]["enabled"] = "auto"
    for key in _AUTO_OPTIMIZER:
        cfg["optimizer"]["params"][key] = "auto"
    return cfg


def training_args(plan: RunPlan) -> dict[str, Any]:
    """`TrainingArguments` keywords carrying the plan's batch, optimizer, clipping, precision and
    schedule (the per-device batch and accumulation are the plan's for its world size)."""
    check_plan(plan)
    train, strategy = plan.config.train, plan.strategy
    opt = train.optimizer
    return {
        "per_device_train_batch_size": strategy.micro_batch_size,
        "gradient_accumulation_steps": plan.chosen.gradient_accumulation,
        # train.num_epochs: the Trainer counts its steps from the data as orchestrate does (TrainSection.epoch_steps)
        **({"max_steps": train.max_steps} if train.num_epochs is None else {"num_train_epochs": train.num_epochs}),
        "learning_rate": opt.lr,
        "adam_beta1": opt.betas[0],
        "adam_beta2": opt.betas[1],
        "adam_epsilon": opt.eps,
        "weight_decay": opt.weight_decay,
        "max_grad_norm": train.grad_clip,
        "lr_scheduler_type": SCHEDULER_TYPE,
        "warmup_steps": train.schedule.warmup_steps,
        "lr_scheduler_kwargs": {"min_lr_rate": train.schedule.min_lr_ratio},
        "bf16": strategy.precision == "bf16",
        "fp16": strategy.precision == "fp16",
        "seed": train.seed,
        **({"neftune_noise_alpha": train.neftune_noise_alpha} if train.neftune_noise_alpha is not None else {}),
    }


def render(plan: RunPlan) -> dict[str, str]:
    """File name -> text of both files."""
    return {DEEPSPEED_FILE: json.dumps(hf_deepspeed_config(plan), indent=2) + "\n",
            TRAINING_ARGS_FILE: json.dumps(training_args(plan), indent=2) + "\n"}
