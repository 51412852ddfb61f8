"""GRPO (`grpo:`): online reinforcement learning with group-relative advantages (Shao et al. 2024,
DeepSeekMath §4.1; TRL's GRPOTrainer; docs/grpo.md). An add-on method that composes with full
fine-tuning and LoRA / QLoRA and owns the objective: each step samples completions of its prompts from
the policy being trained, rewards them and trains on them.

Its files: config.py (`grpo:`), prompts.py (the prompt records, its own data), rewards.py, rollout.py
(sampling and scoring completions), gather.py (the weights gathered once per rollout phase), losses.py
(advantages and the clipped loss), objective.py, memory.py (the rollout phase's memory and time),
runtime.py (the worker's hooks and the step's metrics).
Verified under DDP, FSDP2 (full shard and shard-grad-op) and DeepSpeed ZeRO-2 / ZeRO-3 without offload,
ZeRO-2 with the optimizer on the CPU and ZeRO-3 with the optimizer and the parameters there
(`MethodTerms.shardings`; 2 gloo ranks: tests/methods/grpo/test_grpo_strategies.py); under parameter
sharding the rollout gathers the weights once per rollout phase (gather.py), onto the device with the
parameters offloaded too, priced in its memory and its time (memory.py `gathered_weight_bytes`,
`rollout_gather_seconds`). The offloaded ones have run on CPU ranks only, where offloading moves nothing,
so the planner takes them only where nothing without offload fits (`offloaded_last`), as LoRA's.
"""

from __future__ import annotations

from typing import Any

from orchestrate.config.schema import RunConfig
from orchestrate.errors import Problem, UserError
from orchestrate.hardware.profile import HardwareProfile
from orchestrate.methods.custom.module import require_trust
from orchestrate.methods.grpo.memory import (
    KEPT,
    NF4_BYTES_PER_PARAMETER,
    ROLLOUT,
    gathered_weight_bytes,
    kept_bytes,
    rollout_bytes,
    rollout_gather_seconds,
    rollout_seconds,
    scoring_bytes,
)
from orchestrate.methods.preference.memory import reference_model
from orchestrate.methods.spec import Method, SimulatedPhase
from orchestrate.model.shape import ModelShape
from orchestrate.planner.memory import compute_bytes
from orchestrate.planner.plan import PlanResult, RunPlan
from orchestrate.planner.strategy import Strategy
from orchestrate.planner.terms import MethodTerms, PlacedBytes, PricedTerms

_LORA = ("lora", "qlora")
VERIFIED_SHARDINGS = frozenset({("ddp", 0, "none", "none"), ("fsdp", 2, "none", "none"), ("fsdp", 3, "none", "none"),
                                ("deepspeed", 2, "none", "none"), ("deepspeed", 3, "none", "none"),
                                ("deepspeed", 2, "cpu", "none"), ("deepspeed", 3, "cpu", "cpu")})
"""(backend, zero_stage, offload_optimizer, offload_params) a GRPO run has been run under (2 CPU gloo
ranks: tests/methods/grpo/test_grpo_strategies.py); its base method may allow fewer (lora's). Not
ZeRO-3 with the optimizer alone offloaded (never run with GRPO), nor NVMe, nor FSDP2's CPUOffloadPolicy
(it needs an accelerator)."""


def _problems(config: RunConfig) -> list[Problem]:
    section, problems = config.grpo, []
    if config.model.task != "causal-lm" or config.model.module is not None:
        problems.append(Problem("grpo", "GRPO samples completions from a Hugging Face causal language model",
                                "remove grpo, or train a Hugging Face causal LM"))
    for other in ("distill", "preference"):
        if getattr(config, other) is not None:
            problems.append(Problem(other, f"{other} and GRPO both supply the training objective",
                                    f"run {other} first, then GRPO on its RUN_DIR/model"))
    if section.max_completion_length >= config.train.seq_len:
        problems.append(Problem("grpo.max_completion_length", f"{section.max_completion_length} leaves no room for the "
                                f"prompt in train.seq_len {config.train.seq_len} (prompt + completion)",
                                "raise train.seq_len to the longest prompt plus max_completion_length"))
    for n, reward in enumerate(section.rewards):
        if reward.kind == "function":
            try:
                require_trust(config, f"grpo.rewards[{n}].function", repr(reward.function))
            except UserError as err:
                problems += err.problems
    return problems


class Grpo(Method):
    name = "grpo"
    bases = ("full", "lora")
    objective = True
    runtime = "orchestrate.methods.grpo.runtime"
    data = "orchestrate.methods.grpo.prompts"
    record_format = "prompt-completion"
    """Its prompts render as prompt-completion records' prompts do (prompts.py `render_prompt`): messages
    with the chat template, a string with data.chat_template as one user turn, else as it is."""
    metric_keys = ("reward", "rewards/", "frac_reward_zero_std", "completions/", "kl", "clip_ratio")
    """What callback.py records per step (TRL's names)."""

    def active(self, config: RunConfig) -> bool:
        return config.grpo is not None

    def record_noun(self, config: RunConfig) -> str:
        """Its samples are the prompts it samples completions of (prompts.py)."""
        return "prompts"

    def run_summary(self, config: RunConfig, records: list[dict[str, Any]]) -> list[str]:
        """The mean reward, first step -> last, and the held-out one of the last evaluation."""
        rewarded = [r for r in records if "reward" in r]
        if not rewarded:
            return []
        lines = [f"- reward: {rewarded[0]['reward']:.4f} -> {rewarded[-1]['reward']:.4f} (completions' mean "
                 f"length {rewarded[-1]['completions/mean_length']:.1f})"]
        evaluated = [r for r in records if r.get("eval_reward") is not None]
        if evaluated:
            lines.append(f"- held-out reward at step {evaluated[-1]['step']}: {evaluated[-1]['eval_reward']:.4f}")
        return lines

    def terms(self, config: RunConfig, shape: ModelShape, hw: HardwareProfile,
              auxiliary: dict[str, ModelShape]) -> MethodTerms:
        """The training forward over micro_batch_size × num_generations rows of train.seq_len (prompt +
        completion); the rollout phase before it (memory.py); the reference as an auxiliary model with
        beta > 0 (under LoRA / QLoRA the adapter-disabled base: no weights)."""
        problems = _problems(config)
        if problems:
            raise UserError("Cannot plan this GRPO run", problems)
        section, lora = config.grpo, config.train.method in _LORA
        reference = (reference_model(shape, "adapter" if lora else "replicated", adapter=lora),) if section.beta else ()
        weight_bytes = NF4_BYTES_PER_PARAMETER if config.train.method == "qlora" else None

        def priced(terms: MethodTerms, hw: HardwareProfile, rows: Strategy, seq_len: int,
                   accumulation: int) -> PricedTerms:
            c, n = compute_bytes(rows), rows.micro_batch_size
            rollout = sum(rollout_bytes(shape, section, n, seq_len, c).values())
            gathered = gathered_weight_bytes(shape, rows, config.train.method, c)
            held = max(rollout, scoring_bytes(shape, section, n, seq_len, rows.loss_chunks, c)) + gathered
            peak = ({"bf16": hw.gpu.peak_tflops_bf16, "fp16": hw.gpu.peak_tflops_fp16,
                     "fp32": hw.gpu.peak_tflops_fp32}[rows.precision] * 1e12) if hw.has_gpu else 0.0
            per_weight = weight_bytes if weight_bytes is not None else c
            seconds = rollout_seconds(shape, section, hw, n, seq_len, shape.parameters * per_weight, c, peak)
            return PricedTerms(own=PlacedBytes().on_gpu(KEPT, kept_bytes(n, seq_len, accumulation)),
                               before_activations={ROLLOUT: held},
                               compute_seconds=accumulation * seconds / section.num_iterations,
                               exposed_communication_seconds=rollout_gather_seconds(shape, section, hw, rows, gathered))

        return MethodTerms(chunks_loss=True, splits_sequence=False, sample_rows=section.num_generations,
                           shardings=VERIFIED_SHARDINGS, offloaded_last=True, auxiliary=reference,
                           gpu_keys=(ROLLOUT, KEPT), priced=priced)

    def simulation_refusal(self, config: RunConfig) -> Problem | None:
        if not config.grpo.beta or config.train.method in _LORA:
            return None
        return Problem("grpo.beta", "the reference of full fine-tuning with beta > 0 is a frozen copy of the model, which "
                       "the simulation does not build (it simulates the trained model only)",
                       "drop --simulate (the plan prices the copy), or simulate with --set grpo.beta=0")

    def simulated_phase(self, plan: RunPlan) -> SimulatedPhase:
        """The rollout phase before each micro-batch (simulation.py), on micro_batch_size prompts of the
        positions train.seq_len leaves before max_completion_length."""
        section, s = plan.config.grpo, plan.strategy
        reshard = s.zero_stage == 3  # the FSDP2 blocks' setting as the harness wraps them, given back after
        return SimulatedPhase(ROLLOUT, "orchestrate.methods.grpo.simulation:rollout", {
            "grpo": section.model_dump(mode="json"), "prompts": s.micro_batch_size,
            "prompt_positions": plan.config.train.seq_len - section.max_completion_length, "loss_chunks": s.loss_chunks,
            "reshard_after_forward": reshard, "eos_id": plan.shape.vocab_size,
            "adapter_reference": bool(section.beta) and plan.config.train.method in _LORA})

    def report(self, plan: PlanResult) -> tuple[list[str], dict[str, Any]]:
        """Both phases of the chosen plan: the rollout's bytes and the training step's."""
        chosen = getattr(plan, "chosen", None)
        if chosen is None:
            return [], {}
        section, gpu = plan.config.grpo, chosen.memory.gpu
        s = chosen.strategy
        rows = s.micro_batch_size * section.num_generations
        c = compute_bytes(s)
        parts = rollout_bytes(plan.shape, section, rows, plan.config.train.seq_len, c)
        gathered = gathered_weight_bytes(plan.shape, s, plan.config.train.method, c)
        if gathered:
            parts["gathered_weights"] = gathered
        training = gpu.get("activations", 0) + gpu.get("logits", 0)
        detail = ", ".join(f"{k} {_size(v)}" for k, v in parts.items())
        lines = [f"grpo: {section.num_generations} completions of <= {section.max_completion_length} tokens per prompt, "
                 f"{rows} rows per micro-batch; loss {section.loss_type}, beta {section.beta}",
                 f"grpo phases: rollout {_size(sum(parts.values()))} ({detail}); training {_size(training)} "
                 "(activations and logits); the peak is the larger"]
        return lines, {"grpo_phases": {"rollout": parts, "training": training}}


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


GRPO = Grpo()
