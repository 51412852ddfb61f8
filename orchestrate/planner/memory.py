"""Analytical memory model: per-rank device bytes and per-node host bytes at the training peak.

Pure arithmetic on a `ModelShape`, a `HardwareProfile` and a `Strategy`; no I/O, no devices.

Notation: P = parameters, n = ranks a sharded state is split over (the world size; the ranks of one
node for FSDP hybrid shard), c = bytes of the compute dtype (2 for bf16/fp16, 4 for fp32).

Peak model. Device bytes are summed, except for what provably never coexists with the backward-start
peak (every saved activation and the logits live): torch frees `.grad` on `zero_grad()`
(set_to_none=True, the default since torch 2.0), FSDP2 allocates unsharded gradients and
reduce-scatter inputs per block in backward, and DeepSpeed releases its fp32 gradient partition and
ipg buckets (ZeRO-2 also its 16-bit partition) around the step. Those grow only as activations are
freed, so with one micro-batch per step the peak is static + max(activations + logits, those
terms) (`_backward_only`; simulated on all three backends: none of them is live at the peak). With
gradient accumulation they persist across micro-batches and are counted in full. The ddp/fsdp
backends step with fused AdamW (`fused=True`), which allocates no full-size temporaries
(rendering contract).

Host bytes are per node: the offloaded shards of all ranks of the node, pinned swap buffers, each
rank's process runtime, and the weight-loading spike in excess of the steady state (loading happens
before the offloaded states exist, so the node peak is max(load, steady) + runtime; DeepSpeed's
estimators take the same max).

On CPU-only profiles the rank's training memory is reported in the `gpu` dict (it is the rank
process's RAM) with no CUDA context, workspace or allocator reserve; callers compare
`node_host_bytes(...)` (ranks_per_node x rank bytes + host dict) against the node's RAM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from orchestrate.backends.registry import priced_as
from orchestrate.hardware.profile import HardwareProfile
from orchestrate.hardware.software import SoftwareStack
from orchestrate.model.shape import ModelShape
from orchestrate.planner import activations, auxiliary, ds_buckets, knobs, long_context, software_terms
from orchestrate.planner import constants as k
from orchestrate.planner.allocator_reserve import allocator_reserve, state_bytes
from orchestrate.planner.estimate import CORRECTION_KEY, MemoryEstimate
from orchestrate.planner.nccl_buffers import nccl_buffer_bytes
from orchestrate.planner.packing import SamplePacking, mask_bytes
from orchestrate.planner.strategy import Strategy
from orchestrate.planner.terms import MethodTerms

# The breakdown of every plan holds these keys, then its methods' own: `breakdown_keys`, from which
# estimate_memory starts.
GPU_KEYS = ("weights", "gradients", "optimizer_states", "master_weights", "activations", "logits",
            "gathered_params", "comm_buckets", "nccl_buffers", "cuda_context", "workspace", "allocator_reserve")
CPU_KEYS = ("offloaded_optimizer", "offloaded_master_weights", "offloaded_gradients", "offloaded_params",
            "offloaded_activations", "offloaded_embedding", "pinned_buffers", "loading_spike", "process_runtime")
MODEL_STATE_KEYS = ("weights", "gradients", "optimizer_states", "master_weights")
_CURRENT = SoftwareStack()  # versions not known: the current releases


def compute_bytes(strategy: Strategy) -> int:
    """Bytes per element of the compute dtype."""
    return 4 if strategy.precision == "fp32" else 2


def shard_group_size(hw: HardwareProfile, strategy: Strategy) -> int:
    """Ranks a sharded state is split over: the ranks of one node for hybrid shard (replicated across
    nodes), else the whole world."""
    return hw.ranks_per_node if strategy.hybrid_shard else hw.world_size


def activation_bytes(shape: ModelShape, strategy: Strategy, seq_len: int, sw: SoftwareStack = _CURRENT,
                     saved: float = 0.0) -> int:
    """Saved activations of one micro-batch at the backward-start peak, from the family's block
    structure (planner/activations.py) and what the library versions `sw` save (software_terms.py);
    offloaded, two block inputs stay on the device (knobs.py); `saved`: what the methods save per token
    and block beyond the formula (PricedTerms.saved_bytes: LoRA's adapter inputs)."""
    if shape.task == "custom":
        # Your own module: no formula; measured on fake tensors at plan time, fp32, fixed + per
        # sample (orchestrate/methods/custom/activations.py), loss temporaries included.
        fp32 = shape.activation_bytes_fixed + strategy.micro_batch_size * shape.activation_bytes_per_sample
        return int(fp32 * compute_bytes(strategy) / 4)
    tokens, c = strategy.micro_batch_size * seq_len, compute_bytes(strategy)
    stored_layers = 2 if strategy.activation_checkpointing and strategy.activation_offload else None
    # `saved`: what adapters save beyond the formula; under a tiled MLP their MLP part lies in the slice, so
    # this over-counts (only with lora.dropout > 0: it is 0 otherwise)
    return activations.activation_bytes(shape, c, tokens, strategy.activation_checkpointing,
                                        logits_bytes(shape, strategy, seq_len, sw), stored_layers,
                                        _eager_attention(shape, strategy, seq_len, sw), saved,
                                        long_context.block_compute(strategy))


def _eager_attention(shape: ModelShape, strategy: Strategy, seq_len: int,
                     sw: SoftwareStack) -> activations.EagerAttention | None:
    """The materialised attention of a transformers release before SDPA (software_terms.py), else None."""
    if not software_terms.eager_attention(sw, shape.model_type):
        return None
    c = compute_bytes(strategy)
    autocast = priced_as(strategy.backend) == "ddp" and c == 2  # the DDP engine's 16-bit path runs under torch.autocast
    return activations.EagerAttention(seq_len, software_terms.eager_softmax_bytes(shape.model_type, c, autocast),
                                      dropout=software_terms.eager_attention_dropout(shape.model_type))


def last_block_bytes(shape: ModelShape, strategy: Strategy, seq_len: int, sw: SoftwareStack = _CURRENT,
                     saved: float = 0.0) -> int:
    """What the last block backward differentiates holds while the gradients are nearly complete
    (activations.last_block_bytes), so the gradients cannot take its bytes' place; `saved` as for
    `activation_bytes`."""
    if shape.task == "custom":
        return 0  # in the measured activations
    c = compute_bytes(strategy)
    return activations.last_block_bytes(shape, c, strategy.micro_batch_size * seq_len,
                                        _eager_attention(shape, strategy, seq_len, sw), saved,
                                        long_context.block_compute(strategy))


def logits_bytes(shape: ModelShape, strategy: Strategy, seq_len: int, sw: SoftwareStack = _CURRENT) -> int:
    """Head output and cross-entropy temporaries (measured, see constants): per token and vocabulary
    entry for LM heads; per sequence and label for a classifier (its logits are num_labels wide);
    transformers before 4.49 kept more (software_terms.logits_bytes_per_token_vocab)."""
    if shape.task == "custom":
        return 0  # in the measured activations
    per = (k.LOGITS_BYTES_PER_TOKEN_VOCAB_FP32 if strategy.precision == "fp32"
           else software_terms.logits_bytes_per_token_vocab(sw) or k.LOGITS_BYTES_PER_TOKEN_VOCAB_16BIT)
    rows = knobs.logits_rows(strategy, seq_len, shape.logits_per_token)  # one chunk's when chunked
    hidden_grad = knobs.hidden_gradient_bytes(shape, strategy, seq_len, compute_bytes(strategy))
    return int(per * rows * shape.logits_width + hidden_grad)


class _Placement:
    """Per-rank bytes of the model states, by where they live."""

    def __init__(self) -> None:
        self.gpu = dict.fromkeys(GPU_KEYS, 0)
        self.cpu = dict.fromkeys(CPU_KEYS, 0)
        self.nvme = 0


def _ddp(shape: ModelShape, strategy: Strategy, world: int) -> _Placement:
    # torch DDP + torch.autocast: parameters, gradients and Adam states stay fp32
    # (4 + 4 + 8 = 16 B/param, ZeRO paper's K with no separate master copy).
    p, c = shape.parameters, compute_bytes(strategy)
    out = _Placement()
    out.gpu.update(weights=4 * p, gradients=4 * p, optimizer_states=8 * p)
    if c == 2:
        # autocast casts each weight to 16-bit for its matmul and autograd saves that copy for
        # backward, so a 16-bit copy of every matmul weight is live at the backward-start peak.
        out.gpu["gathered_params"] = 2 * shape.matmul_parameters
    if world > 1:
        # DDP's gradient buckets are a second full copy of the gradients unless
        # gradient_as_bucket_view=True (torch DistributedDataParallel docs: "the saved memory size
        # will be equal to the total gradients size"). One rank trains without DDP (backends/single_rank.py).
        out.gpu["comm_buckets"] = 4 * p
    return out


def _deepspeed(shape: ModelShape, strategy: Strategy, n: int, accumulation: int) -> _Placement:
    # ZeRO (Rajbhandari et al. 2020, section 5) with DeepSpeed's bookkeeping as its estimators count it
    # (deepspeed/runtime/zero/stage_1_and_2.py and stage3.py, estimate_zero{2,3}_model_states_mem_needs):
    # 16-bit params (c·P) + per rank 18·P/n = 2 (16-bit grad partition) + 4 (fp32 grad partition the
    # optimizer steps with) + 4 (fp32 master) + 8 (Adam m, v). With fp32 compute DeepSpeed still clones
    # an fp32 master partition (stage_1_and_2.py: `.clone().float()`), so the terms keep their shape.
    # ZeRO-3 is 2·P/n above DeepSpeed's stage-3 estimator: stage3.py allocates the 16-bit gradient
    # partition (grad_partitions_flat_buffer, in the model dtype) besides the 16-bit parameter
    # partition, and the estimator's 18 counts only one of the two.
    p, c, stage = shape.parameters, compute_bytes(strategy), strategy.zero_stage
    out = _Placement()
    opt, master, fp32_grads = 8 * p / n, 4 * p / n, 4 * p / n
    offload_opt = strategy.offload_optimizer
    if stage < 3 and offload_opt == "nvme":
        # ZeRO-1/2 have no NVMe swapper: stage_1_and_2.py sets cpu_offload for any offload device, so
        # "nvme" keeps the states in CPU RAM. The planner never proposes it; model what would run.
        offload_opt = "cpu"

    if stage == 1 and accumulation > 1:
        # Stage 1 does not partition gradients: full 16-bit .grad between micro-batches, until the
        # boundary reduce.
        low_grads = c * p
    elif offload_opt != "none" and stage == 2:
        # ZeRO-Offload: reduced gradient partitions go straight from the ipg bucket into the pinned CPU
        # fp32 buffer (async_accumulate_grad_in_cpu_via_gpu); the GPU keeps only the 16-bit params.
        low_grads = 0
    elif offload_opt != "none":
        # stage 3 with optimizer offload: the 16-bit gradient partition lives on the optimizer's device,
        # the CPU (stage3.py: self.device = cpu; grad_partitions_flat_buffer), counted below.
        low_grads = 0
        out.cpu["offloaded_gradients"] += c * p / n
    elif stage < 3:
        # ZeRO-2, and ZeRO-1 without accumulation (DeepSpeed 0.19 then reduces into partitions during
        # the boundary backward, stage_1_and_2.py `reduce_ipg_grads`): `grads_in_partition` is sized
        # by the *whole* parameters that overlap this rank's partition, so it exceeds P/n by up to one
        # parameter (as real 2-rank gloo runs show: docs/measurements.md#plannermemorypy). Bounded by the
        # largest layer.
        low_grads = c * (p / n + shape.largest_layer_parameters)
    else:
        low_grads = c * p / n

    out.gpu["weights"] = c * p if stage < 3 else c * p / n
    out.gpu["gradients"] = low_grads
    if stage == 3:
        # The coordinator holds the module running and prefetches while fewer than
        # stage3_max_live_parameters (one block + a bucket, rendered from planner/ds_buckets.py) are
        # gathered (partitioned_param_coordinator.py `max_params_to_prefetch`, `__params_to_release`):
        # at the backward-start peak that is the LM head (the largest layer) or up to max_live.
        # Simulated on the zoo: the head alone at the end of forward. DeepSpeed's estimator counts
        # 4·largest_layer bytes instead (the layer and its gradient).
        out.gpu["gathered_params"] = c * max(shape.largest_layer_parameters, min(p, ds_buckets.stage3_max_live(shape)))

    if offload_opt == "none":
        out.gpu.update(optimizer_states=opt, master_weights=master)
        out.gpu["gradients"] += fp32_grads
    elif offload_opt == "cpu":
        out.cpu.update(offloaded_optimizer=opt, offloaded_master_weights=master)
        out.cpu["offloaded_gradients"] += fp32_grads
    else:  # nvme, stage 3: ZeRO-Infinity swaps master, grads, m and v per optimizer sub-group
        out.nvme += opt + master + fp32_grads
        sub_group = min(k.DS_SUB_GROUP_SIZE, p / n)
        # buffer_count pinned fp32 swap buffers of the largest sub-group (optimizer_utils.py
        # SwapBufferManager) + the shared fp32 gradient buffer (stage3.py initialize_optimizer_states).
        out.cpu["pinned_buffers"] += (k.DS_OPTIMIZER_SWAP_BUFFER_COUNT + 1) * sub_group * 4

    if stage == 3 and strategy.offload_params != "none":
        weights = out.gpu["weights"]
        out.gpu["weights"] = 0
        if strategy.offload_params == "cpu":
            out.cpu["offloaded_params"] = weights
        else:
            # NVMe params: up to max_in_cpu elements stay in a CPU flat buffer (stage3.py
            # _create_fp16_partitions_with_defragmentation), the rest are swapped through
            # buffer_count pinned buffers of buffer_size elements (at least the rank's partition of
            # the largest layer).
            in_cpu = min(p / n, k.DS_PARAM_MAX_IN_CPU)
            out.cpu["offloaded_params"] = c * in_cpu
            out.nvme += c * (p / n - in_cpu)
            buffer = max(k.DS_PARAM_SWAP_BUFFER_ELEMENTS, -(-shape.largest_layer_parameters // n))
            out.cpu["pinned_buffers"] += k.DS_PARAM_SWAP_BUFFER_COUNT * buffer * c
    return out


def _fsdp(shape: ModelShape, strategy: Strategy, n: int) -> _Placement:
    # FSDP2 `fully_shard` with MixedPrecisionPolicy(param_dtype=compute dtype): the sharded parameters
    # stay fp32 and are what the optimizer steps ("FSDP does not require any extra memory to keep a
    # high-precision copy", torch MixedPrecisionPolicy docs), so there is no separate master copy.
    # Sharded gradients are fp32 like the sharded parameters. One FSDP unit per block + the root.
    p, c = shape.parameters, compute_bytes(strategy)
    out = _Placement()
    block, root = shape.block_parameters, shape.root_parameters
    states = {"weights": 4 * p / n, "gradients": 4 * p / n, "optimizer_states": 8 * p / n}
    if strategy.offload_params == "cpu":
        # CPUOffloadPolicy: sharded params, grads and optimizer states on (pinned) CPU memory.
        out.cpu.update(offloaded_params=states["weights"], offloaded_gradients=states["gradients"],
                       offloaded_optimizer=states["optimizer_states"])
    else:
        out.gpu.update(states)
    if strategy.zero_stage == 3:
        # reshard_after_forward=True frees each block after use; the root is kept unsharded (its
        # default is False: "the root module is typically required immediately when the backward
        # pass begins", fully_shard docs); FSDP2 prefetches the next block's all-gather: 2 blocks.
        out.gpu["gathered_params"] = c * (root + 2 * block)
    else:
        # shard-grad-op (reshard_after_forward=False): every unsharded parameter survives forward.
        out.gpu["gathered_params"] = c * p
    # The fp32 reduce-scatter input of the largest unit being reduced (the root's, at the end of
    # backward, for LM vocabularies) plus the unsharded compute-dtype gradient of its largest
    # parameter: foreach_reduce copies the unsharded gradients in and drops them one by one
    # (_fsdp_collectives.py; simulated: 4·root + c·embedding at the end of backward).
    out.gpu["comm_buckets"] = k.FSDP_REDUCE_BYTES * max(block, root) + c * shape.largest_layer_parameters
    return out


def _backward_only(gpu: dict, shape: ModelShape, strategy: Strategy, n: int) -> tuple[list, float]:
    """Model-state bytes (key, size) born in backward or the step and freed by it, so not live at the
    backward-start peak, and the step's temporaries beyond them (simulated, see the module doc)."""
    grads, buckets, c, pn = gpu["gradients"], gpu["comm_buckets"], compute_bytes(strategy), shape.parameters / n
    backend = priced_as(strategy.backend)
    if backend == "ddp":
        # torch zero_grad(set_to_none=True); DDP's buckets persist. A tied input embedding's backward
        # (embedding_dense_backward) makes a dense fp32 vocab x hidden gradient at the very end of
        # backward, summed with the LM head's .grad into a third (autograd accumulate_grad); an untied
        # one becomes the .grad itself (simulated: gpt2 +2·4·V·h, llama +0).
        tied = 8 * shape.vocab_size * shape.hidden_size if shape.tied_embeddings else 0
        return [("gradients", grads)], tied
    if backend == "fsdp":
        # + the unsharded gradients and the reduce-scatter input, allocated per unit in backward
        # (_fsdp_param_group.py post_backward / foreach_reduce). Fused AdamW: no step temporaries.
        return [("gradients", grads), ("comm_buckets", buckets)], 0.0
    if gpu["optimizer_states"] == 0:  # optimizer offloaded: the step runs on the CPU
        return [("gradients", grads), ("comm_buckets", buckets)], 0.0
    if strategy.zero_stage == 3:
        # stage3.py keeps the 16-bit gradient partition (grad_partitions_flat_buffer) for the whole
        # run; the fp32 partition the optimizer steps is made for the step, and the foreach AdamW on it
        # adds a partition-sized sqrt temporary (torch/optim/adamw.py _multi_tensor_adam).
        return [("gradients", min(grads, 4 * pn)), ("comm_buckets", buckets)], 4 * pn
    # stage_1_and_2.py: grads_in_partition, the fp32 partition and the ipg buckets are all released
    # after the step; the step holds one more 16-bit partition-sized flat copy (simulated 6·P/n).
    return [("gradients", grads), ("comm_buckets", buckets)], c * pn


def _load_bytes(shape: ModelShape, hw: HardwareProfile, strategy: Strategy) -> float:
    """Host bytes one node holds while the weights load, as the backends load them (a method that loads
    its own way says so: PricedTerms.load_bytes)."""
    p, backend = shape.parameters, priced_as(strategy.backend)
    if backend == "fsdp":
        # Meta-device build, then rank 0 alone reads the full state dict and broadcasts it shard by
        # shard (set_model_state_dict(broadcast_from_rank0=True); orchestrate/backends/fsdp.py).
        return k.LOAD_BYTES_PER_PARAM * p
    if backend == "deepspeed" and strategy.zero_stage == 3:
        # HfDeepSpeedConfig makes from_pretrained build inside zero.Init and load shard by shard into
        # the partitions: DeepSpeed's zero_init=True estimate is largest_layer x 4 B x ranks per node.
        return hw.ranks_per_node * k.LOAD_BYTES_PER_PARAM * shape.largest_layer_parameters
    # DDP and ZeRO-1/2 replicate parameters: every rank loads a full fp32 copy (DeepSpeed#4352;
    # DeepSpeed's estimators: 4·P per GPU).
    return hw.ranks_per_node * k.LOAD_BYTES_PER_PARAM * p


def _placement(shape: ModelShape, hw: HardwareProfile, strategy: Strategy, accumulation: int) -> _Placement:
    """The trained model's states, as the backend's terms place them."""
    n, backend = shard_group_size(hw, strategy), priced_as(strategy.backend)
    if backend == "ddp":
        return _ddp(shape, strategy, hw.world_size)
    if backend == "deepspeed":
        out = _deepspeed(shape, strategy, n, accumulation)
        if hw.world_size > 1:
            # ipg reduce buckets (x2 with overlap_comm) + the all-gather bucket; ZeRO-3: + the
            # prefetch bucket. Sizes are the rendering contract in planner/ds_buckets.py.
            h2, c = shape.hidden_size ** 2, compute_bytes(strategy)
            buckets = (ds_buckets.reduce_buffers(hw.has_gpu) + 1) * ds_buckets.bucket_elements(shape, hw.has_gpu)
            if strategy.zero_stage == 3:
                buckets += k.DS_PREFETCH_ELEMENTS_PER_HIDDEN_SQUARED * h2
            out.gpu["comm_buckets"] += c * buckets
        return out
    return _fsdp(shape, strategy, n)


def _add(into: dict, additions: list[tuple[str, float]], scale: float = 1) -> None:
    """Each (key, bytes) added in order (a new key starts from 0); host terms are scaled to the node."""
    for key, value in additions:
        into[key] = into.get(key, 0) + (scale * value if scale != 1 else value)


def trained_shape(shape: ModelShape, methods: Sequence[MethodTerms]) -> ModelShape:
    """The model whose weights train (LoRA: the adapters), after every method's say."""
    for method in methods:
        shape = method.trained or shape
    return shape


def forward_rows(methods: Sequence[MethodTerms], strategy: Strategy, seq_len: int) -> tuple[Strategy, int]:
    """(strategy, seq_len) of the micro-batch the trained model's forward sees, after every method's say
    (MethodTerms.sample_rows: a preference record is two sequences, two rows or one packed row); the
    activations, logits and compute are those of it."""
    for method in methods:
        if method.sample_rows == 1:
            continue
        if method.packed_rows:  # their attention, eager or the block mask, is quadratic in the row
            seq_len = method.sample_rows * seq_len
        else:
            strategy = replace(strategy, micro_batch_size=method.sample_rows * strategy.micro_batch_size)
    return strategy, seq_len


def breakdown_keys(methods: Sequence[MethodTerms], corrected: bool = False) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(device keys, host keys) the breakdown of a plan with these methods holds, in order;
    `corrected`: a measured correction applies (CORRECTION_KEY last)."""
    models = [m for method in methods for m in method.auxiliary]
    gpu = (*GPU_KEYS, *(key for m in models for key in m.gpu_keys[:3]), *(key for t in methods for key in t.gpu_keys),
           *(m.gpu_keys[3] for m in models), *((CORRECTION_KEY,) if corrected else ()))
    cpu = (*CPU_KEYS, *(key for m in models for key in m.cpu_keys), *(key for t in methods for key in t.cpu_keys))
    return gpu, cpu


def estimate_memory(shape: ModelShape, hw: HardwareProfile, strategy: Strategy, seq_len: int,
                    gradient_accumulation: int = 1, methods: Sequence[MethodTerms] = (),
                    packing: SamplePacking | None = None) -> MemoryEstimate:
    """Per-rank device bytes and per-node host bytes at the peak, by component (see module doc);
    `methods`: the plan's training methods' terms (planner/terms.py), in order; `packing`: chat /
    instruction samples packed apart (planner/packing.py: the attention mask)."""
    c, sw, rpn = compute_bytes(strategy), hw.software, hw.ranks_per_node
    trained = trained_shape(shape, methods)  # what has gradients and optimizer states
    rows, full_seq = forward_rows(methods, strategy, seq_len)  # the micro-batch the forward sees
    rows_seq = long_context.local_seq_len(rows, full_seq)  # a rank's slice of each sample (sequence parallel)
    priced = [method.priced(method, hw, rows, full_seq, gradient_accumulation) for method in methods]
    models = [m for method in methods for m in method.auxiliary]
    correction = hw.memory_correction(strategy.family)

    # the model states, as the backend places them, every term of the breakdown from 0 in its order
    placed = _placement(trained, hw, strategy, gradient_accumulation)
    gpu_keys, cpu_keys = breakdown_keys(methods, correction > 1.0)
    placed.gpu = {key: placed.gpu.get(key, 0) for key in gpu_keys}
    placed.cpu = {key: placed.cpu.get(key, 0) for key in cpu_keys}
    for terms in priced:  # the trained states in another dtype than fp32 (bf16 adapters)
        for key, factor in terms.state_scale.items():
            (placed.gpu if key in placed.gpu else placed.cpu)[key] *= factor
    for terms in priced:  # a frozen base beside the trained states (LoRA)
        _add(placed.gpu, terms.frozen.gpu)
        _add(placed.cpu, terms.frozen.cpu)
    for model in models:  # the frozen models a method runs beside (planner/auxiliary.py)
        on_gpu, on_cpu = auxiliary.state_bytes(model, strategy, hw, seq_len, c)
        placed.gpu.update(on_gpu)
        placed.cpu.update(on_cpu)
    gpu = {key: float(v) for key, v in placed.gpu.items()}
    if strategy.embedding_offload:  # the frozen input embedding stays in host memory (knobs.py)
        gpu["weights"] -= knobs.input_embedding_bytes(shape, c)
    _add(gpu, [added for terms in priced for added in terms.own.gpu])  # the methods' own tensors (pruning masks)

    # one micro-batch's activations and logits
    saved = sum((terms.saved_bytes for terms in priced), 0.0)  # per block beyond the formula (LoRA's inputs)
    gpu["activations"] = activation_bytes(shape, rows, rows_seq, sw, saved)
    gpu["logits"] = logits_bytes(shape, rows, rows_seq, sw)
    if packing is not None:  # chat / instruction samples packed apart (planner/packing.py)
        gpu["attention_mask"] = float(mask_bytes(packing, shape, rows, full_seq, c))  # attention spans the sample
    gpu["optimizer_states"] *= knobs.optimizer_state_factor(strategy)  # adamw8bit: 8-bit m, v
    # see "Peak model" above; with accumulation (or torch < 2.0's zero_grad) the gradients persist
    if gradient_accumulation == 1 and not software_terms.gradients_persist(sw):
        # What exists only in backward and the step reuses the bytes of what backward frees: the
        # activations, the logits and the gathered parameters (resharded by the end of backward).
        # Under DDP and FSDP2 the last block backward differentiates lives until every gradient exists
        # (DeepSpeed's partitions fill as backward goes: simulated, they never meet it at full size); the
        # step runs after it is freed too.
        free = gpu["activations"] + gpu["logits"] + gpu.get("attention_mask", 0.0) + gpu["gathered_params"]
        whole_gradients = priced_as(strategy.backend) in ("ddp", "fsdp")
        last_block = min(free, last_block_bytes(shape, rows, rows_seq, sw, saved)) if whole_gradients else 0.0
        free -= last_block
        backward, step = _backward_only(gpu, trained, strategy, shard_group_size(hw, strategy))
        for key, size in backward:
            reused = min(free, size)
            gpu[key] -= reused
            free -= reused
        gpu["gradients"] += max(0.0, step - free - last_block)  # step temporaries beyond what is still free

    # peaks the training peak does not cover
    step_outputs = gpu["activations"] + gpu["logits"]
    for terms in priced:  # before the activations exist (a frozen base's FSDP2 forward start)
        _add(gpu, [(key, max(0.0, held - step_outputs)) for key, held in terms.before_activations.items()])
    for model in models:  # precomputed: the first pass runs before the trained model exists
        gpu[f"{model.name}_first_pass"] = max(0.0, auxiliary.first_pass_bytes(model, strategy, hw, seq_len, c)
                                               - sum(gpu.values()))

    # what the device itself holds
    if hw.has_gpu:
        gpu["cuda_context"] = software_terms.cuda_context_bytes(sw)
        gpu["workspace"] = k.CUBLAS_WORKSPACE_BYTES
        if hw.world_size > 1:
            communicators = 2 if strategy.hybrid_shard else 1  # shard group + replicate group
            gpu["nccl_buffers"] = communicators * nccl_buffer_bytes(hw)
        accounted = sum(v for key, v in gpu.items() if key != "cuda_context")
        gpu["allocator_reserve"] = allocator_reserve(accounted, state_bytes(gpu), strategy, hw.expandable_segments)
    if correction > 1.0:
        # Measured on this machine (an OOM's shortfall, a calibration entry): the model's total scaled
        # up to what was measured; the terms above stay as the model has them.
        gpu[CORRECTION_KEY] = (correction - 1.0) * sum(v for key, v in gpu.items() if key != CORRECTION_KEY)

    # the host, per node
    cpu = {key: rpn * float(v) for key, v in placed.cpu.items()}
    _add(cpu, [added for terms in priced for added in terms.own.cpu], rpn)
    cpu["offloaded_activations"] = rpn * knobs.offloaded_activation_bytes(shape, rows, rows_seq, c)
    # every DDP rank its own copy of the table (each process looks up its own micro-batch)
    cpu["offloaded_embedding"] = rpn * knobs.host_embedding_bytes(shape, rows, rows_seq, c)
    steady = sum(cpu.values()) + (0 if hw.has_gpu else rpn * sum(gpu.values()))
    load = next((terms.load_bytes for terms in priced if terms.load_bytes is not None), None)
    cpu["loading_spike"] = max(0.0, (_load_bytes(shape, hw, strategy) if load is None else load) - steady)
    cpu["process_runtime"] = rpn * (k.PROCESS_RUNTIME_BYTES_GPU if hw.has_gpu else k.PROCESS_RUNTIME_BYTES_CPU)
    return MemoryEstimate(gpu={key: int(v) for key, v in gpu.items()},
                          cpu={key: int(v) for key, v in cpu.items()},
                          nvme_bytes=int(rpn * placed.nvme))


def node_host_bytes(memory: MemoryEstimate, hw: HardwareProfile) -> int:
    """Host RAM one node needs: the host dict, plus every rank's training memory on CPU-only profiles."""
    return memory.cpu_total + (0 if hw.has_gpu else hw.ranks_per_node * memory.gpu_total)
