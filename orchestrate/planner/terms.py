"""What a training method contributes to a plan, as values the planner reads: one `MethodTerms` per
active method, computed once per plan above the planner (orchestrate/planning.py asks each method,
orchestrate/methods/spec.py) and handed to `make_plan`, the memory and the speed model in the methods'
order.

Most of a method's part does not depend on the candidate: what trains, what it restricts in the
search, the auxiliary models it runs beside, the breakdown keys of its own. Those are plain fields.
What does (bytes by where a sharding places them, seconds per step) is one function, `priced`, of the
candidate: it returns a `PricedTerms`. A method never edits another's terms: the planner combines them
(memory.py, speed.py, search.py), in order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from orchestrate.config.schema import RunConfig
from orchestrate.errors import Problem
from orchestrate.hardware.profile import HardwareProfile
from orchestrate.model.shape import ModelShape
from orchestrate.planner.auxiliary import AuxiliaryModel
from orchestrate.planner.strategy import Sharding, Strategy


@dataclass
class PlacedBytes:
    """Bytes a method adds, by breakdown key, in the order it adds them: per rank on the device
    (`gpu`), per rank on the host (`cpu`). A key the breakdown has already is added to; a new one is
    the method's own term (declared in `MethodTerms.gpu_keys` / `cpu_keys`). Kept as a list of
    additions, so the memory model sums in the order the method states (floating-point sums depend on it)."""

    gpu: list[tuple[str, float]] = field(default_factory=list)
    cpu: list[tuple[str, float]] = field(default_factory=list)

    def on_gpu(self, key: str, value: float) -> PlacedBytes:
        self.gpu.append((key, value))
        return self

    def on_cpu(self, key: str, value: float) -> PlacedBytes:
        self.cpu.append((key, value))
        return self


@dataclass(frozen=True)
class PricedTerms:
    """One method's terms that depend on the candidate (per rank; the memory model multiplies host
    terms by the ranks of a node). Every field defaults to "adds nothing"."""

    state_scale: dict[str, float] = field(default_factory=dict)
    """Factors by breakdown key for the trained states' terms when they are kept in another dtype than
    the fp32 the placement prices (bf16 adapters)."""
    frozen: PlacedBytes = field(default_factory=PlacedBytes)
    """Frozen weights beside the trained ones, added to the model states' terms."""
    own: PlacedBytes = field(default_factory=PlacedBytes)
    """Tensors of the method's own (masks, ...), under `MethodTerms.gpu_keys` / `cpu_keys`."""
    saved_bytes: float = 0.0
    """Bytes per token and block its model saves for backward beyond the full-training formula
    (planner/activations.py)."""
    before_activations: dict[str, float] = field(default_factory=dict)
    """Device bytes by key it holds at a moment before the step's activations and logits exist (a
    frozen base's FSDP2 forward start, a live reference's forward): the memory model adds what exceeds
    those."""
    load_bytes: float | None = None
    """Host bytes of a node while the weights load, when the method loads them its own way."""
    transfer_seconds: float = 0.0
    """Host-to-device seconds per step of its frozen weights, beyond the trained states' offload."""
    compute_seconds: float = 0.0
    """Device seconds per step its layers take beyond the model's FLOPs at the GPU's rate (QLoRA's
    4-bit linears: planner/constants.py QUANTIZED_LINEAR_SECONDS)."""
    exposed_communication_seconds: float = 0.0
    """Seconds per step of collectives it runs outside the training step's forward and backward, which
    its next phase waits for (sharded weights gathered for a phase of its own): added to the step time
    as they are, not overlapped with compute (planner/speed.py `shard_gather_seconds` prices a gather)."""


Pricing = Callable[["MethodTerms", HardwareProfile, Strategy, int, int], PricedTerms]
"""(the terms, hardware, strategy, seq_len, gradient accumulation) -> the terms of that candidate, where
(strategy, seq_len) is the micro-batch the trained model's forward sees (memory.forward_rows). It receives
the terms themselves: the search prices them with each placement of their auxiliary models in turn
(`auxiliary` replaced, search._with_models)."""


def _adds_nothing(terms: MethodTerms, hw: HardwareProfile, strategy: Strategy, seq_len: int,
                  accumulation: int) -> PricedTerms:
    return PricedTerms()


@dataclass(frozen=True)
class MethodTerms:
    """One active method's part of one plan. The defaults are full training's: a method sets what it
    changes."""

    trained: ModelShape | None = None
    """The model whose weights train (gradients, optimizer states, offloaded states): LoRA's adapters;
    None: the model itself."""
    freezes_base: bool = False
    """The base weights are frozen (no gradient: a frozen input embedding may stay in host memory)."""
    chunks_loss: bool = True
    """Its objective can take the causal-LM loss in chunks (planner/knobs.py); False where it needs the
    whole logits."""
    splits_sequence: bool = True
    """Its objective takes one rank's slice of each sequence (sequence parallelism, planner/long_context.py);
    False where it brings its own objective over whole sequences."""
    find_longest_seq_len: bool = False
    """The search bisects the longest train.seq_len that fits, and the plan's notes name it."""
    sample_rows: int = 1
    """Sequences one sample is (a preference record: its two); the activations, logits and compute are
    those of the micro-batch the trained model's forward sees (memory.forward_rows)."""
    packed_rows: bool = False
    """A sample's sequences share one row of sample_rows x seq_len (packed), else sample_rows rows each."""
    shardings: frozenset[tuple[str, int, str, str]] | None = None
    """(backend, zero_stage, offload_optimizer, offload_params) it is verified to train under (the others
    are not planned); None: every one."""
    offloaded_last: bool = False
    """A fitting candidate that offloads states ranks after every fitting one that does not (not yet run
    on a GPU)."""
    no_recompute: Problem | None = None
    """Why its model has nothing to recompute (your own module without repeated blocks): activation
    checkpointing is planned off, and refused with this where it is pinned on."""
    auxiliary: tuple[AuxiliaryModel, ...] = ()
    """The frozen models it runs beside the trained one, at their configured placements."""
    gpu_keys: tuple[str, ...] = ()
    """Device terms of its own that it adds to the breakdown (`PricedTerms.own`, `before_activations`),
    besides its auxiliary models'."""
    cpu_keys: tuple[str, ...] = ()
    """Host terms of its own (`PricedTerms.own`), besides its auxiliary models'."""
    problems: tuple[Problem, ...] = ()
    """Its settings this hardware cannot run (a placement that needs several ranks, or a GPU), reported
    with the strategy pins' contradictions."""
    priced: Pricing = _adds_nothing
    """Its terms for one candidate (see `Pricing`)."""


def trains_under(method: MethodTerms, sharding: Sharding) -> bool:
    """Whether the method is verified to train under `sharding` (`MethodTerms.shardings`)."""
    return method.shardings is None or (sharding.backend, sharding.zero_stage, sharding.offload_optimizer,
                                        sharding.offload_params) in method.shardings


MethodReport = tuple[list[str], dict[str, Any]]
"""What one training method says about a plan (Method.report): the lines `orchestrate plan` prints, the
keys `--json` adds (planner/report.py)."""


@dataclass(frozen=True)
class Alternative:
    """A remedy a method offers: `config` trains with it; `where` and `fix` are the Problem's, `what`
    says what it changes ("with {what}, <the plan> fits")."""

    where: str
    what: str
    fix: str
    config: RunConfig
