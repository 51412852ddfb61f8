"""What a training method is: one `Method` (plan time, pure) and one `MethodRuntime` (the worker's
half, imported lazily by the registry), in the spirit of torchtitan's `TrainSpec` /
`register_train_spec` (a named bundle of the builders a training run needs) and torchtune's recipes
(one recipe per method: full, LoRA, knowledge distillation, LoRA DPO).

Composition (the rule every method states by its `base` / `bases` / `objective` fields):
- Every run has exactly one *base* method: it builds the model and decides which weights train —
  `full` (every weight), `lora` (adapters on a frozen, optionally 4-bit base; `train.method: lora |
  qlora`), `custom` (your own nn.Module, every weight). `orchestrate.methods.registry.base_method`
  picks it from the config.
- Any number of *add-on* methods join it when their section is set: `distill`, `preference`,
  `prune`. An add-on names the base methods it composes with (`bases`; distill: full and lora, so QLoRA + distillation
  trains; prune: full only, so LoRA + pruning is refused, as is either with your own module).
- At most one active method supplies the training objective (`objective=True`: distill,
  preference); the others train the task's objective.
- Hooks run in registry order (full, lora, distill, preference, prune, custom), each method's terms added
  after the ones before it; a method never edits another's terms, it returns its own.

Plan-time hooks return *named terms*: `MethodTerms` (one per active method and plan) gives the
memory model what the method adds (a frozen base, its masks, its auxiliary models), the speed model
its seconds, and the search what it restricts. Everything here is pure: no torch, no I/O (except
`auxiliary_shapes`, which reads an auxiliary model's config.json on the launcher before planning).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from orchestrate.config.schema import RunConfig
from orchestrate.errors import Problem
from orchestrate.hardware.profile import HardwareProfile
from orchestrate.hardware.software import SoftwareStack
from orchestrate.methods.auxiliary import AuxiliaryModel
from orchestrate.model.shape import ModelShape
from orchestrate.planner.strategy import Sharding, Strategy

if TYPE_CHECKING:
    from orchestrate.planner.plan import RunPlan


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


class MethodTerms:
    """One active method's part of one plan: no-ops, overridden where the method changes something.
    The memory model calls them in this order: `trained_shape` (what has gradients and optimizer
    states), `state_scale` (their dtype), `frozen_bytes` (frozen weights beside them), the auxiliary
    models (`auxiliary`), `own_bytes` (the method's own tensors), `forward_rows` (the micro-batch the
    forward sees), `saved_bytes` (what it saves for backward), then, with the training peak known,
    `peak_bytes` and `load_bytes`."""

    gpu_keys: tuple[str, ...] = ()
    """Device terms of its own that it adds to the breakdown (`own_bytes`, `peak_bytes`), besides its
    auxiliary models'."""
    cpu_keys: tuple[str, ...] = ()
    freezes_base: bool = False
    """The base weights are frozen (no gradient: a frozen input embedding may stay in host memory)."""
    chunks_loss: bool = True
    """Its objective can take the causal-LM loss in chunks (planner/knobs.py); False where it needs the
    whole logits."""
    splits_sequence: bool = True
    """Its objective takes one rank's slice of each sequence (sequence parallelism, planner/long_context.py);
    False where it brings its own objective over whole sequences."""
    names_longest_seq_len: bool = False
    """The plan's notes name the longest train.seq_len that fits (the search bisects it)."""

    # the search
    def trains_under(self, sharding: Sharding) -> bool:
        """Whether this method is verified to train under `sharding` (the others are not planned)."""
        return True

    def ranks_last(self, strategy: Strategy) -> bool:
        """A fitting candidate ranked after every fitting one without this (not yet run on a GPU)."""
        return False

    def recompute_options(self, pinned: bool | str) -> list[bool] | None:
        """The activation-checkpointing settings to try; None: the planner's default."""
        return None

    def auxiliary(self) -> list[AuxiliaryModel]:
        """The frozen models it runs beside the trained one, at their configured placements."""
        return []

    def with_auxiliary(self, models: list[AuxiliaryModel]) -> MethodTerms:
        """These terms with `models` (one placement each, out of `AuxiliaryModel.choices`) instead."""
        return self

    # memory and speed (per rank; the memory model multiplies host terms by the ranks of a node)
    def forward_rows(self, strategy: Strategy, seq_len: int) -> tuple[Strategy, int]:
        """(strategy, seq_len) whose micro-batch the trained model's forward sees, when a sample is
        more than one sequence (a preference pair: two); the activations, logits and compute are
        those of it."""
        return strategy, seq_len

    def trained_shape(self, shape: ModelShape) -> ModelShape:
        """The model whose weights train (gradients, optimizer states, offloaded states)."""
        return shape

    def state_scale(self, strategy: Strategy) -> dict[str, float]:
        """Factors by breakdown key for the trained states' terms when they are kept in another dtype
        than the fp32 the placement prices (bf16 adapters); {}: as priced."""
        return {}

    def frozen_bytes(self, shape: ModelShape, hw: HardwareProfile, strategy: Strategy) -> PlacedBytes:
        """Frozen weights beside the trained ones, added to the model states' terms."""
        return PlacedBytes()

    def own_bytes(self, shape: ModelShape, hw: HardwareProfile, strategy: Strategy) -> PlacedBytes:
        """Tensors of the method's own (masks, ...), under `gpu_keys` / `cpu_keys`."""
        return PlacedBytes()

    def saved_bytes(self, shape: ModelShape, c: int, sw: SoftwareStack) -> float:
        """Bytes per token and block its model saves for backward beyond the full-training formula
        (planner/activations.py), with compute dtype of `c` bytes and the library versions `sw`."""
        return 0.0

    def peak_bytes(self, shape: ModelShape, strategy: Strategy, seq_len: int,
                   activations_and_logits: float) -> dict[str, float]:
        """What the method adds at a peak the training peak does not cover (device, per rank)."""
        return {}

    def load_bytes(self, shape: ModelShape, hw: HardwareProfile, strategy: Strategy) -> float | None:
        """Host bytes of a node while the weights load, when the method loads them its own way."""
        return None

    # speed
    def transfer_seconds(self, shape: ModelShape, hw: HardwareProfile, strategy: Strategy,
                         accumulation: int) -> float:
        """Host-to-device seconds per step of its frozen weights, beyond the trained states' offload."""
        return 0.0

    def compute_seconds(self, shape: ModelShape, hw: HardwareProfile, strategy: Strategy,
                        accumulation: int) -> float:
        """Device seconds per step its layers take beyond the model's FLOPs at the GPU's rate (QLoRA's
        4-bit linears: planner/constants.py QUANTIZED_LINEAR_SECONDS)."""
        return 0.0


@dataclass(frozen=True)
class Alternative:
    """A remedy a method offers: `config` trains with it; `where` and `fix` are the Problem's, `what`
    says what it changes ("with {what}, <the plan> fits")."""

    where: str
    what: str
    fix: str
    config: RunConfig


class Method:
    """A training method's spec (plan time). Subclasses override what their method does."""

    name: ClassVar[str]
    base: ClassVar[bool] = False
    """A base method: builds the model and decides what trains (one per run)."""
    bases: ClassVar[tuple[str, ...]] = ()
    """An add-on: the base methods it composes with."""
    objective: ClassVar[bool] = False
    """It supplies the training objective (at most one active method does)."""
    runtime: ClassVar[str | None] = None
    """The module of its worker half (`MethodRuntime` as `RUNTIME`), imported on the worker only."""
    data: ClassVar[str | None] = None
    """The module of its part of the data path (`data_path(config)`, orchestrate/data/method_data.py:
    records of its own, or data it brings itself), imported where the data is checked or prepared."""
    saves: ClassVar[tuple[str, ...]] = ()
    """What it writes into the run directory besides model/ (run/layout.py names)."""
    trains_adapters: ClassVar[bool] = False
    """It trains adapters on a frozen base: its checkpoints hold the adapters only (`orchestrate export
    --merge` merges them into the re-read base), and the base is built from the initial weights' files
    even where a backend could build a model from its config alone (Backend.reads_weights)."""

    def active(self, config: RunConfig) -> bool:
        """Whether the config asks for it (a base method: whether it is the run's base)."""
        raise NotImplementedError

    def auxiliary_shapes(self, config: RunConfig, shape: ModelShape) -> dict[str, ModelShape]:
        """The shapes of its auxiliary models, read (config.json, never weights) on the launcher
        before planning; a UserError for one that cannot serve (another vocabulary, ...)."""
        return {}

    def check(self, config: RunConfig, shape: ModelShape) -> None:
        """UserError listing every problem of its settings for this model (the composition's included)."""

    def hardware_problems(self, config: RunConfig, hw: HardwareProfile) -> list[Problem]:
        """Its settings this hardware cannot run (a placement that needs several ranks, or a GPU),
        listed with the strategy pins' contradictions."""
        return []

    def terms(self, config: RunConfig, shape: ModelShape, auxiliary: dict[str, ModelShape]) -> MethodTerms:
        """Its part of the plan's memory and speed model (after `check`)."""
        return MethodTerms()

    def alternatives(self, config: RunConfig) -> list[Alternative]:
        """Configs with this method for a plan that does not fit: the remedies the planner tries by
        re-planning (planner/remedies.py)."""
        return []

    def simulation_refusal(self, config: RunConfig) -> Problem | None:
        """Why `plan --simulate` (fake tensors, orchestrate/simulate) cannot run it; None: it can."""
        return None

    def report(self, plan: RunPlan | Any) -> tuple[list[str], dict[str, Any]]:
        """What `orchestrate plan` prints about it (lines) and adds to --json (keys)."""
        return [], {}

    metric_keys: ClassVar[tuple[str, ...]] = ()
    """The prefixes of the metrics.jsonl keys its step callback adds: trackers log `key` as train/<key>
    and `eval_<key>` as eval/<key> (worker/scalars.py)."""

    def run_summary(self, config: RunConfig, records: list[dict[str, Any]]) -> list[str]:
        """Its lines in `orchestrate report`'s summary of a finished run (report/summary.py)."""
        return []
