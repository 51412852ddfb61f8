"""The GRPO objective (docs/grpo.md): for a micro-batch of prompts, sample num_generations completions
of each from the current policy (rollout.py), score them with the rewards (rewards.py), turn the
rewards into group-relative advantages, and take the clipped surrogate loss over the completion
tokens (losses.py), as TRL's GRPOTrainer does (huggingface/trl, trl/trainer/grpo_trainer.py).

With num_iterations μ > 1 the rollouts of a step, and their log-probabilities under the policy that
sampled them (π_old, scored under no_grad right after sampling), are kept and trained on for μ
optimizer steps (DeepSeekMath Algorithm 1's inner loop); the prompts the sampler hands those later
steps are passed over. With μ = 1, π_old is the policy itself, detached (the ratio is 1, its gradient
the policy gradient). The reference (beta > 0) is scored once per rollout, under no_grad.

Per step it keeps the sums TRL logs (reward, reward_std, rewards/<name>/mean, completions/mean_length,
completions/clipped_ratio, kl, clip_ratio), read and reset by callback.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from orchestrate.config.schema import RunConfig
from orchestrate.methods.grpo.config import RewardSection
from orchestrate.methods.grpo.losses import group_advantages, policy_loss
from orchestrate.methods.grpo.prompts import PromptSamples, render_prompt
from orchestrate.methods.grpo.rewards import RewardFunction, score
from orchestrate.methods.grpo.rollout import Rollout, completion_logps, generate

ReferenceScores = Callable[[torch.nn.Module, Rollout], torch.Tensor]
"""(the trained model, rollout) -> the reference's completion log-probabilities (under no_grad)."""


@dataclass
class Scored:
    """One micro-batch's rollouts, ready for the loss."""

    rollout: Rollout
    advantages: torch.Tensor
    old_logps: torch.Tensor | None
    ref_logps: torch.Tensor | None


class GrpoObjective:
    name = "grpo"

    def __init__(self, config: RunConfig, train: PromptSamples, validation: PromptSamples, tokenizer: Any,
                 template: Any, rewards: list[tuple[RewardSection, RewardFunction]], eos_ids: list[int],
                 reference: ReferenceScores | None, accumulation: int, loss_chunks: int = 0) -> None:
        self.config, self.settings = config, config.grpo
        self.train, self.validation = train, validation
        self.tokenizer, self.template, self.rewards = tokenizer, template, rewards
        self.eos_ids, self.pad_id = eos_ids, eos_ids[0]
        self.reference = reference
        self.accumulation, self.loss_chunks = accumulation, loss_chunks
        self.max_prompt = max(1, config.train.seq_len - self.settings.max_completion_length)
        self.calls = 0
        self.kept: list[Scored | None] = [None] * accumulation
        """This cycle's rollouts, one per micro-batch of a step (num_iterations)."""
        self.sums: dict[str, torch.Tensor] = {}

    def _decode(self, ids: list[int]) -> str:
        hf = getattr(self.tokenizer, "tok", None)
        return self.tokenizer.decode(ids) if hf is None else hf.decode(ids, skip_special_tokens=True)

    def _score(self, model: torch.nn.Module, records: list[dict[str, Any]], sums: dict[str, float]) -> Scored:
        """Sample, reward and score one micro-batch's prompts; their metrics' sums into `sums`."""
        g, prompt_key = self.settings.num_generations, self.config.data.columns.prompt
        ids = [render_prompt(r[prompt_key], self.config, self.tokenizer, self.template)[-self.max_prompt:]
               for r in records]
        rollout = generate(model, ids, self.settings, self.eos_ids, self.pad_id)
        lengths = rollout.completion_mask.sum(dim=1)
        texts = [self._decode(row[:n].tolist()) for row, n in zip(rollout.completion_ids.cpu(), lengths.tolist(),
                                                                  strict=True)]
        columns = {k: [r.get(k) for r in records for _ in range(g)] for k in {k for r in records for k in r}
                   if k != prompt_key}
        prompts = [r[prompt_key] for r in records for _ in range(g)]
        per_reward = score(self.rewards, prompts, texts, lengths.tolist(), columns)
        weights = torch.tensor([s.weight for s, _ in self.rewards], dtype=torch.float32)
        values = torch.tensor(per_reward, dtype=torch.float32)  # (rewards, completions)
        total = (weights.unsqueeze(1) * values).sum(dim=0)
        advantages = group_advantages(total, g, self.settings.scale_rewards).to(rollout.input_ids.device)
        sums["completions"] = sums.get("completions", 0.0) + total.numel()
        sums["groups"] = sums.get("groups", 0.0) + total.numel() / g
        sums["reward"] = sums.get("reward", 0.0) + float(total.sum())
        sums["reward_std"] = sums.get("reward_std", 0.0) + float(total.view(-1, g).std(dim=1).sum())
        for (section, _), row in zip(self.rewards, values, strict=True):
            key = f"rewards/{section.label}/mean"
            sums[key] = sums.get(key, 0.0) + float(row.sum())
        sums["completions/length"] = sums.get("completions/length", 0.0) + float(lengths.sum())
        sums["completions/clipped"] = sums.get("completions/clipped", 0.0) + float(rollout.truncated.sum())
        with torch.no_grad():
            old = completion_logps(model, rollout, self.loss_chunks) if self.settings.num_iterations > 1 else None
            ref = self.reference(model, rollout) if self.reference is not None else None
        return Scored(rollout, advantages, old, ref)

    def _loss(self, model: torch.nn.Module, scored: Scored) -> tuple[torch.Tensor, Any]:
        logps = completion_logps(model, scored.rollout, self.loss_chunks)
        old = scored.old_logps if scored.old_logps is not None else logps.detach()
        return logps, policy_loss(self.settings, logps, old, scored.advantages, scored.rollout.completion_mask,
                                  scored.ref_logps)

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        slot = self.calls % self.accumulation
        fresh = (self.calls // self.accumulation) % self.settings.num_iterations == 0
        self.calls += 1
        sums: dict[str, float] = {}
        if fresh or self.kept[slot] is None:
            records = [self.train.records[i] for i in batch["prompt_index"].tolist()]
            self.kept[slot] = self._score(model, records, sums)
        _, out = self._loss(model, self.kept[slot])
        sums["batches"] = 1.0
        sums["clip_ratio"] = float(out.clip_ratio)
        if out.kl is not None:
            sums["kl"] = float(out.kl)
        for key, value in sums.items():
            self.sums[key] = self.sums.get(key, 0.0) + value
        return out.loss

    def take_sums(self) -> dict[str, float]:
        """This step's sums, reset for the next."""
        sums, self.sums = self.sums, {}
        return sums

    def take_metrics(self, device: torch.device) -> dict[str, float]:
        """This step's metrics over every rank (collective: each rank has the same keys), reset."""
        sums = self.take_sums()
        keys = sorted(sums)
        values = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(values)
        return step_metrics(dict(zip(keys, values.tolist(), strict=True)))

    def eval_sums(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """Held-out prompts: sampled completions' rewards, and the loss at the sampling policy."""
        records = [self.validation.records[i] for i in batch["prompt_index"].tolist()]
        sums: dict[str, float] = {}
        _, out = self._loss(model, self._score(model, records, sums))
        return {"loss": float(out.loss), **sums}

    def metrics(self, sums: dict[str, float], batches: int) -> dict[str, float]:
        return {"eval_loss": sums["loss"] / batches,
                **{f"eval_{key}": value for key, value in step_metrics(sums).items()}}


def step_metrics(sums: dict[str, float]) -> dict[str, float]:
    """The logged metrics from sums over micro-batches and ranks (TRL's names): per-completion means of
    the rewards and lengths, the mean over groups of each group's reward std, batch means of kl and
    clip_ratio. A step that reuses kept rollouts (num_iterations) logs no rewards."""
    out = {}
    if sums.get("completions"):
        n = sums["completions"]
        out = {"reward": sums["reward"] / n, "reward_std": sums["reward_std"] / sums["groups"],
               "completions/mean_length": sums["completions/length"] / n,
               "completions/clipped_ratio": sums["completions/clipped"] / n,
               **{k: v / n for k, v in sums.items() if k.startswith("rewards/")}}
    if sums.get("batches"):
        out["clip_ratio"] = sums["clip_ratio"] / sums["batches"]
        if "kl" in sums:
            out["kl"] = sums["kl"] / sums["batches"]
    return out
