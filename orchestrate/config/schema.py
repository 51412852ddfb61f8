"""The model.yaml schema: `RunConfig`, one pydantic model per section (each in its own file: model.py,
data.py, train.py, strategy.py; a method's own section in its folder, orchestrate/methods/), a
docstring per field, unknown keys rejected.

A file with only `model:` and `train: {seq_len, global_batch_size}` is valid for planning; the
`data` section is needed only to train. "auto" means "let the planner decide".
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from orchestrate.config.data import DataSection
from orchestrate.config.model import ModelSection
from orchestrate.config.section import Section
from orchestrate.config.strategy import StrategySection
from orchestrate.config.train import DEFAULT_OUTPUT_DIR, TrainSection
from orchestrate.methods.custom.config import check_custom_sections
from orchestrate.methods.distill.config import DistillSection
from orchestrate.methods.grpo.config import GrpoSection
from orchestrate.methods.preference.config import SEQUENCES_PER_RECORD, PreferenceSection
from orchestrate.methods.prune.config import PruneSection


class RunConfig(Section):
    """The whole model.yaml."""

    model: ModelSection
    """What to train."""

    train: TrainSection
    """How to train it."""

    data: DataSection = Field(default_factory=DataSection)
    """What to train on (not needed for planning)."""

    strategy: StrategySection = Field(default_factory=StrategySection)
    """How to distribute it; every field may stay "auto"."""

    prune: PruneSection | None = None
    """Prune while training (docs/pruning.md); null: no pruning."""
    distill: DistillSection | None = None
    """Knowledge distillation from a frozen teacher (orchestrate/methods/distill/config.py); null: none."""
    preference: PreferenceSection | None = None
    """Preference tuning: DPO, IPO, ORPO, KTO on preference records (docs/preference.md); null: none."""
    grpo: GrpoSection | None = Field(default=None, exclude_if=lambda section: section is None)
    """Online RL with GRPO: completions sampled and rewarded while training (docs/grpo.md); null: none
    (left out of a dumped config then: the plans of other runs read as before it existed)."""

    source_dir: Path | None = Field(default=None, exclude=True)
    """Directory of the YAML file, for resolving relative paths (set by the loader, not by the user)."""

    @property
    def sequences_per_sample(self) -> int:
        """Sequences one training sample is: a preference record's chosen and rejected (two), a GRPO
        prompt's completions (num_generations), else one."""
        if self.grpo is not None:
            return self.grpo.num_generations
        return SEQUENCES_PER_RECORD if self.preference is not None else 1

    @model_validator(mode="after")
    def _task_data(self) -> RunConfig:
        # Masked LM and classification see one document per sample (padding and truncation, an
        # attention mask), never a packed stream that would mix documents and their labels.
        if self.model.task != "causal-lm":
            if self.data.packing and "packing" in self.data.model_fields_set:
                raise ValueError(f"model.task {self.model.task} trains on single documents: set data.packing: false")
            if self.data.packing:
                self.data.packing = False
        if self.model.num_labels is not None and self.model.task != "sequence-classification":
            raise ValueError("model.num_labels is for model.task sequence-classification only")
        check_custom_sections(self)
        self._neftune_objective()
        return self

    def _neftune_objective(self) -> None:
        # NEFTune noises the trained model's embeddings in training forwards only: a preference or GRPO
        # loss would set noised log-probabilities against a noiseless reference / sampling policy.
        if self.train.neftune_noise_alpha is None:
            return
        if self.model.module is not None:
            raise ValueError("train.neftune_noise_alpha noises a Hugging Face model's input embeddings; "
                             "model.module has none: remove it")
        if self.preference is not None or self.grpo is not None:
            raise ValueError("train.neftune_noise_alpha is for supervised fine-tuning: preference: and grpo: "
                             "compare the model's log-probabilities with a noiseless reference; remove it")

    def output_root(self) -> Path:
        """train.output_dir resolved; unset (a config not loaded from a file): `runs` beside the source."""
        return self.resolve_path(self.train.output_dir or DEFAULT_OUTPUT_DIR)

    def resolve_path(self, p: str) -> Path:
        """Resolve a user path relative to the YAML file's directory."""
        path = Path(p).expanduser()
        if not path.is_absolute() and self.source_dir is not None:
            path = self.source_dir / path
        return path
