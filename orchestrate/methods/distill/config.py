"""The `distill:` section: train the model (the student) to match a frozen teacher's soft targets
(Hinton et al. 2015, "Distilling the Knowledge in a Neural Network"). docs/distillation.md."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from orchestrate.config.section import Section

Placement = Literal["replicated", "sharded", "offload", "precomputed"]


class DistillSection(Section):
    teacher: str
    """The teacher: a local Hugging Face model directory (config.json + safetensors) of the same
    task, trained with the same tokenizer and vocabulary as the student (checked at plan time).
    Relative paths are resolved against the YAML file's directory."""

    temperature: float = Field(default=2.0, gt=0, le=100)
    """T: both distributions are softened as softmax(logits / T); the KL term is scaled by T² so its
    gradients keep their size as T changes (Hinton et al. 2015, section 2)."""

    alpha: float = Field(default=0.5, ge=0.0, le=1.0)
    """Weight of the hard-label cross-entropy: loss = alpha·CE + (1 − alpha)·T²·KL(teacher ‖ student)."""

    placement: Literal["auto", "replicated", "sharded", "offload", "precomputed"] = "auto"
    """Where the teacher lives. replicated: a full copy per rank. sharded: FSDP2 `fully_shard`
    (reshard_after_forward) over the ranks, gathered one block at a time. offload: sharded with its
    parameters in CPU RAM (FSDP2 CPUOffloadPolicy; on CPU-only machines the teacher is in host
    memory already). precomputed: a first pass writes the teacher's top-k logits per token into a
    memory-mapped cache in the run directory and training reads them (teacher and student never in
    memory together). auto: the planner takes the first of replicated, sharded (several ranks),
    offload (GPUs) and precomputed that fits beside the student, per strategy."""

    top_k: int = Field(default=64, gt=0, le=65536)
    """precomputed: logits kept per token; the KL runs over the teacher's top-k tokens (its
    probabilities renormalised over them)."""
