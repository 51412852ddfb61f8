"""The GRPO objective (docs/grpo.md): at the start of a step, sample num_generations completions of
every prompt of the step's micro-batches from the current policy (rollout.py), with the weights
gathered once for all of them (gather.py), score them with the rewards (rewards.py), turn the rewards
into group-relative advantages, then take the clipped surrogate loss over the completion tokens of
each micro-batch in turn (losses.py), as TRL's GRPOTrainer does (huggingface/trl,
trl/trainer/grpo_trainer.py: its generation batch is a step's micro-batches too, steps_per_generation
defaulting to gradient_accumulation_steps).

The engine hands the objective the step's micro-batches first (`begin_step`, the `StepObjective` hook
of backends/base.py): the rollout phase needs all of them before the first loss, for dapo's token
count and scale_rewards "batch"'s std, both over the whole step and every rank.

With num_iterations μ > 1 the rollouts of a step, and their log-probabilities under the policy that
sampled them (π_old, scored under no_grad right after sampling), are kept and trained on for μ
optimizer steps (DeepSeekMath Algorithm 1's inner loop); the prompts the sampler hands those later
steps are passed over. With μ = 1, π_old is the policy itself, detached (the ratio is 1, its gradient
the policy gradient). The reference (beta > 0) is scored once per rollout, under no_grad.

A checkpoint taken inside a cycle holds what the cycle keeps (`state_dict`: the `StatefulObjective`
hook of backends/base.py, saved per rank next to the RNG states), so a run resumed there trains its
remaining steps on the same rollouts as the uninterrupted run; one without it (written before
checkpoints held it, on another number of ranks, or under other GRPO settings) samples afresh, and
says so.

Per step it keeps the sums TRL logs (reward, reward_std, rewards/<name>/mean, frac_reward_zero_std,
completions/mean_length, completions/clipped_ratio, kl, clip_ratio), read and reset by runtime.py's
GrpoMetrics.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from orchestrate.config.schema import RunConfig
from orchestrate.methods.grpo.config import RewardSection
from orchestrate.methods.grpo.gather import gathered
from orchestrate.methods.grpo.losses import group_advantages, policy_loss, zero_std_groups
from orchestrate.methods.grpo.prompts import PromptSamples, render_prompt
from orchestrate.methods.grpo.rewards import RewardFunction, score
from orchestrate.methods.grpo.rollout import Rollout, completion_logps, generate

ReferenceScores = Callable[[torch.nn.Module, Rollout], torch.Tensor]
"""(the module to score with, rollout) -> the reference's completion log-probabilities (under no_grad)."""


@dataclass
class Sampled:
    """One micro-batch's completions and their rewards, before the step's advantages."""

    rollout: Rollout
    rewards: torch.Tensor
    """(completions,) the weighted sum of the rewards."""


@dataclass
class Scored:
    """One micro-batch's rollouts, ready for the loss."""

    rollout: Rollout
    advantages: torch.Tensor
    old_logps: torch.Tensor | None
    ref_logps: torch.Tensor | None


def _scored_state(scored: Scored) -> dict[str, Any]:
    """One kept micro-batch as tensors and ints (what torch.load(weights_only=True) reads back)."""
    rollout = scored.rollout
    state = {"input_ids": rollout.input_ids, "attention_mask": rollout.attention_mask,
             "prompt_positions": rollout.prompt_positions, "completion_mask": rollout.completion_mask,
             "truncated": rollout.truncated, "advantages": scored.advantages}
    return {**state, **{key: value for key, value in (("old_logps", scored.old_logps), ("ref_logps", scored.ref_logps))
                        if value is not None}}


def _scored_from(state: dict[str, Any]) -> Scored:
    rollout = Rollout(state["input_ids"], state["attention_mask"], state["prompt_positions"], state["completion_mask"],
                      state["truncated"])
    return Scored(rollout, state["advantages"], state.get("old_logps"), state.get("ref_logps"))


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _all_ranks(values: torch.Tensor) -> torch.Tensor:
    """Every rank's `values` (the same size on each), concatenated in rank order."""
    if not _distributed():
        return values
    parts = [torch.empty_like(values) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, values)
    return torch.cat(parts)


class GrpoObjective:
    name = "grpo"

    def __init__(self, config: RunConfig, train: PromptSamples, validation: PromptSamples, tokenizer: Any,
                 template: Any, rewards: list[tuple[RewardSection, RewardFunction]], eos_ids: list[int],
                 reference: ReferenceScores | None, accumulation: int, loss_chunks: int = 0,
                 reshard_after_forward: bool = True) -> None:
        self.config, self.settings = config, config.grpo
        self.train, self.validation = train, validation
        self.tokenizer, self.template, self.rewards = tokenizer, template, rewards
        self.eos_ids, self.pad_id = eos_ids, eos_ids[0]
        self.reference = reference
        self.accumulation = accumulation
        """The micro-batches of a step: the rollouts a cycle keeps, one per micro-batch."""
        self.loss_chunks = loss_chunks
        self.reshard_after_forward = reshard_after_forward
        self.max_prompt = max(1, config.train.seq_len - self.settings.max_completion_length)
        self.step = 0
        """Steps begun (the run's step count: `start_at` on a resumed run)."""
        self.kept: list[Scored] = []
        """This cycle's rollouts, one per micro-batch of a step (num_iterations)."""
        self.dapo_tokens: float | None = None
        """dapo's divisor for each micro-batch of this cycle (losses.py `policy_loss`; None: not dapo)."""
        self.slot = 0
        """The micro-batch of the step whose loss comes next."""
        self.sums: dict[str, float] = {}
        self.without_rollouts = ("it holds no GRPO rollouts: written before checkpoints kept them, or on another "
                                 "number of ranks")
        """Why a run resumed inside a cycle has no kept rollouts (the line its first step prints)."""

    def start_at(self, step: int) -> None:
        """A run that resumes after `step`: its cycles of num_iterations steps count from the run's start."""
        self.step = step

    def _mid_cycle(self) -> bool:
        """Whether the steps begun so far end inside a num_iterations cycle (its rollouts still to train on)."""
        return self.step % self.settings.num_iterations != 0

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint after this step must hold to go on as the uninterrupted run (`StatefulObjective`,
        backends/base.py): inside a cycle, its kept rollouts with their advantages and log-probabilities,
        dapo's divisor, and the settings that shaped them; nothing at a cycle's end (the next step samples).
        The metric sums are not in it: GrpoMetrics takes them at every step's end, before the checkpoint."""
        if not self.kept or not self._mid_cycle():
            return {}
        state = {"kept": [_scored_state(s) for s in self.kept], "num_iterations": self.settings.num_iterations,
                 "num_generations": self.settings.num_generations, "loss_type": self.settings.loss_type}
        return state if self.dapo_tokens is None else {**state, "dapo_tokens": self.dapo_tokens}

    def _unusable(self, state: dict[str, Any]) -> str | None:
        """Why `state` cannot carry this run's cycle on (None: it can): settings or a step shape that
        changed since the checkpoint (grpo.* and the micro-batches may change on --resume)."""
        changed = [f"grpo.{key} {state[key]} -> {now}" for key, now in (
            ("num_iterations", self.settings.num_iterations), ("num_generations", self.settings.num_generations),
            ("loss_type", self.settings.loss_type)) if state[key] != now]
        if len(state["kept"]) != self.accumulation:
            changed.append(f"micro-batches per step {len(state['kept'])} -> {self.accumulation}")
        if any(("ref_logps" in s) != (self.reference is not None) for s in state["kept"]):
            changed.append("grpo.beta (a reference) turned on or off")
        return ", ".join(changed) or None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's `state_dict` (tensors on this rank's device), before the resumed run's first step."""
        why = self._unusable(state) if state else None
        if why is not None:
            self.without_rollouts = f"its rollouts do not fit this run: {why}"
            return
        self.kept = [_scored_from(s) for s in state.get("kept", [])]
        self.dapo_tokens = state.get("dapo_tokens")

    def _decode(self, ids: list[int]) -> str:
        hf = getattr(self.tokenizer, "tok", None)
        return self.tokenizer.decode(ids) if hf is None else hf.decode(ids, skip_special_tokens=True)

    def _sample(self, inner: torch.nn.Module, records: list[dict[str, Any]], sums: dict[str, float]) -> Sampled:
        """Sample and reward one micro-batch's prompts with `inner` (gathered); their metrics' sums into `sums`."""
        g, prompt_key = self.settings.num_generations, self.config.data.columns.prompt
        ids = [render_prompt(r[prompt_key], self.config, self.tokenizer, self.template)[-self.max_prompt:]
               for r in records]
        rollout = generate(inner, ids, self.settings, self.eos_ids, self.pad_id)
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
        _add(sums, "completions", total.numel())
        _add(sums, "groups", total.numel() / g)
        _add(sums, "groups_zero_std", float(zero_std_groups(total, g).sum()))
        _add(sums, "reward", float(total.sum()))
        _add(sums, "reward_std", float(total.view(-1, g).std(dim=1).sum()))
        for (section, _), row in zip(self.rewards, values, strict=True):
            _add(sums, f"rewards/{section.label}/mean", float(row.sum()))
        _add(sums, "completions/length", float(lengths.sum()))
        _add(sums, "completions/clipped", float(rollout.truncated.sum()))
        return Sampled(rollout, total)

    def _scores(self, inner: torch.nn.Module, sampled: Sampled, advantages: torch.Tensor) -> Scored:
        """π_old (num_iterations > 1) and the reference's log-probabilities of its completions, no_grad."""
        rollout = sampled.rollout
        with torch.no_grad():
            old = completion_logps(inner, rollout, self.loss_chunks) if self.settings.num_iterations > 1 else None
            ref = self.reference(inner, rollout) if self.reference is not None else None
        return Scored(rollout, advantages.to(rollout.input_ids.device), old, ref)

    def begin_step(self, model: torch.nn.Module, micro_batches: list[dict[str, torch.Tensor]]) -> None:
        """The rollout phase of a step whose cycle starts (every num_iterations steps): sample, reward and
        score every micro-batch's prompts with the weights gathered once; the advantages and dapo's
        token count over the whole step, every rank's. Collective where the step is."""
        fresh = not self._mid_cycle() or not self.kept
        if self._mid_cycle() and not self.kept:  # resumed inside a cycle without its rollouts
            _say(f"step {self.step + 1} is inside a grpo.num_iterations cycle and the checkpoint resumed from does "
                 f"not carry it on ({self.without_rollouts}): the step samples afresh, the cycles then continue as "
                 "the uninterrupted run's")
        self.step += 1
        self.slot = 0
        if not fresh:
            return
        g, sums = self.settings.num_generations, {}
        with gathered(model, self.reshard_after_forward) as inner:
            sampled = [self._sample(inner, [self.train.records[i] for i in b["prompt_index"].tolist()], sums)
                       for b in micro_batches]
            rewards = torch.cat([s.rewards for s in sampled])
            every = _all_ranks(rewards) if self.settings.scale_rewards == "batch" else None
            advantages = group_advantages(rewards, g, self.settings.scale_rewards, every).split(
                [s.rewards.numel() for s in sampled])
            self.kept = [self._scores(inner, s, a) for s, a in zip(sampled, advantages, strict=True)]
        if self.settings.loss_type == "dapo":
            # The engines average the micro-batch losses over the step's micro-batches and the ranks (their
            # gradient all-reduce): dividing each sum by the step's count shared out so gives sum / count.
            tokens = torch.tensor([float(sum(s.rollout.completion_mask.sum() for s in sampled))], dtype=torch.float64)
            world = dist.get_world_size() if _distributed() else 1
            self.dapo_tokens = float(_all_ranks(tokens).sum().clamp(min=1.0)) / (len(micro_batches) * world)
        for key, value in sums.items():
            _add(self.sums, key, value)

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if not self.kept:
            raise RuntimeError("the GRPO objective's loss ran before its rollouts: the engine calls begin_step first")
        scored = self.kept[self.slot]
        self.slot += 1
        logps = completion_logps(model, scored.rollout, self.loss_chunks)
        old = scored.old_logps if scored.old_logps is not None else logps.detach()
        out = policy_loss(self.settings, logps, old, scored.advantages, scored.rollout.completion_mask,
                          scored.ref_logps, self.dapo_tokens)
        _add(self.sums, "batches", 1.0)
        _add(self.sums, "clip_ratio", float(out.clip_ratio))
        if out.kl is not None:
            _add(self.sums, "kl", float(out.kl))
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
        if _distributed():
            dist.all_reduce(values)
        return step_metrics(dict(zip(keys, values.tolist(), strict=True)))

    def eval_sums(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """Held-out prompts: sampled completions' rewards, and the loss at the sampling policy (the
        advantages and token count of this batch alone: scale_rewards "batch" and dapo over it)."""
        records = [self.validation.records[i] for i in batch["prompt_index"].tolist()]
        sums: dict[str, float] = {}
        with gathered(model, self.reshard_after_forward) as inner:
            sampled = self._sample(inner, records, sums)
            advantages = group_advantages(sampled.rewards, self.settings.num_generations, self.settings.scale_rewards)
            scored = self._scores(inner, sampled, advantages)
        logps = completion_logps(model, scored.rollout, self.loss_chunks)
        out = policy_loss(self.settings, logps, logps, scored.advantages, scored.rollout.completion_mask,
                          scored.ref_logps)
        return {"loss": float(out.loss), **sums}

    def metrics(self, sums: dict[str, float], batches: int) -> dict[str, float]:
        return {"eval_loss": sums["loss"] / batches,
                **{f"eval_{key}": value for key, value in step_metrics(sums).items()}}


def _say(line: str) -> None:
    """One line on rank 0's output (every rank takes the same path)."""
    if not _distributed() or dist.get_rank() == 0:
        print(f"orchestrate: {line}", flush=True)


def _add(sums: dict[str, float], key: str, value: float) -> None:
    sums[key] = sums.get(key, 0.0) + value


def step_metrics(sums: dict[str, float]) -> dict[str, float]:
    """The logged metrics from sums over micro-batches and ranks (TRL's names): per-completion means of
    the rewards and lengths, the mean over groups of each group's reward std, the share of groups whose
    rewards were all alike (frac_reward_zero_std), batch means of kl and clip_ratio. A step that reuses
    kept rollouts (num_iterations) logs no rewards."""
    out = {}
    if sums.get("completions"):
        n, groups = sums["completions"], sums["groups"]
        out = {"reward": sums["reward"] / n, "reward_std": sums["reward_std"] / groups,
               "frac_reward_zero_std": sums["groups_zero_std"] / groups,
               "completions/mean_length": sums["completions/length"] / n,
               "completions/clipped_ratio": sums["completions/clipped"] / n,
               **{k: v / n for k, v in sums.items() if k.startswith("rewards/")}}
    if sums.get("batches"):
        out["clip_ratio"] = sums["clip_ratio"] / sums["batches"]
        if "kl" in sums:
            out["kl"] = sums["kl"] / sums["batches"]
    return out
