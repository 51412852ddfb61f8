"""What the distillation teacher's outputs take (`distill:`, docs/distillation.md): its logits and the
soft-target loss's temporaries while training, the top-k cache entries when precomputed. Pure. Its
weights, gathered blocks, first pass and seconds are an auxiliary model's, priced by placement in
orchestrate/planner/auxiliary.py.

Live (replicated, sharded, offload): the teacher's logits in the compute dtype plus the loss's
full-vocabulary soft-target tensors. Precomputed: only the cached top-k logits of the micro-batch
(fp32 values + int64 ids) read from the run directory's memory map, and the student's
full-vocabulary soft targets the KL needs; the first pass holds one micro-batch's logits in the
compute dtype plus their fp32 copy for `topk`.
"""

from __future__ import annotations

from orchestrate.model.shape import ModelShape
from orchestrate.planner.auxiliary import AuxiliaryModel

SOFT_TARGET_BYTES_PER_TOKEN_VOCAB = 20
"""Peak of the distillation loss's full-vocabulary temporaries per token (forward and backward of
orchestrate/methods/distill/objective.py `soft_target_kl`), besides the student's own logits (counted by
memory.logits_bytes) and the teacher's: fp32 log-softmax of teacher/T and of student/T, the
element-wise KL and their gradients, as orchestrate.simulate's live-storage counter counts them on fp32 and
bf16 logits (docs/measurements.md#methodsdistillmemorypy)."""
STUDENT_SOFT_BYTES_PER_TOKEN_VOCAB = 12
"""The same against cached top-k logits: only the student's fp32 log-softmax over the whole
vocabulary and its gradients remain (+ the top-k terms; docs/measurements.md#methodsdistillmemorypy)."""
TOPK_BYTES_PER_ENTRY = 4 + 8
"""A precomputed cache entry as the loss reads it: fp32 logit + int64 token id (torch.gather's index)."""


def teacher_model(shape: ModelShape, placement: str, top_k: int) -> AuxiliaryModel:
    """The teacher as an auxiliary model: its shape, its configured placement and its outputs' bytes."""
    vocab = shape.vocab_size

    def output_bytes(placement: str, tokens: int, c: int) -> float:
        if placement == "precomputed":
            return tokens * (top_k * TOPK_BYTES_PER_ENTRY + vocab * STUDENT_SOFT_BYTES_PER_TOKEN_VOCAB)
        return tokens * vocab * (c + SOFT_TARGET_BYTES_PER_TOKEN_VOCAB)

    def first_pass_output_bytes(tokens: int, c: int) -> float:
        return tokens * vocab * (c + 4)

    return AuxiliaryModel("teacher", shape, placement, output_bytes, first_pass_output_bytes)
