"""The distillation teacher's memory and speed terms (`distill:`, docs/distillation.md). Pure.

The teacher is frozen: no gradients, no optimizer state, no master copy; it runs forward only,
under `torch.no_grad`, so its activations are freed block by block and only its logits stay for
the loss. What it costs depends on where it lives (`resolve_placement`):
- replicated: every rank holds the whole teacher in the compute dtype;
- sharded: FSDP2 `fully_shard(reshard_after_forward=True)` per block: 1/n of it per rank plus the
  gathered root and two blocks (the one running and the prefetched next; as the student's FSDP term);
- offload: the same shards in CPU RAM (CPUOffloadPolicy), copied to the device before each gather;
- precomputed: nothing of the teacher in memory while training, only the cached top-k logits of
  the micro-batch (fp32 values + int64 ids) read from the run directory's memory map, and the
  student's full-vocabulary soft targets the KL needs; the first pass before training holds the
  teacher alone (`first_pass_bytes`: the rank's peak is the larger of the two).
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrate.hardware.profile import HardwareProfile
from orchestrate.model.shape import ModelShape
from orchestrate.planner.strategy import Strategy

SOFT_TARGET_BYTES_PER_TOKEN_VOCAB = 20
"""Peak of the distillation loss's full-vocabulary temporaries per token (forward and backward of
orchestrate/methods/distill/objective.py `soft_target_kl`), besides the student's own logits (counted by
memory.logits_bytes) and the teacher's: fp32 log-softmax of teacher/T and of student/T, the
element-wise KL and their gradients. Measured with orchestrate.simulate's live-storage counter on
fp32 and bf16 logits: 20.0 bytes (tests/test_distill.py)."""
STUDENT_SOFT_BYTES_PER_TOKEN_VOCAB = 12
"""The same against cached top-k logits: only the student's fp32 log-softmax over the whole
vocabulary and its gradients remain: measured 12.0 bytes (+ the top-k terms, tests/test_distill.py)."""
TOPK_BYTES_PER_ENTRY = 4 + 8
"""A precomputed cache entry as the loss reads it: fp32 logit + int64 token id (torch.gather's index)."""


@dataclass(frozen=True)
class Teacher:
    shape: ModelShape
    placement: str
    """The configured placement, "auto" included (resolve it per strategy)."""
    top_k: int


def auto_placements(hw: HardwareProfile) -> list[str]:
    """What `placement: auto` tries, in the planner's order (the first that fits wins): cheapest
    per step first; offload only with an accelerator to offload from; precomputed last (it costs a
    first pass over the data and samples x seq_len x top_k x 8 bytes of disk)."""
    return ["replicated", *(["sharded"] if hw.world_size > 1 else []), *(["offload"] if hw.has_gpu else []),
            "precomputed"]


def resolve_placement(placement: str, strategy: Strategy, world_size: int) -> str:
    """For a plan whose candidate names no placement (a strategy pinned by hand, not searched),
    auto: sharded when the student's parameters are sharded over several ranks (ZeRO-3, FSDP full
    shard: the run already trades gathers for memory), else replicated."""
    if placement != "auto":
        return placement
    return "sharded" if world_size > 1 and strategy.zero_stage == 3 else "replicated"


def _blocks_gathered(shape: ModelShape) -> int:
    root = max(0, shape.parameters - shape.num_layers * shape.block_parameters)
    return root + 2 * shape.block_parameters


def add_teacher_memory(gpu: dict, cpu: dict, teacher: Teacher, strategy: Strategy, hw: HardwareProfile,
                       seq_len: int, c: int) -> None:
    """Adds teacher_weights, teacher_gathered, teacher_logits (per rank) and offloaded_teacher
    (per rank, host) to the placement's dicts; `c`: bytes of the compute dtype the teacher runs in."""
    shape, n = teacher.shape, hw.world_size
    placement = resolve_placement(teacher.placement, strategy, n)
    if placement == "offload" and not hw.has_gpu:
        placement = "replicated"  # a CPU-only rank's memory is host memory already
    tokens = strategy.micro_batch_size * seq_len
    p = shape.parameters
    weights = gathered = offloaded = 0.0
    if placement == "replicated":
        weights = c * p
    elif placement in ("sharded", "offload"):
        gathered = c * min(p, _blocks_gathered(shape))
        if placement == "sharded":
            weights = c * p / n
        else:
            offloaded = c * p / n
    if placement == "precomputed":
        logits = tokens * (teacher.top_k * TOPK_BYTES_PER_ENTRY + shape.vocab_size * STUDENT_SOFT_BYTES_PER_TOKEN_VOCAB)
    else:
        # The teacher's logits in the compute dtype plus the loss's soft-target tensors.
        logits = tokens * shape.vocab_size * (c + SOFT_TARGET_BYTES_PER_TOKEN_VOCAB)
    gpu.update(teacher_weights=weights, teacher_gathered=gathered, teacher_logits=logits)
    cpu["offloaded_teacher"] = offloaded


def first_pass_bytes(teacher: Teacher, strategy: Strategy, hw: HardwareProfile, seq_len: int, c: int) -> float:
    """Device bytes of the precomputed placement's first pass (0 for the others), which runs alone
    before the student is built, so the rank's peak is max(pass, training): memory.py adds the
    excess. The pass (orchestrate/worker/stages.py) runs the teacher offloaded on GPUs (the gathered
    blocks), sharded over CPU ranks (its shard + the gathered blocks), and holds one micro-batch's
    logits in the compute dtype plus their fp32 copy for `topk`."""
    if resolve_placement(teacher.placement, strategy, hw.world_size) != "precomputed":
        return 0.0
    shape, n = teacher.shape, hw.world_size
    weights = 0.0 if hw.has_gpu or n == 1 else c * shape.parameters / n
    gathered = c * (min(shape.parameters, _blocks_gathered(shape)) if hw.has_gpu or n > 1 else shape.parameters)
    return weights + gathered + strategy.micro_batch_size * seq_len * shape.vocab_size * (c + 4)


def teacher_forward_flops_per_token(shape: ModelShape, seq_len: int) -> float:
    """Forward only: 2 FLOPs per matmul parameter (Kaplan et al. 2020, 2.1) + the attention
    score/context matmuls, 4·layers·seq·hidden (Narayanan et al. 2021, eq. 3 without backward)."""
    tied_head = shape.vocab_size * shape.hidden_size if shape.tied_embeddings else 0
    matmul = shape.parameters - shape.embedding_parameters + tied_head
    return 2 * matmul + 4 * shape.num_layers * seq_len * shape.hidden_size


def teacher_seconds(teacher: Teacher, hw: HardwareProfile, strategy: Strategy, seq_len: int, accumulation: int,
                    seconds_per_flop_token: float, c: int, bandwidth: float) -> dict[str, float]:
    """Seconds per step of the teacher: its forward on every micro-batch (at the student's achieved
    rate), the all-gather of its shards (ring: (n-1)/n of it per rank per micro-batch) and, offloaded,
    the host-to-device copy of each rank's shard per micro-batch. Precomputed: none per step (the
    first pass is paid once, before step 1)."""
    n = hw.world_size
    placement = resolve_placement(teacher.placement, strategy, n)
    if placement == "precomputed":
        return {"teacher_forward": 0.0, "teacher_communication": 0.0, "teacher_transfer": 0.0}
    tokens = accumulation * strategy.micro_batch_size * seq_len
    forward = tokens * teacher_forward_flops_per_token(teacher.shape, seq_len) * seconds_per_flop_token
    p = teacher.shape.parameters
    comm = accumulation * (n - 1) / n * c * p / bandwidth if placement in ("sharded", "offload") and n > 1 else 0.0
    transfer = accumulation * c * p / n / hw.gpu.pcie_bandwidth if placement == "offload" and hw.has_gpu else 0.0
    return {"teacher_forward": forward, "teacher_communication": comm, "teacher_transfer": transfer}
