"""Analytical speed model: seconds per optimizer step and tokens per second for one strategy.

Pure arithmetic; every constant lives in `constants.py`.

Components (seconds per step, before overlap; `SpeedEstimate.breakdown`):
- compute: 6 FLOPs per matmul parameter per token (2 forward, 4 backward; Kaplan et al. 2020,
  "Scaling Laws for Neural Language Models", 2.1) + the attention score/context matmuls,
  12·layers·seq·hidden per token (Narayanan et al. 2021, "Efficient Large-Scale Language Model
  Training on GPU Clusters Using Megatron-LM", eq. 3), at peak x GPU_MFU x a micro-batch saturation.
- recompute: full activation checkpointing reruns the forward: one third of the above; a chunked
  loss reruns the LM head (planner/knobs.py), a tiled MLP its MLP (planner/long_context.py).
- communication: ring collectives over the slowest link of the group (see `_collectives`).
- all_to_all: sequence parallelism's head exchanges around attention (`_all_to_all`); attention waits
  for them, so they are not overlapped.
- exposed_communication (only where a method has some): collectives a method runs outside the training
  step's forward and backward, which the next phase waits for (`PricedTerms.exposed_communication_seconds`).
- offload_transfer: host<->device copies over PCIe (offloaded states; offloaded activations, knobs.py).
- optimizer: Adam on the GPU (memory-bound).
- cpu_optimizer: Adam on the CPU for offloaded optimizers (and on CPU-only profiles).
- nvme_io: optimizer states / parameters swapped to and from NVMe.

Overlap model: step = compute + recompute
                      + max(0, communication - COMM_OVERLAP_FRACTION x (compute + recompute))
                      + max(0, offload_transfer - OFFLOAD_OVERLAP_FRACTION x (compute + recompute))
                      + all_to_all + exposed_communication
                      + optimizer + cpu_optimizer + nvme_io x (1 - NVME_OVERLAP_FRACTION).
The optimizer phases run after the last backward (ZeRO-Offload's delayed parameter update is off), so
they are not hidden.
"""

from __future__ import annotations

from collections.abc import Sequence

from orchestrate.backends.registry import priced_as
from orchestrate.hardware.profile import HardwareProfile
from orchestrate.model.shape import ModelShape
from orchestrate.planner import auxiliary, knobs, long_context
from orchestrate.planner import constants as k
from orchestrate.planner.estimate import SpeedEstimate
from orchestrate.planner.memory import compute_bytes, forward_rows, shard_group_size, trained_shape
from orchestrate.planner.strategy import Strategy, tokens_per_step
from orchestrate.planner.terms import MethodTerms


def training_flops_per_token(shape: ModelShape, seq_len: int) -> tuple[float, float]:
    """(forward + backward, recompute) FLOPs per token."""
    forward = 2 * shape.matmul_parameters + 4 * shape.num_layers * seq_len * shape.hidden_size
    return 3 * forward, forward


def _intra_node_bandwidth(hw: HardwareProfile) -> float:
    if not hw.has_gpu:
        return k.GLOO_BANDWIDTH
    gpu = hw.gpu
    if gpu.nvlink:
        return k.NVLINK_BANDWIDTH
    return gpu.pcie_bandwidth * (1.0 if gpu.p2p else k.P2P_DISABLED_FACTOR)


def ring_bandwidth(hw: HardwareProfile) -> float:
    """Bytes/s of a flat ring over every rank: its slowest link (the intra-node link, and across nodes
    the node's network share)."""
    intra = _intra_node_bandwidth(hw)
    return intra if hw.nodes == 1 else min(intra, hw.inter_node_bandwidth)


def shard_gather_seconds(hw: HardwareProfile, strategy: Strategy, full_bytes: float, passes: int,
                         collectives_per_pass: int) -> float:
    """Seconds of `passes` ring all-gathers (or reduce-scatters: the same traffic) of sharded tensors of
    `full_bytes` in all, each pass `collectives_per_pass` collectives: over the ranks a sharded state is
    split over (memory.shard_group_size), each rank sends (n-1)/n of the whole (NCCL's ring) over the
    ring's slowest link (inside a node under hybrid shard), plus COLLECTIVE_LATENCY_S per collective."""
    n = shard_group_size(hw, strategy)
    if n == 1:
        return 0.0
    link = _intra_node_bandwidth(hw) if strategy.hybrid_shard else ring_bandwidth(hw)
    return (passes * ((n - 1) / n) * full_bytes / link
            + collectives_per_pass * k.COLLECTIVE_LATENCY_S * passes)


def _collectives(shape: ModelShape, hw: HardwareProfile, strategy: Strategy,
                 accumulation: int) -> float:
    """Seconds of collective communication per step for one rank.

    Ring algorithms (NCCL): all-gather and reduce-scatter move (n-1)/n of the full tensor per rank,
    all-reduce twice that. A flat ring spanning nodes runs at the slowest link (min of the intra-node
    link and the node's network share). Volumes per strategy:
    - DDP: one all-reduce of the fp32 gradients per step (no_sync during accumulation).
    - ZeRO-1: reduce-scatter of 16-bit grads at the boundary + all-gather of updated 16-bit params.
    - ZeRO-2: reduce-scatter every micro-batch (DeepSpeed partitions gradients in each backward) +
      all-gather per step.
    - ZeRO-3 / FSDP full shard: all-gather (forward) + all-gather (backward) + reduce-scatter per
      micro-batch: 3 passes of the parameters (ZeRO paper 7.2.2: 1.5x a same-dtype all-reduce).
    - FSDP shard-grad-op: the backward all-gather is skipped (2 passes). FSDP reduce-scatters in
      fp32 (FSDP_REDUCE_BYTES).
    - FSDP hybrid: the above inside a node, plus an all-reduce of each node's shard across nodes.
    """
    world = hw.world_size
    if world == 1:
        return 0.0
    c = compute_bytes(strategy)
    p = shape.parameters
    intra = _intra_node_bandwidth(hw)
    flat_bw = ring_bandwidth(hw)
    gather = (world - 1) / world  # fraction of the full tensor each rank sends in AG / RS

    backend = priced_as(strategy.backend)
    if backend == "ddp":
        return (2 * gather * 4 * p) / flat_bw
    if backend == "deepspeed" and strategy.zero_stage in (1, 2):
        reduce_passes = accumulation if strategy.zero_stage == 2 else 1
        return ((reduce_passes + 1) * gather * c * p) / flat_bw

    # ZeRO-3 releases each block after its forward (rendered max_live / reuse distance,
    # planner/ds_buckets.py), and checkpointing's recompute gather is reused by the block's backward:
    # two gathers per step, with and without checkpointing, less the LM head kept from forward into
    # backward (as simulated: docs/measurements.md#plannerds_bucketspy).
    gathers = 1 if (backend == "fsdp" and strategy.zero_stage == 2) else 2
    reduce_bytes = k.FSDP_REDUCE_BYTES if backend == "fsdp" else c
    volume = (gathers * c + reduce_bytes) * p  # bytes of full tensors per micro-batch
    if not strategy.hybrid_shard:
        return shard_gather_seconds(hw, strategy, volume, accumulation, (gathers + 1) * shape.num_layers)
    latency = (gathers + 1) * shape.num_layers * k.COLLECTIVE_LATENCY_S * accumulation
    rpn = shard_group_size(hw, strategy)
    inside = (rpn - 1) / rpn * volume / intra
    # every rank of a node all-reduces its 1/rpn gradient shard across nodes at once: the node's link
    # carries 2 (nodes-1)/nodes x the full gradient.
    across = 2 * (hw.nodes - 1) / hw.nodes * reduce_bytes * p / hw.inter_node_bandwidth
    return accumulation * (inside + across) + latency


def _all_to_all(shape: ModelShape, hw: HardwareProfile, strategy: Strategy, seq_len: int, accumulation: int) -> float:
    """Seconds of Ulysses' all-to-alls per step (long_context.all_to_all_bytes) over the group's slowest
    link, one latency per exchange; not overlapped with compute (attention waits for them), so counted
    beside it: see estimate_speed."""
    if strategy.sequence_parallel == 1:
        return 0.0
    group_spans_nodes = strategy.sequence_parallel > hw.ranks_per_node
    intra = _intra_node_bandwidth(hw)
    link = min(intra, hw.inter_node_bandwidth) if group_spans_nodes else intra
    passes = 2 if strategy.activation_checkpointing else 1
    volume = long_context.all_to_all_bytes(shape, strategy, seq_len, compute_bytes(strategy), passes)
    latency = 2 * (passes + 1) * shape.num_layers * k.COLLECTIVE_LATENCY_S
    return accumulation * (volume / link + latency)


def _cpu_adam_seconds(params_per_rank: float, hw: HardwareProfile, slowdown: float) -> float:
    """Adam on the CPU for one rank's parameters, with its share of the node's cores, bounded by the
    node's memory bandwidth that all its ranks share."""
    cores = max(1.0, hw.cpu_cores / hw.ranks_per_node)
    compute_bound = params_per_rank * slowdown / (k.DS_CPU_ADAM_PARAMS_PER_S_PER_CORE * cores)
    memory_bound = hw.ranks_per_node * params_per_rank * k.ADAM_BYTES_PER_PARAM / k.CPU_MEMORY_BANDWIDTH
    return max(compute_bound, memory_bound)


def _offload(shape: ModelShape, hw: HardwareProfile, strategy: Strategy,
             accumulation: int) -> tuple[float, float, float]:
    """(PCIe seconds, CPU optimizer seconds, NVMe seconds) per step for one rank."""
    if strategy.offload_optimizer == "none" and strategy.offload_params == "none":
        return 0.0, 0.0, 0.0
    c, p = compute_bytes(strategy), shape.parameters
    n = shard_group_size(hw, strategy)
    rpn = hw.ranks_per_node
    pcie = hw.gpu.pcie_bandwidth
    shard = p / n

    if priced_as(strategy.backend) == "fsdp":
        # CPUOffloadPolicy: fp32 shard copied H2D before each all-gather (forward, and backward when
        # resharded), fp32 sharded grads D2H each micro-batch; torch's CPU AdamW steps the shard.
        gathers = 2 if strategy.zero_stage == 3 else 1
        h2d = accumulation * gathers * 4 * shard
        d2h = accumulation * 4 * shard
        adam_slowdown = k.TORCH_CPU_ADAM_SLOWDOWN
    else:
        # ZeRO-Offload (Ren et al. 2021, 4.1): 16-bit grads down (ZeRO-2/3: every micro-batch as
        # they are reduced; ZeRO-1: at the boundary), updated 16-bit params up once per step.
        grad_passes = 1 if strategy.zero_stage == 1 else accumulation
        d2h = grad_passes * c * shard
        h2d = c * shard
        if strategy.offload_params != "none":
            # ZeRO-3 param offload: the partition crosses PCIe before the forward and the backward
            # all-gathers of every micro-batch.
            h2d += accumulation * 2 * c * shard
        adam_slowdown = 1.0
    transfer = (h2d + d2h) / pcie

    cpu_optimizer = _cpu_adam_seconds(shard, hw, adam_slowdown)

    # NVMe is shared by the node's ranks.
    nvme_read = nvme_write = 0.0
    if strategy.offload_optimizer == "nvme" and strategy.zero_stage == 3:
        # ZeRO-Infinity swaps in fp32 master, m, v and the fp32 grads and writes them back.
        nvme_read += 16 * shard
        nvme_write += 16 * shard
    if strategy.offload_params == "nvme":
        # Parameters beyond max_in_cpu are read for forward and backward and written after the step.
        on_disk = max(0.0, shard - k.DS_PARAM_MAX_IN_CPU)
        nvme_read += accumulation * 2 * c * on_disk
        nvme_write += c * on_disk
    nvme = rpn * (nvme_read / hw.nvme_read_bandwidth + nvme_write / hw.nvme_write_bandwidth)
    return transfer, cpu_optimizer, nvme


def _compute_seconds(shape: ModelShape, hw: HardwareProfile, strategy: Strategy, seq_len: int,
                     accumulation: int) -> tuple[float, float]:
    # a rank computes its slice of each sample; its attention spans the whole sequence (for 1/N of the heads)
    tokens = strategy.micro_batch_size * long_context.local_seq_len(strategy, seq_len)
    flops, recompute = training_flops_per_token(shape, seq_len)
    if hw.has_gpu:
        gpu = hw.gpu
        peak = {"bf16": gpu.peak_tflops_bf16, "fp16": gpu.peak_tflops_fp16,
                "fp32": gpu.peak_tflops_fp32}[strategy.precision] * 1e12
        rate = peak * k.GPU_MFU * tokens / (tokens + k.GPU_HALF_EFFICIENCY_TOKENS)
    else:
        rate = max(1.0, hw.cpu_cores / hw.ranks_per_node) * k.CPU_ACHIEVED_FLOPS_PER_CORE
    steps_tokens = accumulation * tokens
    rec = steps_tokens * recompute / rate if strategy.activation_checkpointing else 0.0
    rec += steps_tokens * knobs.recompute_flops_per_token(shape, strategy) / rate  # chunked loss: LM head again
    rec += steps_tokens * long_context.mlp_recompute_flops_per_token(shape, strategy) / rate  # tiled MLP
    return steps_tokens * flops / rate, rec


def _optimizer_seconds(shape: ModelShape, hw: HardwareProfile, strategy: Strategy) -> tuple[float, float]:
    """(device optimizer, host optimizer) seconds for optimizers that are not offloaded."""
    if strategy.offload_optimizer != "none" or strategy.offload_params != "none":
        return 0.0, 0.0
    sharded = priced_as(strategy.backend) != "ddp"
    params = shape.parameters / (shard_group_size(hw, strategy) if sharded else 1)
    if hw.has_gpu:
        per = knobs.ADAM8BIT_BYTES_PER_PARAM if strategy.optimizer == "adamw8bit" else k.ADAM_BYTES_PER_PARAM
        return params * per / hw.gpu.memory_bandwidth, 0.0
    return 0.0, _cpu_adam_seconds(params, hw, k.TORCH_CPU_ADAM_SLOWDOWN)  # CPU-only ranks: torch's AdamW


def estimate_speed(shape: ModelShape, hw: HardwareProfile, strategy: Strategy, seq_len: int,
                   gradient_accumulation: int, methods: Sequence[MethodTerms] = ()) -> SpeedEstimate:
    """Seconds per optimizer step and job-wide tokens/s (see the module doc for the model); `methods`: the
    plan's training methods' terms (planner/terms.py): what trains (LoRA: the adapters, whose offloaded
    states are small), their frozen weights' copies, their auxiliary models' forward, gathers and copies
    (planner/auxiliary.py). Every term sees the micro-batch the trained model's forward sees
    (memory.forward_rows: both sequences of a preference record)."""
    strategy, seq_len = forward_rows(methods, strategy, seq_len)
    priced = [method.priced(method, hw, strategy, seq_len, gradient_accumulation) for method in methods]
    compute, recompute = _compute_seconds(shape, hw, strategy, seq_len, gradient_accumulation)
    comm = _collectives(shape, hw, strategy, gradient_accumulation)
    exchange = _all_to_all(shape, hw, strategy, seq_len, gradient_accumulation)
    transfer, cpu_opt, nvme = (_offload(trained_shape(shape, methods), hw, strategy, gradient_accumulation)
                               if hw.has_gpu else (0.0, 0.0, 0.0))
    exposed = 0.0
    for terms in priced:
        transfer += terms.transfer_seconds
        compute += terms.compute_seconds
        exposed += terms.exposed_communication_seconds
    local = long_context.local_seq_len(strategy, seq_len)  # what one rank holds of each sample
    if strategy.activation_offload:  # block inputs down and back up over PCIe (knobs.py)
        transfer += knobs.offload_transfer_bytes(shape, strategy, local, compute_bytes(strategy),
                                                 gradient_accumulation) / hw.gpu.pcie_bandwidth
    # Embedding offload: the looked-up rows up to the GPU each micro-batch over the same one-direction PCIe
    # bandwidth (hardware/profile.py GPUSpec.pcie_bandwidth: 0.8 of the link rate). The first block waits for
    # them, so the copy is not overlapped. The CPU lookup reads and writes the same b·s·h·c bytes at host
    # memory bandwidth (tens of GB/s: a few ms for the 32 MiB of seq 4096, h 4096, bf16) against seconds of
    # 6·P FLOPs per token on the GPU: not counted.
    embedding_copy = (knobs.embedding_transfer_bytes(shape, strategy, local, compute_bytes(strategy),
                                                     gradient_accumulation) / hw.gpu.pcie_bandwidth
                      if hw.has_gpu else 0.0)
    extra: dict[str, float] = {}
    for model in (m for method in methods for m in method.auxiliary):
        flop_tokens = gradient_accumulation * strategy.micro_batch_size * seq_len * training_flops_per_token(
            shape, seq_len)[0]
        seconds = auxiliary.seconds(model, hw, strategy, seq_len, gradient_accumulation, compute / flop_tokens,
                                    compute_bytes(strategy), ring_bandwidth(hw))
        compute += seconds[f"{model.name}_forward"]
        comm += seconds[f"{model.name}_communication"]
        transfer += seconds[f"{model.name}_transfer"]
        extra.update(seconds)
    device_opt, host_opt = _optimizer_seconds(shape, hw, strategy)
    cpu_opt += host_opt

    busy = compute + recompute
    step = (busy
            + max(0.0, comm - k.COMM_OVERLAP_FRACTION * busy)
            + max(0.0, transfer - k.OFFLOAD_OVERLAP_FRACTION * busy)
            + embedding_copy + exchange + exposed
            + device_opt + cpu_opt + nvme * (1 - k.NVME_OVERLAP_FRACTION))
    tokens = tokens_per_step(strategy, gradient_accumulation, hw.world_size, seq_len)
    breakdown = {"compute": compute, "recompute": recompute, "communication": comm, "all_to_all": exchange,
                 "offload_transfer": transfer + embedding_copy, "optimizer": device_opt, "cpu_optimizer": cpu_opt,
                 "nvme_io": nvme, **extra}
    if exposed:  # a key of the methods that have such collectives only, as the auxiliary models' are
        breakdown["exposed_communication"] = exposed
    return SpeedEstimate(step_time_s=step, tokens_per_s=tokens / step if step > 0 else 0.0,
                         breakdown=breakdown)
