"""GRPO on the worker: the reference (beta > 0 only; TRL's default beta 0 has none): under LoRA / QLoRA
the trained model with its adapters disabled (preference/reference.py's `peft_model`, as TRL does with
peft), else a frozen replicated copy of the model's initial weights (loading/auxiliary.py
`build_frozen`); the rewards, imported before the first step (your own function behind
model.trust_remote_code); the chat template that renders message prompts; then the GRPO objective
(objective.py) in place of the task's, and its metrics (`GrpoMetrics`)."""

from __future__ import annotations

from typing import Any

import torch

from orchestrate.backends.base import Objective
from orchestrate.backends.fsdp import fsdp_settings
from orchestrate.backends.rank import Rank
from orchestrate.data.chat_template import resolve_template, yaml_template
from orchestrate.data.pipeline import TrainData
from orchestrate.loading.auxiliary import build_frozen
from orchestrate.loading.init_weights import ensure_initial_weights
from orchestrate.methods.grpo.objective import GrpoObjective, ReferenceScores
from orchestrate.methods.grpo.rewards import reward_functions
from orchestrate.methods.grpo.rollout import Rollout, completion_logps
from orchestrate.methods.preference.callback import PreferenceMetrics
from orchestrate.methods.preference.reference import peft_model
from orchestrate.methods.runtime import MethodRuntime
from orchestrate.planner.plan import RunPlan
from orchestrate.run.layout import RunDir


def adapter_reference(chunks: int) -> ReferenceScores:
    def logps(model: torch.nn.Module, rollout: Rollout) -> torch.Tensor:
        with peft_model(model).disable_adapter():
            return completion_logps(model, rollout, chunks)

    return logps


def module_reference(reference: torch.nn.Module, chunks: int) -> ReferenceScores:
    def logps(model: torch.nn.Module, rollout: Rollout) -> torch.Tensor:
        return completion_logps(reference, rollout, chunks)

    return logps


def _template(plan: RunPlan, tokenizer: Any) -> Any:
    """The chat template of message prompts (None: the byte tokenizer, or a tokenizer without one and
    no data.chat_template: plain-text prompts only)."""
    hf = getattr(tokenizer, "tok", None)
    given = yaml_template(plan.config)
    if given is not None or hf is None or getattr(hf, "chat_template", None) is None:
        return given
    return resolve_template(None, hf)


def _reshards_after_forward(plan: RunPlan) -> bool:
    """The FSDP2 blocks' reshard_after_forward, which the rollout gives back after gathering (gather.py)."""
    if plan.strategy.backend != "fsdp":
        return True
    return fsdp_settings(plan)["fully_shard"]["reshard_after_forward"]


class GrpoRuntime(MethodRuntime):
    def auxiliary(self, plan: RunPlan, rank: Rank, run: RunDir, data: TrainData) -> dict[str, Any]:
        """The prompts, tokenizer, rewards and reference the objective needs."""
        chunks = plan.strategy.loss_chunks
        reference = None
        if plan.config.grpo.beta:
            if plan.config.train.method in ("lora", "qlora"):
                reference = adapter_reference(chunks)
            else:
                path = ensure_initial_weights(plan, run.path, rank.local_rank)
                reference = module_reference(build_frozen(plan, path, rank.device, rank.world_size, "replicated"),
                                             chunks)
        return {"data": data, "rewards": reward_functions(plan.config), "reference": reference}

    def objective(self, plan: RunPlan, task: Objective, auxiliary: dict[str, Any]) -> Objective:
        data = auxiliary["data"]
        eos = [data.tokenizer.eos_id]
        hf = getattr(data.tokenizer, "tok", None)
        if hf is not None:  # the end of an assistant turn (<|im_end|>) where the model's generation config names it
            from transformers import GenerationConfig

            try:
                extra = GenerationConfig.from_pretrained(data.tokenizer_dir).eos_token_id
            except OSError:
                extra = None
            eos += [i for i in ([extra] if isinstance(extra, int) else extra or []) if i not in eos]
        return GrpoObjective(plan.config, data.train, data.validation, data.tokenizer, _template(plan, data.tokenizer),
                             auxiliary["rewards"], eos, auxiliary["reference"], plan.chosen.gradient_accumulation,
                             plan.strategy.loss_chunks, _reshards_after_forward(plan))

    def callbacks(self, plan: RunPlan) -> list[PreferenceMetrics]:
        return [GrpoMetrics()]


class GrpoMetrics(PreferenceMetrics):
    """The GRPO metrics of every step under TRL's names (reward, reward_std, rewards/<name>/mean,
    frac_reward_zero_std, completions/mean_length, completions/clipped_ratio, kl, clip_ratio): the
    objective keeps their sums over the step's micro-batches and adds them up over the ranks (one
    all-reduce per step). The preference method's step callback with another record (its phase, and the
    sums dropped before step 1); at the start it tells the objective the step a resumed run starts
    after, so its cycles of num_iterations steps stay where the uninterrupted run's are."""

    def on_train_start(self, training) -> None:  # (Training): worker/callbacks/base.py
        super().on_train_start(training)
        training.engine.objective.start_at(training.start_step)

    def on_step_end(self, training, end) -> None:  # (Training, StepEnd): worker/callbacks/base.py
        end.add(training.engine.objective.take_metrics(training.rank.device))


RUNTIME = GrpoRuntime()
