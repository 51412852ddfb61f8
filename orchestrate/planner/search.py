"""The planner: enumerate strategies, estimate each, keep what fits, choose the fastest.

Pure: no I/O, no devices. Two entry points:
- `make_plan(config, hw, shape, methods) -> RunPlan | Refusal`: every candidate weighed, with the
  training methods' terms (planner/terms.py) the caller computed; a Refusal when nothing fits, so
  `orchestrate plan` can still print the table. Raises `UserError` only for inputs that cannot be
  planned at all (batch not divisible by the world size, contradictory pins).
- `planner.remedies.infeasible_error(plan, ...)`: the `UserError` (exit 2) listing the closest
  candidates and remedies computed by re-planning variations.
orchestrate/planning.py puts them together (the methods' terms from the registry, train.method auto).

Search space: backend x ZeRO stage x offload x activation checkpointing x micro-batch, at one
precision (pinned, or "auto": bf16 where the GPU has it, fp16 on Turing, fp32 on CPU-only), minus
what a backend cannot run (each backend's `problems`, the rules its renderer applies too) and what
cannot help: no offload on CPU-only profiles; NVMe only for ZeRO-3 (ZeRO-1/2 keep
"nvme" states in RAM) and only with an NVMe directory; FSDP hybrid shard only across nodes; ZeRO-1
not on a single rank (nothing to partition; ZeRO-2 stands for it). User pins narrow the space.
Micro-batches are the divisors of global_batch_size / world_size. `candidates` keeps, per strategy
without its micro-batch, only the fastest fitting micro-batch, or the one closest to fitting when none
fits, so the table has one row per strategy. Fitting candidates come first, fastest first (fp32 Adam
states before 8-bit ones; ties: fewer offloads, simpler backend, lower stage, no recompute, larger
micro-batch); then the rest, closest to fitting first (sum of relative overflows). The memory knobs
(chunked loss, activation offload, 8-bit optimizer: planner/knobs.py) are tried with the micro-batch,
so each row shows the knobs its strategy needs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from itertools import product

from orchestrate.backends.registry import backend_names, get_backend, runs_knob, tie_break
from orchestrate.config.requirements import OPTIMIZER_LIBRARIES, installed
from orchestrate.config.schema import RunConfig
from orchestrate.errors import Problem, UserError
from orchestrate.hardware.profile import HardwareProfile
from orchestrate.hardware.units import gib
from orchestrate.model.shape import ModelShape
from orchestrate.planner.estimate import MemoryEstimate
from orchestrate.planner.knobs import (
    auto_loss_chunks,
    embedding_offload_problems,
    knob_options,
    knob_problems,
)
from orchestrate.planner.long_context import (
    auto_mlp_tiles,
    fuses,
    long_context_note,
    long_context_problems,
    sequence_parallel_degrees,
    slice_length,
    tiles_mlp,
)
from orchestrate.planner.memory import estimate_memory, node_host_bytes
from orchestrate.planner.packing import SamplePacking, sample_packing
from orchestrate.planner.plan import Candidate, Refusal, RunPlan
from orchestrate.planner.speed import estimate_speed
from orchestrate.planner.strategy import Sharding, Strategy, data_parallel_size
from orchestrate.planner.terms import MethodTerms, trains_under

_OFFLOADS = (("none", "none"), ("cpu", "none"), ("cpu", "cpu"), ("nvme", "none"), ("nvme", "cpu"),
             ("cpu", "nvme"), ("nvme", "nvme"))
"""(optimizer, parameters) offload targets, in search order."""
_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class Limits:
    """What a candidate must fit in: usable bytes per GPU, per node of RAM, free NVMe per node."""

    gpu: int | None
    """Usable device bytes per rank; None on CPU-only profiles."""
    cpu: int
    nvme: int | None
    """Free NVMe bytes; None when an NVMe path is configured but its free space is unknown."""

    @classmethod
    def of(cls, config: RunConfig, hw: HardwareProfile) -> Limits:
        gpu = int(config.strategy.gpu_memory_headroom * hw.gpu.memory_bytes) if hw.has_gpu else None
        return cls(gpu=gpu, cpu=int(config.strategy.cpu_memory_headroom * hw.cpu_memory_bytes),
                   nvme=_nvme_free(config, hw))

    def overflows(self, memory: MemoryEstimate, hw: HardwareProfile) -> list[tuple[str, int, int, str]]:
        """(limit, needed, available, word) for every limit the estimate exceeds."""
        out = []
        if self.gpu is not None and memory.gpu_total > self.gpu:
            out.append(("GPU", memory.gpu_total, self.gpu, "usable"))
        host = node_host_bytes(memory, hw)
        if host > self.cpu:
            out.append(("CPU", host, self.cpu, "usable"))
        if self.nvme is not None and memory.nvme_bytes > self.nvme:
            out.append(("NVMe", memory.nvme_bytes, self.nvme, "free"))
        return out


def describe_hardware(hw: HardwareProfile) -> str:
    ram = f"{gib(hw.cpu_memory_bytes)} RAM per node"
    nodes = f"{hw.nodes} nodes x " if hw.nodes > 1 else ""
    if hw.has_gpu:
        return f"{nodes}{hw.gpus_per_node} x {hw.gpu.name} ({gib(hw.gpu.memory_bytes)}), {ram}"
    return f"{nodes}{hw.cpu_processes} CPU process(es), {ram}"


def _nvme_free(config: RunConfig, hw: HardwareProfile) -> int | None:
    if hw.nvme_path:
        return hw.nvme_free_bytes
    if config.strategy.nvme_path:
        # Hardware resolution measures free space when it knows the path; if it did not, the check
        # is left to DeepSpeed at start-up.
        return hw.nvme_free_bytes or None
    return 0


def nvme_available(config: RunConfig, hw: HardwareProfile) -> bool:
    return bool(hw.nvme_path or config.strategy.nvme_path)


def _space(hw: HardwareProfile) -> list[Sharding]:
    """Every sharding the planner could name, valid or not, in search order."""
    return [Sharding(name, stage, opt, par, hybrid)
            for name in backend_names() for hybrid in (False, True) for stage in _STAGES
            for opt, par in _OFFLOADS]


def _searched(s: Sharding, hw: HardwareProfile, nvme: bool, zero1: bool) -> bool:
    """What the search leaves out although a backend could run it: offload where there is no device
    to offload from, NVMe without a directory, hybrid shard on one node, ZeRO-1 on one rank."""
    offloads = s.offload_optimizer != "none" or s.offload_params != "none"
    return ((hw.has_gpu or not offloads) and (nvme or "nvme" not in (s.offload_optimizer, s.offload_params))
            and (hw.nodes > 1 or not s.hybrid_shard) and (zero1 or s.zero_stage != 1))


def _judge(s: Sharding) -> list[Problem]:
    """Why the planner does not consider `s`: the backend's own rules (what it cannot run), then
    what could run but cannot help: a stage the backend is not planned with, "nvme" where it would
    stay in RAM, parameters offloaded while their optimizer states stay on the GPU."""
    backend = get_backend(s.backend)
    problems = backend.problems(s)
    if problems:
        return problems
    if "nvme" in (s.offload_optimizer, s.offload_params) and s.zero_stage in (1, 2):
        # DeepSpeed's stage_1_and_2.py has no NVMe swapper: "nvme" offload keeps the states in CPU RAM.
        problems.append(Problem("strategy.offload", f"DeepSpeed ZeRO-{s.zero_stage} keeps 'nvme'-offloaded states "
                                "in CPU RAM (only ZeRO-3 swaps to NVMe)", "use zero_stage: 3, or offload: cpu"))
    if s.offload_params != "none" and s.offload_optimizer == "none":
        problems.append(Problem("strategy.offload_params", "parameter offload without optimizer offload is not "
                                "planned (the fp32 optimizer states would stay on the GPU)", "set offload: cpu or nvme"))
    if s.zero_stage not in backend.zero_stages and not any(p.where == "strategy.zero_stage" for p in problems):
        stages = ", ".join(map(str, backend.zero_stages))
        problems.append(Problem("strategy.zero_stage", f"stage {s.zero_stage} with {s.backend} is not planned",
                                f"use zero_stage {stages}" + (", or backend ddp (same memory)" if s.zero_stage == 0
                                                              else "")))
    return problems


def _all_bases(hw: HardwareProfile, nvme: bool, zero1: bool) -> list[Sharding]:
    return [s for s in _space(hw) if _searched(s, hw, nvme, zero1) and not _judge(s)]


def _pin_problems(config: RunConfig, hw: HardwareProfile) -> list[Problem]:
    """Pins that contradict each other or the hardware, with the fix. What a backend cannot do is
    its own `problems`: reported when every sharding the pins allow has some."""
    s, problems = config.strategy, []
    if s.offload in ("cpu", "nvme") and not hw.has_gpu:
        problems.append(Problem("strategy.offload", "offload moves state off a GPU; this profile has none",
                                "set offload: none (or auto)"))
    if s.offload == "nvme" and not nvme_available(config, hw):
        problems.append(Problem("strategy.offload", "NVMe offload needs a directory on an NVMe disk",
                                "set strategy.nvme_path or pass --nvme PATH"))
    chunks, task = config.train.loss_chunks, config.model.task
    if chunks != "auto" and chunks > 0 and task != "causal-lm":
        problems.append(Problem("train.loss_chunks", f"chunks the causal-LM loss; model.task is {task}",
                                "set loss_chunks: 0 (or auto)"))
    if s.offload_params is True and s.offload == "none":
        problems.append(Problem("strategy.offload_params", "offloading parameters needs an offload target",
                                "set offload: cpu or nvme"))
    if problems:
        return problems
    pinned = [b for b in _space(hw) if _matches_pins(b, config)]
    judged = [_judge(b) for b in pinned]
    if pinned and all(judged):
        for found in judged:
            problems += [p for p in found if p not in problems]
    return problems


def _matches_pins(base: Sharding, config: RunConfig) -> bool:
    s = config.strategy
    if s.backend != "auto" and base.backend != s.backend:
        return False
    if s.zero_stage != "auto" and base.zero_stage != s.zero_stage:
        return False
    if s.offload != "auto" and base.offload_optimizer != s.offload:
        return False
    if s.offload_params is True:
        if base.offload_params == "none" or (s.offload != "auto" and base.offload_params != s.offload):
            return False
    if s.offload_params is False and base.offload_params != "none":
        return False
    # a pinned offload target applies to parameters too ("offload_params: also ... to the offload target")
    return s.offload == "auto" or base.offload_params in ("none", s.offload)


def resolve_precision(config: RunConfig, hw: HardwareProfile) -> str:
    """The training precision: the pin, or bf16 / fp16 (Turing) / fp32 (CPU-only)."""
    pinned = config.train.precision
    if pinned == "bf16" and hw.has_gpu and not hw.gpu.supports_bf16:
        cc = ".".join(map(str, hw.gpu.compute_capability))
        raise UserError("Cannot plan this run", [Problem(
            "train.precision", f"bf16 needs compute capability 8.0+; {hw.gpu.name} is {cc}",
            "use precision: fp16 (dynamic loss scaling) or auto")])
    if pinned != "auto":
        return pinned
    if not hw.has_gpu:
        return "fp32"
    return "bf16" if hw.gpu.supports_bf16 else "fp16"


def _micro_batches(config: RunConfig, hw: HardwareProfile, data_parallel: int | None = None) -> list[int]:
    """The micro-batches that divide each data-parallel rank's share of the global batch (`data_parallel`:
    ranks reading different samples, the world size unless sequence parallelism groups them)."""
    world, global_batch = data_parallel or hw.world_size, config.train.global_batch_size
    if global_batch % world:
        lower, upper = global_batch - global_batch % world, global_batch + world - global_batch % world
        examples = " or ".join(str(v) for v in (lower, upper) if v > 0)
        raise UserError("Cannot plan this run", [Problem(
            "train.global_batch_size",
            f"{global_batch} is not divisible by the world size {world} "
            f"({hw.nodes} node(s) x {hw.ranks_per_node} rank(s))" if world == hw.world_size else
            f"{global_batch} is not divisible by the {world} data-parallel ranks",
            f"use a multiple of {world} (e.g. {examples}), or change --gpus")])
    per_rank = global_batch // world
    divisors = [m for m in range(1, per_rank + 1) if per_rank % m == 0]
    pinned = config.train.micro_batch_size
    if pinned == "auto":
        return divisors
    if per_rank % pinned:
        raise UserError("Cannot plan this run", [Problem(
            "train.micro_batch_size",
            f"{pinned} does not divide the per-rank batch {per_rank} (global {global_batch} / world {world})",
            f"use one of {', '.join(map(str, divisors))}, or auto")])
    return [pinned]


def _with_models(methods: Sequence[MethodTerms], chosen: tuple) -> list[MethodTerms]:
    """The methods' terms with their auxiliary models at the placements of `chosen` (in their order)."""
    out, i = [], 0
    for method in methods:
        count = len(method.auxiliary)
        out.append(replace(method, auxiliary=tuple(chosen[i:i + count])) if count else method)
        i += count
    return out


def _offloads(strategy: Strategy) -> bool:
    """Whether the strategy keeps optimizer states or parameters off the device."""
    return strategy.offload_optimizer != "none" or strategy.offload_params != "none"


def _candidate(shape: ModelShape, hw: HardwareProfile, strategy: Strategy, seq_len: int, accumulation: int,
               limits: Limits, methods: Sequence[MethodTerms], packing: SamplePacking | None = None) -> Candidate:
    models = [m for method in methods for m in method.auxiliary]
    if any(m.placement == "auto" for m in models):
        # The first placements that fit, cheapest per step first; precomputed last (a first pass, disk).
        tried = [_candidate(shape, hw, strategy, seq_len, accumulation, limits, _with_models(methods, chosen),
                            packing)
                 for chosen in product(*(m.choices(hw) for m in models))]
        taken = next((c for c in tried if c.fits), tried[-1])
        before = [f"{'+'.join(c.placements.values())} does not fit ({c.reason})" for c in tried[:tried.index(taken)]]
        return replace(taken, placement_reason="; ".join(before))  # why auto passed the cheaper ones over
    memory = estimate_memory(shape, hw, strategy, seq_len, accumulation, methods, packing)
    speed = estimate_speed(shape, hw, strategy, seq_len, accumulation, methods)
    over = limits.overflows(memory, hw)
    reason = "; ".join(f"{what} {gib(need)} > {gib(have)} {word} (+{gib(need - have)})"
                       for what, need, have, word in over)
    return Candidate(strategy, memory, speed, accumulation, fits=not over, reason=reason,
                     placements={m.name: m.placement for m in models})


def overflow_score(candidate: Candidate, plan_limits: Limits, hw: HardwareProfile) -> float:
    """Sum of relative overflows: 0 for a fitting candidate; smaller is closer to fitting."""
    return sum((need - have) / max(have, 1) for _, need, have, _ in plan_limits.overflows(candidate.memory, hw))


def _knobs_on(s: Strategy) -> frozenset[str]:
    """The memory knobs a strategy turns on. Each trades speed (or, for 8-bit states and fused kernels,
    rank: see `_rank_key`) for memory, so a strategy with a superset of a fitting one's is never chosen."""
    return frozenset(name for name, on in (
        ("loss_chunks", s.loss_chunks > 0), ("activation_offload", s.activation_offload),
        ("adamw8bit", s.optimizer != "adamw"), ("embedding_offload", s.embedding_offload),
        ("mlp_tiles", s.mlp_tiles > 0), ("fused_kernels", s.fused_kernels)) if on)


def _rank_key(c: Candidate) -> tuple:
    s = c.strategy
    offloads = (s.offload_optimizer != "none") + (s.offload_params != "none")
    knobs = len(_knobs_on(s))
    # fp32 Adam states before speed (8-bit states change the numerics: optimizer.name auto takes them only
    # where nothing with fp32 states fits); then no activation offload before speed (no GPU has run it
    # yet: taken only where nothing fits without it), then likewise no embedding offload and no sequence
    # parallelism (the sequence split only where one rank cannot hold it); ties: fewer offloads, fewer
    # memory knobs, simpler backend, lower stage, no recompute, larger micro-batch (fewer steps of Python
    # overhead, which the speed model does not see)
    return (s.optimizer != "adamw", s.activation_offload, s.embedding_offload, s.sequence_parallel,
            -c.speed.tokens_per_s, offloads, knobs, tie_break(s.backend), s.zero_stage, s.activation_checkpointing,
            -s.micro_batch_size)


def _knob_combos(config: RunConfig, hw: HardwareProfile, shape: ModelShape, backend: str, checkpointing: bool,
                 has_8bit_optimizer: bool, embedding_offloadable: bool, chunkable: bool,
                 sequence_parallel: int, seq_len: int | None = None) -> list[tuple]:
    """(loss_chunks, activation_offload, optimizer, embedding_offload, mlp_tiles, fused_kernels) settings to
    try: the pins, or for "auto" off and on where the knob can run (planner/knobs.py, long_context.py);
    `has_8bit_optimizer`: bitsandbytes is installed; `chunkable`: the methods' objective can take the loss in
    chunks; `sequence_parallel`: the degree tried (the chunks and tiles count a rank's slice); `seq_len`:
    another length than train.seq_len's."""
    t = config.train
    local = slice_length(seq_len or t.seq_len, sequence_parallel)
    chunks = knob_options(t.loss_chunks, backend, "loss_chunks", config.model.task == "causal-lm" and chunkable,
                          (0, auto_loss_chunks(local)))
    offload = knob_options(t.activation_offload, backend, "activation_offload", hw.has_gpu and checkpointing,
                           (False, True))
    optimizer = knob_options(t.optimizer.name, backend, "adamw8bit", has_8bit_optimizer, ("adamw", "adamw8bit"))
    embedding = knob_options(t.embedding_offload, backend, "embedding_offload", embedding_offloadable, (False, True))
    auto_tiles = auto_mlp_tiles(local)
    tiles = knob_options(t.mlp_tiles, backend, "mlp_tiles", tiles_mlp(shape) and auto_tiles > 0, (0, auto_tiles))
    fused = knob_options(t.fused_kernels, backend, "fused_kernels",
                         hw.has_gpu and hw.software.liger_kernel is not None and fuses(shape), (False, True))
    return [(c, o, n, e, m, f) for c in chunks for o in offload for n in optimizer for e in embedding
            for m in tiles for f in fused]


def _sequence_split_problems(config: RunConfig, methods: Sequence[MethodTerms], packing: SamplePacking | None) -> list[Problem]:
    """Why no sample of this run can be split over ranks (the worker's objective and data refuse these)."""
    where, off = "train.sequence_parallel", "set sequence_parallel: 1 (or auto)"
    out = []
    if config.model.task != "causal-lm" or config.model.module is not None or config.data.module is not None:
        out.append(Problem(where, "splits a Hugging Face causal LM's next-token loss; this model or its data "
                           "is another kind", off))
    if not all(method.splits_sequence for method in methods):
        out.append(Problem(where, "the training method's objective reads whole sequences", off))
    if packing is not None and packing.certain:
        out.append(Problem(where, "packed chat or instruction samples would attend to each other across the "
                           "split", "set data.packing: false, or sequence_parallel: 1 (or auto)"))
    return out


def _sequence_parallel_options(config: RunConfig, hw: HardwareProfile, shape: ModelShape,
                               unsplittable: list[Problem]) -> list[int]:
    """Degrees to try: the pin, or (auto) 1 and every degree the world, heads and sequence allow where a
    backend runs it (long_context.py); `unsplittable`: why this run cannot split its samples (a pin > 1 is
    then an error)."""
    pinned = config.train.sequence_parallel
    if pinned != "auto":
        if pinned > 1 and unsplittable:
            raise UserError("Cannot plan this run: its samples cannot be split over ranks", unsplittable)
        return [pinned]
    if unsplittable:
        return [1]
    return [1, *sequence_parallel_degrees(shape, hw.world_size, config.train.seq_len)]


def make_plan(config: RunConfig, hw: HardwareProfile, shape: ModelShape, methods: Sequence[MethodTerms],
              fitting_only: bool = False) -> RunPlan | Refusal:
    """Every candidate, best first: a RunPlan whose `chosen` is the fastest fitting one, or a Refusal
    when none fits (see module doc); `methods`: the terms of the config's training methods, in order
    (their auxiliary models counted in every candidate); `fitting_only`: what fits is all the caller
    asks (the remedies' variations): a sharding whose every knob on still overflows the GPU is not
    weighed further, no closest candidate is kept for it, and no longest length is bisected."""
    problems = _pin_problems(config, hw) + [p for method in methods for p in method.problems]
    if problems:
        raise UserError("Cannot plan this run: the strategy pins contradict each other or the hardware", problems)
    precision = resolve_precision(config, hw)
    seq_len, packing = config.train.seq_len, sample_packing(config, hw, shape)
    degrees = _sequence_parallel_options(config, hw, shape, _sequence_split_problems(config, methods, packing))
    # the micro-batches of each degree's data-parallel ranks; an indivisible batch is an error only where
    # no degree divides it (a batch of 1 on 2 cards trains with both on one sample's halves)
    micros, indivisible = {}, None
    for degree in degrees:
        try:
            micros[degree] = _micro_batches(config, hw, hw.world_size // degree if hw.world_size % degree == 0
                                            else hw.world_size)
        except UserError as err:
            indivisible = indivisible or err
    if not micros:
        raise indivisible
    ac = config.train.activation_checkpointing
    ac_options = [False, True] if ac == "auto" else [ac]
    for method in methods:  # your own module without repeated blocks has nothing to recompute
        if method.no_recompute is not None:
            if ac is True:
                raise UserError("Cannot plan this run", [method.no_recompute])
            ac_options = [False]
    limits = Limits.of(config, hw)
    # ZeRO-1 partitions nothing on one rank and ZeRO-2 covers it there, unless it is pinned.
    zero1 = hw.world_size > 1 or config.strategy.zero_stage == 1
    bases = [b for b in _all_bases(hw, nvme_available(config, hw), zero1) if _matches_pins(b, config)
             and all(trains_under(method, b) for method in methods)]
    if not bases:
        pins = {k: v for k, v in config.strategy.model_dump().items()
                if k in ("backend", "zero_stage", "offload", "offload_params") and v != "auto"}
        raise UserError("Cannot plan this run: no strategy matches the pins", [Problem(
            "strategy", f"nothing planned matches {pins} on this hardware",
            "relax a pin (set it to auto)")])

    has_8bit_optimizer = installed(OPTIMIZER_LIBRARIES["adamw8bit"])  # looked up once per plan (a file-system probe)
    # what embedding offload needs (knobs.py): a frozen embedding not tied to the head
    frozen, tied = any(method.freezes_base for method in methods), shape.tied_embeddings
    chunkable = all(method.chunks_loss for method in methods)
    kept: list[Candidate] = []
    refused: list[Problem] = []
    fused_library = hw.software.liger_kernel is not None
    embedding_offloadable = not embedding_offload_problems(frozen, tied, hw.has_gpu)

    def cannot_run(strategy: Strategy, seq: int) -> list[Problem]:
        """A pinned knob where it cannot run (knobs.py, long_context.py)."""
        return (knob_problems(strategy, hw.has_gpu, frozen, tied)
                + long_context_problems(strategy, shape, hw.has_gpu, fused_library, hw.world_size, seq))

    def combos_of(backend: str, checkpointing: bool, degree: int, seq: int | None = None) -> list[tuple]:
        return _knob_combos(config, hw, shape, backend, checkpointing, has_8bit_optimizer, embedding_offloadable,
                            chunkable, degree, seq)

    def weigh(base: Sharding, checkpointing: bool, degree: int) -> Candidate | None:
        """The kept candidate of one sharding, recompute setting and sequence-parallel degree: the best
        fitting knob combination, else the closest to fitting; None where no combination can run."""
        if degree > 1 and config.train.sequence_parallel == "auto" and not runs_knob(base.backend, "sequence_parallel"):
            return None  # auto tries the split only where the backend runs it
        combos = combos_of(base.backend, checkpointing, degree)
        runnable = []
        for strategy in (Strategy(base.backend, base.zero_stage, base.offload_optimizer, base.offload_params,
                                  precision, checkpointing, micro, base.hybrid_shard, chunks, offload, opt, emb,
                                  tiles, degree, fused)
                         for micro in micros[degree] for chunks, offload, opt, emb, tiles, fused in combos):
            found = cannot_run(strategy, seq_len)
            refused.extend(p for p in found if p not in refused)
            if not found:
                runnable.append(strategy)
        if not runnable:
            return None
        per_rank = config.train.global_batch_size // data_parallel_size(runnable[0], hw.world_size)

        def evaluate(strategies: list[Strategy]) -> list[Candidate]:
            tried, fitting_knobs = [], []
            for strategy in sorted(strategies, key=lambda s: len(_knobs_on(s))):
                on = (strategy.micro_batch_size, _knobs_on(strategy))
                if any(micro == on[0] and knobs <= on[1] for micro, knobs in fitting_knobs):
                    continue  # more knobs on than a combination that fits: slower or equal, and ranked after it
                tried.append(_candidate(shape, hw, strategy, seq_len, per_rank // strategy.micro_batch_size, limits,
                                        methods, packing))
                if tried[-1].fits:
                    fitting_knobs.append(on)
            return tried

        # The long-context knobs (long_context.py) only where nothing fits without them, and the rest of
        # their combinations only where the one that saves the most fits: the tiled MLP costs a forward of
        # every MLP, more than any other knob, and fused kernels are not priced as faster.
        plain = [s for s in runnable if not s.mlp_tiles and not s.fused_kernels]
        later = [s for s in runnable if s.mlp_tiles or s.fused_kernels]
        if (fitting_only or degree > 1) and limits.gpu is not None:
            # every knob on at the smallest micro-batch holds the least on the GPU: over there, nothing fits
            # (a sequence split that cannot fit is left out of the table too: it ranks after the rest)
            least = min(runnable, key=lambda s: (-len(_knobs_on(s)), s.micro_batch_size))
            if _candidate(shape, hw, least, seq_len, per_rank // least.micro_batch_size, limits, methods,
                          packing).memory.gpu_total > limits.gpu:
                return None
        tried = evaluate(plain)
        if later and not any(c.fits for c in tried):
            most = min(later, key=lambda s: (-len(_knobs_on(s)), s.micro_batch_size))
            first = _candidate(shape, hw, most, seq_len, per_rank // most.micro_batch_size, limits, methods, packing)
            tried += evaluate(later) if first.fits else [first]
        fit = [c for c in tried if c.fits]
        return (min(fit, key=_rank_key) if fit
                else min(tried, key=lambda c: overflow_score(c, limits, hw)))

    # sequence parallelism only where no single rank holds the sequence (it ranks after every plan without)
    for degree in micros:
        kept += [c for base in bases for checkpointing in ac_options if (c := weigh(base, checkpointing, degree))]
        if any(c.fits for c in kept):
            break

    if not kept and not refused and indivisible:  # the batch divides only by degrees no backend runs
        raise indivisible
    if not kept and fitting_only:
        return Refusal(config=config, hardware=hw, shape=shape, candidates=[], notes=[])
    if not kept:  # every strategy the pins allow has a knob that cannot run there
        raise UserError("Cannot plan this run: the memory-knob pins cannot run on any strategy allowed", refused)
    # a method may rank a fitting candidate after the others (LoRA's offload: no GPU has run it)
    offloaded_last = any(method.offloaded_last for method in methods)
    fitting = sorted((c for c in kept if c.fits), key=lambda c: (offloaded_last and _offloads(c.strategy), _rank_key(c)))
    rest = sorted((c for c in kept if not c.fits), key=lambda c: (overflow_score(c, limits, hw), _rank_key(c)))
    notes = [packing.describe()] if packing else []
    if any(method.find_longest_seq_len for method in methods) and not fitting_only:
        def most_knobs(strategy: Strategy, seq: int) -> Strategy:
            """`strategy` at `seq` with every knob auto may turn on there, at micro-batch 1 where auto."""
            combos = combos_of(strategy.backend, strategy.activation_checkpointing, strategy.sequence_parallel, seq)
            chunks, offload, opt, emb, tiles, fused = combos[-1]  # each knob's options end with its "on"
            most = replace(strategy, loss_chunks=chunks, activation_offload=offload, optimizer=opt,
                           embedding_offload=emb, mlp_tiles=tiles, fused_kernels=fused,
                           micro_batch_size=1 if config.train.micro_batch_size == "auto" else strategy.micro_batch_size)
            return strategy if cannot_run(most, seq) else most

        longest, on = max(_longest_seq_len(shape, hw, c, limits, methods, packing, most_knobs)
                          for c in fitting + rest)
        notes.append("the longest train.seq_len that fits: " + (f"{longest} ({on})" if longest else "none (not even 64)"))
    if not fitting:
        return Refusal(config=config, hardware=hw, shape=shape, candidates=rest, notes=notes)
    if (chosen := long_context_note(fitting[0].strategy, config)) is not None:
        notes.append(chosen)
    return RunPlan(config=config, hardware=hw, shape=shape, candidates=fitting + rest, chosen=fitting[0], notes=notes)


def _longest_seq_len(shape: ModelShape, hw: HardwareProfile, best: Candidate, limits: Limits,
                     methods: Sequence[MethodTerms], packing: SamplePacking | None,
                     strategy_at: Callable[[Strategy, int], Strategy]) -> tuple[int, str]:
    """(the longest seq_len, a multiple of 64 up to the model's positions, at which `best`'s sharding fits
    with the configured placements (auto: chosen again per length) and the strategy `strategy_at` gives
    it at that length (every memory knob auto may turn on); 0: not even 64, the strategy's name there). The
    same samples per step. Memory grows with seq_len, so a bisection."""
    samples = best.strategy.micro_batch_size * best.gradient_accumulation

    def fits(seq: int) -> bool:
        strategy = strategy_at(best.strategy, seq)
        return _candidate(shape, hw, strategy, seq, samples // strategy.micro_batch_size, limits, methods,
                          packing).fits

    low, high = 0, max(1, shape.max_position_embeddings // 64)  # in units of 64 tokens
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(64 * middle) else (low, middle - 1)
    return 64 * low, strategy_at(best.strategy, 64 * max(low, 1)).name
