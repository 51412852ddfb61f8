"""The `model:` section: what to train (a Hugging Face model directory, an inline architecture, or
your own nn.Module) and for which task."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from orchestrate.config.architecture import architecture_problems
from orchestrate.config.section import MAX_COUNT, Section
from orchestrate.methods.custom.config import ExampleTensor, check_module_path

TRUST_SWITCH = "model.trust_remote_code"
"""The one opt-in that lets code named by a config run (docs/security.md)."""


class ModelSection(Section):
    module: str | None = None
    """Your own nn.Module instead of a Hugging Face model: "package.module:ClassOrFactory", called
    with `kwargs`. Exactly one of `name_or_path`, `architecture` and `module`."""

    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of `module` (plain YAML values); part of the activation cache fingerprint."""

    example_input: dict[str, ExampleTensor] | None = None
    """Your own training loop (`launch -- python train.py`) brings its own data, so there is no
    data.module to measure the activations on: one sample's inputs by forward's argument name,
    e.g. {x: [16]} or {tokens: {shape: [128], dtype: int64}}. Fake tensors of these shapes (batch
    dimension added, 1 and 2 samples) run forward and backward; a `labels` entry makes the loss `train.loss`'s,
    without one it is the sum of the output (docs/own-loop.md)."""

    name_or_path: str | None = None
    """A local directory holding a transformers `config.json` (weights optional), or a Hub name
    when the network is available. Exactly one of `name_or_path` and `architecture` is required."""

    architecture: dict[str, Any] | None = None
    """An inline transformers config, e.g. `{model_type: llama, hidden_size: 2048, ...}`; the model
    is built from it with freshly initialised weights (pre-training). `bos_token_id`, `eos_token_id`
    and `pad_token_id` left out are the run's tokenizer's (the byte tokenizer: 256 as BOS and EOS),
    not the family's defaults, in the model and the config.json / generation_config.json it is
    saved with."""

    task: Literal["causal-lm", "masked-lm", "sequence-classification"] = "causal-lm"
    """What the model learns: next-token prediction (causal-lm, AutoModelForCausalLM), BERT-style
    masked tokens (masked-lm, AutoModelForMaskedLM: 15 % of tokens masked, 80/10/10) or one label per
    document (sequence-classification, AutoModelForSequenceClassification, labels from
    `data.label_field`). The last two train on padded documents (`data.packing: false`)."""

    num_labels: int | None = Field(default=None, gt=1, le=MAX_COUNT)
    """sequence-classification only: the number of classes. Null takes it from the data (the distinct
    values of `data.label_field`); when given it must agree with the data."""

    trust_remote_code: bool = False
    """The one switch that lets code named by the config run: `model.module` / `data.module` (imported
    and called by `plan`, `config`, `launch` and the workers) and the `auto_map` code of a model or
    tokenizer directory. Off by default: such code can do anything you can (docs/security.md)."""

    @field_validator("module")
    @classmethod
    def _module_path(cls, v: str | None) -> str | None:
        return check_module_path(v)

    @model_validator(mode="after")
    def _exactly_one_source(self) -> ModelSection:
        if sum(v is not None for v in (self.name_or_path, self.architecture, self.module)) != 1:
            raise ValueError("give exactly one of `name_or_path`, `architecture` or `module`")
        if self.architecture is not None and "model_type" not in self.architecture:
            raise ValueError("`architecture` needs a `model_type` key (gpt2, llama, mistral, qwen2, phi3, ...)")
        if self.architecture is not None and (problems := architecture_problems(self.architecture)):
            raise ValueError("; ".join(problems))
        return self
