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

At plan time a method contributes a value: `terms` returns its `MethodTerms` (orchestrate/planner/terms.py:
what it adds to the memory and speed models and what it restricts in the search, plain fields but for one
function of the candidate), computed once per plan by orchestrate/planning.py and handed to the planner,
which never calls a method. Everything here is pure: no torch, no I/O (except `auxiliary_shapes`, which
reads an auxiliary model's config.json on the launcher before planning).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from orchestrate.config.schema import RunConfig
from orchestrate.errors import Problem
from orchestrate.hardware.profile import HardwareProfile
from orchestrate.model.shape import ModelShape
from orchestrate.planner.plan import PlanResult, RunPlan
from orchestrate.planner.terms import Alternative, MethodReport, MethodTerms


@dataclass(frozen=True)
class SimulatedPhase:
    """What a method runs on the model before each training micro-batch of a step (GRPO's rollout), for
    `plan --simulate` to run too: the harness (orchestrate/simulate/harness.py) calls `function`
    ("module:function") with the wrapped model and `settings` (JSON), on fake tensors, once per
    micro-batch at the step's start, under the counter phase `name`, and keeps what it returns until the
    step ends, as the method keeps it."""

    name: str
    function: str
    settings: dict[str, Any] = field(default_factory=dict)


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
    record_format: ClassVar[str | None] = None
    """The record format (data/records.py) its own records are rendered as, for `orchestrate chat` to
    render a prompt the way the run did (`uses_chat_template`); None: detected from the data's columns."""
    saves: ClassVar[tuple[str, ...]] = ()
    """What it writes into the run directory besides model/ (run/layout.py names)."""
    trains_adapters: ClassVar[bool] = False
    """It trains adapters on a frozen base: its checkpoints hold the adapters only (`orchestrate export
    --merge` merges them into the re-read base), and the base is built from the initial weights' files
    even where a backend could build a model from its config alone (Backend.reads_weights)."""
    metric_keys: ClassVar[tuple[str, ...]] = ()
    """The prefixes of the metrics.jsonl keys its step callback adds: trackers log `key` as train/<key>
    and `eval_<key>` as eval/<key> (worker/scalars.py)."""

    def active(self, config: RunConfig) -> bool:
        """Whether the config asks for it (a base method: whether it is the run's base)."""
        raise NotImplementedError

    def record_noun(self, config: RunConfig) -> str | None:
        """What one of its training samples is, plural, where it brings records or data of its own (the
        worker's start-up line: "N train / M validation <noun>"); None: the token pipeline's samples."""
        return None

    def auxiliary_shapes(self, config: RunConfig, shape: ModelShape) -> dict[str, ModelShape]:
        """The shapes of its auxiliary models, read (config.json, never weights) on the launcher
        before planning; a UserError for one that cannot serve (another vocabulary, ...). Apart from
        `terms` because it reads files: a re-plan and a test hand `terms` the shapes instead."""
        return {}

    def terms(self, config: RunConfig, shape: ModelShape, hw: HardwareProfile,
              auxiliary: dict[str, ModelShape]) -> MethodTerms:
        """Its part of the plan (planner/terms.py), with `auxiliary` the shapes `auxiliary_shapes` read
        (a model missing there is planned without); a UserError listing every problem of its settings
        for this model (the composition's included)."""
        return MethodTerms()

    def alternatives(self, config: RunConfig) -> list[Alternative]:
        """Configs with this method for a plan that does not fit: the remedies the planner tries by
        re-planning (planner/remedies.py). A hook, not a term: it is asked of the methods a config does
        not use."""
        return []

    def simulation_refusal(self, config: RunConfig) -> Problem | None:
        """Why `plan --simulate` (fake tensors, orchestrate/simulate) cannot run it; None: it can. Asked of
        a written plan, which holds no terms."""
        return None

    def simulated_phase(self, plan: RunPlan) -> SimulatedPhase | None:
        """The phase before the training micro-batches `plan --simulate` runs for it (`SimulatedPhase`);
        None: its step is the causal-LM step the simulation trains. Asked of a written plan."""
        return None

    def report(self, plan: PlanResult) -> MethodReport:
        """What `orchestrate plan` prints about it (lines) and adds to --json (keys)."""
        return [], {}

    def run_summary(self, config: RunConfig, records: list[dict[str, Any]]) -> list[str]:
        """Its lines in `orchestrate report`'s summary of a finished run (report/summary.py): the metrics of
        its own (`metric_keys`), which only it can word."""
        return []
