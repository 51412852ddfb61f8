"""What a GRPO step costs beyond the training forward (docs/grpo.md). Pure.

A step has two phases, and its peak is the larger (the memory model adds what the first exceeds of the
second: `PricedTerms.before_activations`):

- rollout, under no_grad before the training forward: HF `generate` over micro_batch_size ×
  num_generations rows peaks at one of two moments (`rollout_bytes`, the larger):
  - the prefill's last block: the KV cache of every layer over the prompt positions (2 × layers ×
    kv_heads × head_dim per position, compute dtype) and that block's transients per prompt position:
    its MLP's three intermediate-wide tensors (gate, up, their product), four hidden-wide ones (the
    embedding output, the residual stream and its sum, the norm's output) and the rotary cos and sin
    (PREFILL_HIDDEN_TENSORS, 2 × head_dim);
  - the last decoded token: the KV cache over prompt + completion, one layer's keys held twice while
    the growing cache concatenates the new position (transformers' DynamicLayer.update: torch.cat),
    and the sampling's fp32 scores of the last position (logits up-cast, temperature, top-p's sorted
    values, int64 indices, probabilities: SAMPLING_BYTES_PER_VOCAB).
  Measured with the simulation's live-storage counter on real tensors (tests/methods/grpo/test_grpo_phases.py:
  within 5 % for a prefill-bound, a decode-bound and a mixed shape). Then the no_grad scoring forwards
  over the same rows of train.seq_len (π_old with num_iterations > 1, the reference with beta > 0): a
  reference forward's outputs (preference/memory.py `chunked_reference_forward_bytes`, chunked as the
  loss is).
- under parameter sharding (zero_stage 3: FSDP2 full shard, DeepSpeed ZeRO-3) the rollout phase holds
  the whole model gathered once for all its forwards (gather.py): every weight in the compute dtype, a
  QLoRA base's blocks in NF4, beside the rank's shard (`gathered_weight_bytes`, predicted high: the
  training phase's own gathered blocks are not taken off it). With ZeRO-3's parameters offloaded the
  gathered model is on the device all the same (the shard is the planner's own host term).
- training: the forward over the rows (MethodTerms.sample_rows = num_generations) with its activations
  and logits (the planner's own terms, one chunk's logits with train.loss_chunks), and the rollouts kept
  for the step's micro-batches (ids, masks, π_old and reference log-probabilities: KEPT_BYTES_PER_POSITION).

Time: generation is memory-bound (each decoded token reads every weight once and the KV cache so far,
for all rows at once), plus the prefill and the scoring forwards at the FLOP rate; once per
num_iterations steps, for every micro-batch. Under parameter sharding the rollout phase's one gather of
the whole model (`rollout_gather_seconds`), once per num_iterations steps, waited for before sampling;
with the parameters offloaded, each rank's partition first crosses PCIe to the device.
"""

from __future__ import annotations

from orchestrate.hardware.profile import HardwareProfile
from orchestrate.methods.grpo.config import GrpoSection
from orchestrate.methods.preference.memory import chunked_reference_forward_bytes
from orchestrate.model.shape import ModelShape
from orchestrate.planner import constants as k
from orchestrate.planner.auxiliary import forward_flops_per_token
from orchestrate.planner.memory import shard_group_size
from orchestrate.planner.speed import shard_gather_seconds
from orchestrate.planner.strategy import Strategy

ROLLOUT = "rollout"
KEPT = "rollouts_kept"
SAMPLING_BYTES_PER_VOCAB = 4 * 4 + 8
"""fp32 logits, their tempered and top-p-filtered copies and probabilities (4 × 4 bytes), the sort's int64 indices."""
PREFILL_HIDDEN_TENSORS = 4
"""Hidden-wide tensors per prompt position alive in the prefill's last block (module docstring)."""
KEPT_BYTES_PER_POSITION = 8 + 8 + 4 + 4
"""Per kept position: int64 ids and attention mask, fp32 π_old and reference log-probabilities."""
NF4_BYTES_PER_PARAMETER = 0.5 + 4 / 64
"""A 4-bit weight and its block's fp32 absmax (blocks of 64; bitsandbytes NF4)."""
CPU_MEMORY_BANDWIDTH = 20e9
"""Host memory bandwidth assumed for a CPU rank's generation (bytes/s)."""


def kv_cache_bytes(shape: ModelShape, rows: int, positions: int, c: int) -> float:
    return 2.0 * shape.num_layers * shape.num_kv_heads * shape.head_dim * rows * positions * c


def rollout_bytes(shape: ModelShape, settings: GrpoSection, rows: int, seq_len: int, c: int) -> dict[str, float]:
    """The rollout phase's parts (bytes) at its peak for `rows` sequences of seq_len (prompt + completion):
    the prefill's or the last decoded token's, whichever holds more (module docstring)."""
    prompt = max(1, seq_len - settings.max_completion_length)
    per_position = 3 * shape.intermediate_size + PREFILL_HIDDEN_TENSORS * shape.hidden_size + 2 * shape.head_dim
    prefill = {"kv_cache": kv_cache_bytes(shape, rows, prompt, c), "prefill": float(rows * prompt * per_position * c)}
    cache = kv_cache_bytes(shape, rows, seq_len, c)
    decode = {"kv_cache": cache, "cache_growth": cache / (2 * shape.num_layers),
              "sampling": float(rows * shape.vocab_size * SAMPLING_BYTES_PER_VOCAB)}
    return max(prefill, decode, key=lambda parts: sum(parts.values()))


def gathered_weight_bytes(shape: ModelShape, strategy: Strategy, method: str, c: int) -> float:
    """The whole model as the rollout phase gathers it under parameter sharding (zero_stage 3); 0 where
    every rank holds the whole model already (DDP, ZeRO-1/2, FSDP2 shard-grad-op, whose training
    forward keeps every unsharded block anyway: planner/memory.py's gathered_params). On the device
    whether or not the parameters are offloaded: DeepSpeed gathers each one into a tensor on the
    accelerator from its partition wherever that lives (partition_parameters.py `Init._all_gather`:
    `_allgather_params_coalesced` / `_allgather_params_sequential`, the partition copied `.to` the
    accelerator, the full tensor allocated on `local_device`)."""
    if strategy.zero_stage != 3:
        return 0.0
    per_weight = NF4_BYTES_PER_PARAMETER if method == "qlora" else c
    return shape.num_layers * shape.block_parameters * per_weight + shape.root_parameters * c


def scoring_bytes(shape: ModelShape, settings: GrpoSection, rows: int, seq_len: int, chunks: int, c: int) -> float:
    """The no_grad scoring forwards after sampling (π_old, the reference): one at a time, so one's outputs."""
    if settings.num_iterations == 1 and not settings.beta:
        return 0.0
    return chunked_reference_forward_bytes(shape, rows, seq_len, chunks, c)


def kept_bytes(rows: int, seq_len: int, accumulation: int) -> float:
    return float(accumulation * rows * seq_len * KEPT_BYTES_PER_POSITION)


def rollout_seconds(shape: ModelShape, settings: GrpoSection, hw: HardwareProfile, rows: int, seq_len: int,
                    weight_bytes: float, c: int, peak_flops: float) -> float:
    """Seconds of one micro-batch's rollout: the decode steps at the memory bandwidth (the weights and
    the half-full KV cache per token), the prefill and π_old's forward at the achieved FLOP rate. The
    reference's forward (beta > 0) is priced as its auxiliary model's, on every micro-batch (it runs
    once per num_iterations steps: an overestimate with num_iterations > 1)."""
    completion = settings.max_completion_length
    prompt = max(1, seq_len - completion)
    bandwidth = hw.gpu.memory_bandwidth if hw.has_gpu else CPU_MEMORY_BANDWIDTH
    decode = completion * (weight_bytes + kv_cache_bytes(shape, rows, prompt + completion / 2, c)) / bandwidth
    scoring = settings.num_iterations > 1  # π_old (the reference's forward is its auxiliary model's, priced there)
    flops = rows * (prompt * forward_flops_per_token(shape, prompt)
                    + scoring * seq_len * forward_flops_per_token(shape, seq_len))
    rate = peak_flops * k.GPU_MFU if hw.has_gpu else hw.cpu_cores * k.CPU_ACHIEVED_FLOPS_PER_CORE
    return decode + flops / rate


def rollout_gather_seconds(shape: ModelShape, settings: GrpoSection, hw: HardwareProfile, strategy: Strategy,
                           gathered: float) -> float:
    """Seconds per step of the rollout phase's all-gather of `gathered` bytes (`gathered_weight_bytes`: 0
    but under parameter sharding), priced as the training's gathers are (planner/speed.py
    `shard_gather_seconds`): one pass of one collective per FSDP unit, every block and the root (DeepSpeed's
    GatheredParameters issues fewer), once per num_iterations steps. Sampling waits for it: no compute
    overlaps it (PricedTerms.exposed_communication_seconds). With the parameters offloaded (DeepSpeed ZeRO-3
    offload_param) each rank's partition, 1/n of the gathered bytes, is first copied to the device over
    PCIe, as before every training gather (planner/speed.py `_offload`); on one rank too, where nothing
    crosses the ring."""
    if not gathered:
        return 0.0
    seconds = shard_gather_seconds(hw, strategy, gathered, 1, shape.num_layers + 1)
    if strategy.offload_params != "none" and hw.has_gpu:
        seconds += gathered / shard_group_size(hw, strategy) / hw.gpu.pcie_bandwidth
    return seconds / settings.num_iterations
