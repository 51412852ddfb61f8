"""Every number the analytical memory and speed models use that is not a formula, with its source.

Three kinds of constants live here:
- measured: taken from a measurement on this project's machines (say which and how);
- from code or docs: a default or a documented figure of DeepSpeed / torch / NCCL;
- margins "to be calibrated": engineering guesses with a stated margin, to be replaced by numbers from
  `orchestrate.simulate` (fake-tensor runs) or from a real 8 GB GPU.

The backends render the knobs marked "rendering contract" into their configs, so that what runs is what
was planned; change both together.
"""

from __future__ import annotations

from orchestrate.hardware.units import GiB, MiB

# --------------------------------------------------------------------------------------------------
# Activations and logits (per rank, at the backward-start peak)
# --------------------------------------------------------------------------------------------------

# Saved activations per block: derived per family from its block structure in planner/activations.py.

LOGITS_BYTES_PER_TOKEN_VOCAB_16BIT = 12
"""Measured on this machine (HF GPT-2, bf16): LM head output plus cross-entropy temporaries at the
peak, about 12 bytes per (token x vocab) (bf16 logits, their fp32 up-cast, fp32 log-softmax, bf16
gradient)."""

LOGITS_BYTES_PER_TOKEN_VOCAB_FP32 = 12
"""fp32 training: no up-cast copy, and the logits die once the log-softmax (which saves its output) has
run, so the loss's backward holds the log-softmax output, its gradient and the logits' gradient, 3 x 4
bytes. Simulated (`orchestrate.simulate.simulate`: a 4-block Llama of hidden 128 and vocabulary 1,000,
DDP, fp32, micro-batch 8 x seq 128): the logits part is 11.72 MiB = 12 x 8 x 128 x 1,000 bytes; a GRPO
training step on real tensors holds the same (tests/methods/grpo/test_grpo_phases.py)."""

CHECKPOINTED_SLICE_GRADIENTS = 5
"""Hidden-sized tensors per token the backward of an MLP tiled with a torch checkpoint per slice (the DDP
engine's, loading/tiled_mlp.py) holds beside one slice's working set: the slices' input gradients wait for
the split's backward to join them, then the joined gradient and the incoming one (DeepSpeed's TiledMLP
holds 2). Simulated (fake tensors, `orchestrate plan --simulate`): a 2-block Llama shape of hidden 256 and
intermediate 3584 at seq 16,384 in 16 slices, bf16, peaked 3 x c·h per token above the TiledMLP count under
DDP, and below it under FSDP2 (tests/unit/planner/test_long_context_simulation.py)."""

# --------------------------------------------------------------------------------------------------
# What a simulation cannot see (GPU only): margins, to be calibrated on a real 8 GB GPU
# --------------------------------------------------------------------------------------------------

# The CUDA context (per CUDA version and module loading) is in planner/software_terms.py.

CUBLAS_WORKSPACE_BYTES = 64 * MiB
"""cuBLAS/cuBLASLt workspaces (torch sets 4 MiB x 8 per handle and stream on Ampere+, `:4096:8`) plus
SDPA kernel scratch; rounded up. To be calibrated."""

# NCCL's own device buffers per communicator are in planner/nccl_buffers.py.

QUANTIZED_LINEAR_SECONDS = 1.3e-3
"""Device seconds one bitsandbytes NF4 linear with its LoRA adapter takes per micro-batch (forward and
backward) beyond its FLOPs at the modelled rate (methods/lora/speed.py). Measured on an H200
(bench/results/h200-2026-12-04, gpu_check.json, a 0.89B Llama shape, 16 blocks x 7 quantized linears,
micro-batch 2 x 1,024 tokens, 4 micro-batches a step, no recompute): predicted 61,777 and 63,232 tokens/s,
measured 12,586 (DDP) and 11,680 (FSDP2): 0.52 and 0.57 s a step beyond the prediction, 1.16 and 1.28 ms per
linear and micro-batch; the higher, rounded up. Measured at one micro-batch size only: whether it grows
with the tokens of a micro-batch is not known."""

# --------------------------------------------------------------------------------------------------
# Host memory per node
# --------------------------------------------------------------------------------------------------

PROCESS_RUNTIME_BYTES_GPU = 4 * GiB
"""Resident host memory of one GPU rank besides what it offloads: Python, torch, transformers,
DeepSpeed, the CUDA runtime's host-side allocations and loaded libraries, the data loader. Measured on
an H200 (bench/results/h200-2026-12-04, each run's verdict: peak RSS less the planned host states):
2.2-3.9 GiB over the GPU check's five runs, the most under DeepSpeed ZeRO-3 with offload; rounded up
(was a 3 GiB margin, under which that run's host peak was 1.08 of the plan)."""

PROCESS_RUNTIME_BYTES_CPU = 1 * GiB
"""Same for a CPU-only (gloo) rank. Measured here: `import torch, transformers, deepspeed` peaks at
0.32 GB RSS; the rest is margin for the data pipeline and autograd bookkeeping."""

LOAD_BYTES_PER_PARAM = 4
"""Host bytes per parameter while weights are materialised before they reach the devices: the
backends load fp32 (`from_pretrained(dtype=torch.float32)`; the initial-weights file of a pre-training
run is fp32 too). Who holds how many copies is in memory.py `_load_bytes` (DeepSpeed#4352 measured
processes x params x 4 B for replicated strategies)."""

# --------------------------------------------------------------------------------------------------
# Backend knobs (rendering contract: the backends render exactly these)
# --------------------------------------------------------------------------------------------------

DS_BUCKET_ELEMENTS_PER_HIDDEN_SQUARED = 1.0
"""GPU plans: reduce_bucket_size = allgather_bucket_size = hidden^2 elements, as Accelerate fills DeepSpeed's
"auto" (accelerate/utils/deepspeed.py); CPU plans use one whole-model bucket (planner/ds_buckets.py). DeepSpeed's own default, 5e8 elements, would cost 2 GB of
16-bit ipg buffers with overlap_comm on an 8 GB card."""

DS_PREFETCH_ELEMENTS_PER_HIDDEN_SQUARED = 0.9
"""stage3_prefetch_bucket_size = 0.9 * hidden^2 elements (Accelerate's "auto")."""

DS_SUB_GROUP_SIZE = 100_000_000
"""ZeRO-3 optimizer sub-group (elements), rendered into deepspeed.json from this constant. The NVMe
optimizer swapper pins buffer_count fp32 buffers of the largest sub-group (deepspeed/runtime/zero/
stage3.py `_configure_tensor_swapping`, swap_tensor/optimizer_utils.py): DeepSpeed's default 1e9
pins 16 GB for a partition of >= 1e9 parameters, 1e8 pins 1.6 GB. Smaller sub-groups only add
per-group optimizer-step overhead (DeepSpeed's docs recommend lowering it for NVMe offload)."""

DS_OPTIMIZER_SWAP_BUFFER_COUNT = 4
"""offload_optimizer.buffer_count default (deepspeed/runtime/zero/offload_config.py): param, grad,
momentum, variance."""

DS_PARAM_SWAP_BUFFER_COUNT = 5
"""offload_param.buffer_count default (offload_config.py)."""

DS_PARAM_SWAP_BUFFER_ELEMENTS = 100_000_000
"""offload_param.buffer_size default, 1e8 elements (offload_config.py); raised to the rank's partition
of the largest parameter when that is bigger (partitioned_param_swapper.py asserts it fits)."""

DS_PARAM_MAX_IN_CPU = 1_000_000_000
"""offload_param.max_in_cpu default, 1e9 elements: NVMe-offloaded parameters kept in CPU RAM too."""

FSDP_REDUCE_BYTES = 4
"""FSDP2 reduce-scatters gradients in fp32 (MixedPrecisionPolicy(reduce_dtype=float32), rendered by
orchestrate/backends/fsdp.py): the reduce-scatter input buffer and traffic are 4 bytes per element."""

# --------------------------------------------------------------------------------------------------
# Speed: compute
# --------------------------------------------------------------------------------------------------

GPU_MFU = 0.40
"""Model-FLOPs utilisation of HF models on consumer cards at large micro-batches (fraction of the
dense tensor-core peak). Engineering estimate; to be calibrated."""

GPU_HALF_EFFICIENCY_TOKENS = 256
"""Tokens per micro-batch (b x s) at which kernels reach half of GPU_MFU: small micro-batches leave the
tensor cores idle (launch overhead, narrow GEMMs). efficiency = MFU * t / (t + this). Heuristic."""

CPU_ACHIEVED_FLOPS_PER_CORE = 15e9
"""Achieved training FLOP/s per physical core on CPU-only profiles (AVX2/AVX-512 fp32 GEMMs in HF
models, ~20-30 % of peak). To be calibrated with bench/."""

# --------------------------------------------------------------------------------------------------
# Speed: optimizer step
# --------------------------------------------------------------------------------------------------

ADAM_BYTES_PER_PARAM = 30
"""Memory traffic of one fused Adam update per parameter: read fp32 master, grad, m, v (16 B), write
master, m, v (12 B), write the 16-bit copy (2 B). Adam is memory-bound on GPU and CPU."""

DS_CPU_ADAM_PARAMS_PER_S_PER_CORE = 2.0e8
"""DeepSpeed CPU Adam (AVX-vectorised, deepspeed/ops/adam/cpu_adam.py) parameters per second per core
before memory bandwidth binds. Estimate; to be calibrated."""

TORCH_CPU_ADAM_SLOWDOWN = 6.0
"""torch's CPU Adam (what FSDP2 CPU offload and CPU-only ranks step with) vs DeepSpeed's CPU Adam:
"5x-7x faster" (DeepSpeed ZeRO-Offload tutorial, https://www.deepspeed.ai/tutorials/zero-offload/)."""

CPU_MEMORY_BANDWIDTH = 40e9
"""Host memory bandwidth per node, bytes/s (dual-channel DDR4-3200 is 51 GB/s theoretical); bounds the
CPU optimizer. Consumer-desktop estimate; to be calibrated."""

# --------------------------------------------------------------------------------------------------
# Speed: communication and transfers
# --------------------------------------------------------------------------------------------------

NVLINK_BANDWIDTH = 25e9
"""One NVLink bridge on consumer Turing cards (RTX 2080 / 2070 Super: one x8 NVLink 2.0 link, 25 GB/s
per direction; NVIDIA Turing architecture whitepaper)."""

P2P_DISABLED_FACTOR = 0.5
"""Without GPU peer-to-peer, NCCL stages GPU-to-GPU traffic through host memory (SHM transport): each
byte crosses PCIe twice, roughly halving the bandwidth."""

GLOO_BANDWIDTH = 2e9
"""gloo collectives between CPU processes of one node (TCP loopback / shared memory), bytes/s.
To be calibrated."""

COLLECTIVE_LATENCY_S = 50e-6
"""Fixed cost of one NCCL collective (launch + ring latency on PCIe); matters for ZeRO-3/FSDP, which
issue ~3 collectives per block per micro-batch."""

COMM_OVERLAP_FRACTION = 0.7
"""Share of compute time that communication can hide behind: DDP buckets, ZeRO overlap_comm and FSDP2
prefetching overlap collectives with backward/forward compute, but the first all-gather and the last
reduce-scatter of each pass are exposed. Overlap model: exposed = max(0, comm - fraction x compute)."""

OFFLOAD_OVERLAP_FRACTION = 0.5
"""Same for host<->device offload copies (DeepSpeed overlaps gradient D2H with backward and prefetches
offloaded parameters; FSDP2 CPUOffloadPolicy copies on a side stream with pinned memory)."""

NVME_OVERLAP_FRACTION = 0.0
"""NVMe optimizer swapping overlaps with the CPU optimizer only with pipeline_read/pipeline_write,
which DeepSpeed leaves off by default (offload_config.py); counted fully."""
