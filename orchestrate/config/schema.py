"""The model.yaml schema: one pydantic model per section, a docstring per field, unknown keys rejected.

A file with only `model:` and `train: {seq_len, global_batch_size}` is valid for planning; the
`data` section is needed only to train. "auto" means "let the planner decide".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from orchestrate.config.architecture import architecture_problems
from orchestrate.config.custom_module import (
    DataModuleFields,
    LossField,
    ModelModuleFields,
    WrapField,
    check_custom_sections,
)
from orchestrate.config.distill import DistillSection
from orchestrate.config.prune import PruneSection
from orchestrate.config.sections_base import MAX_COUNT, Auto, Section
from orchestrate.config.train_parts import LoraSection, OptimizerSection, QuantizationSection, ScheduleSection


class ModelSection(ModelModuleFields):  # + module, kwargs (custom_module.py)
    name_or_path: str | None = None
    """A local directory holding a transformers `config.json` (weights optional), or a Hub name
    when the network is available. Exactly one of `name_or_path` and `architecture` is required."""

    architecture: dict[str, Any] | None = None
    """An inline transformers config, e.g. `{model_type: llama, hidden_size: 2048, ...}`; the model
    is built from it with freshly initialised weights (pre-training)."""

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

    @model_validator(mode="after")
    def _exactly_one_source(self) -> ModelSection:
        if sum(v is not None for v in (self.name_or_path, self.architecture, self.module)) != 1:
            raise ValueError("give exactly one of `name_or_path`, `architecture` or `module`")
        if self.architecture is not None and "model_type" not in self.architecture:
            raise ValueError("`architecture` needs a `model_type` key (gpt2, llama, mistral, qwen2, phi3, ...)")
        if self.architecture is not None and (problems := architecture_problems(self.architecture)):
            raise ValueError("; ".join(problems))
        return self


class DataSection(DataModuleFields):  # + module, kwargs (custom_module.py)
    train_files: list[str] = Field(default_factory=list)
    """Local training data: files, directories or glob patterns, in any format `datasets.load_dataset`
    reads locally: text (.txt), JSON / JSON-lines (.json, .jsonl), CSV (.csv, .tsv), Parquet
    (.parquet), Arrow (.arrow), optionally compressed (.gz, .zst, ...), or a directory written by
    `Dataset.save_to_disk`. Relative paths are resolved against the directory of the YAML file."""

    dataset: str | None = None
    """Instead of `train_files`: a name or path passed unchanged to `datasets.load_dataset` (a Hub
    dataset such as "roneneldan/TinyStories" when the network is available, or a local dataset directory)."""

    dataset_config: str | None = None
    """The configuration (`name=`) of `dataset`, e.g. "wikitext-103-raw-v1"."""

    split: str = "train"
    """The split of `dataset` (or of a `save_to_disk` DatasetDict directory) to train on."""

    validation_files: list[str] = Field(default_factory=list)
    """Files for the periodic evaluation loss (same formats as `train_files`); with neither these nor
    `validation_split`, `validation_ratio` of the training blocks is held out."""

    validation_split: str | None = None
    """A split of `dataset` (or of a DatasetDict directory) to evaluate on, e.g. "validation"."""

    validation_ratio: float = Field(default=0.05, ge=0.0, lt=1.0)
    """Share of the training blocks (documents, when packing is off) held out for evaluation when no
    validation data is given; chosen by a permutation seeded with `train.seed`."""

    format: Literal["auto", "text", "json", "csv", "parquet", "arrow"] = "auto"
    """The `datasets` builder for `train_files` and `validation_files`; "auto" picks it per file from
    the extension."""

    text_field: str = "text"
    """The column (JSON key, CSV header) holding each document's text."""

    template: str | None = None
    """Instead of `text_field`: a Python format string over the record's columns that makes one
    document, e.g. "### Question:\\n{prompt}\\n### Answer:\\n{response}" (the loss covers all of it)."""

    label_field: str = "label"
    """model.task sequence-classification: the column holding each document's label (integers or
    strings). The label names are its distinct values, sorted; they go into the saved config.json as
    `id2label` / `label2id`."""

    text_unit: Literal["paragraph", "line", "file"] = "paragraph"
    """What one document is in a .txt file: a paragraph (text between blank lines), a line, or the whole file."""

    packing: bool = True
    """Join documents with the EOS id and cut the stream into `train.seq_len` blocks (no padding). If
    false, every document is one sample, truncated to `seq_len` and padded, with an attention mask and
    padded positions left out of the loss."""

    tokenizer: str | None = None
    """A local Hugging Face tokenizer directory; null uses the built-in byte-level tokenizer
    (256 byte ids plus an end-of-document id), enough for demos and tests. `orchestrate tokenizer
    train` makes one from this section's corpus."""

    cache_dir: str | None = None
    """Where tokenised data is kept, shared by every run (keyed by a fingerprint of the sources,
    tokenizer and settings); null means `<train.output_dir>/data_cache`. Relative paths are resolved
    against the YAML file's directory."""

    num_proc: int | Auto = "auto"
    """Processes that tokenise in parallel (`datasets.map(num_proc=...)`); "auto" uses one per CPU core
    for corpora above 64 MiB and one process below (where start-up would cost more than it saves)."""

    generate_demo_corpus: bool = False
    """If true and there are no `train_files` or `dataset`, generate a small deterministic English-like
    corpus in the run directory (used by the demo and tests: no downloads)."""

    @field_validator("num_proc")
    @classmethod
    def _positive_num_proc(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 1:
            raise ValueError("num_proc must be a positive integer or auto")
        return v

    @model_validator(mode="after")
    def _one_source(self) -> DataSection:
        if self.train_files and self.dataset is not None:
            raise ValueError("give `train_files` or `dataset`, not both")
        if self.validation_files and self.validation_split is not None:
            raise ValueError("give `validation_files` or `validation_split`, not both")
        return self


class TrainSection(LossField):  # + loss (custom_module.py)
    seq_len: int = Field(gt=0, le=MAX_COUNT)
    """Tokens per sample (packed block length)."""

    global_batch_size: int = Field(gt=0, le=MAX_COUNT)
    """Samples per optimizer step over all ranks: micro_batch_size x grad accumulation x world size."""

    micro_batch_size: int | Auto = "auto"
    """Samples per rank per forward pass; "auto" lets the planner pick the largest that fits and divides."""

    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    """Training precision; "auto" is bf16 where the GPU supports it (Ampere and newer), fp16 with
    dynamic loss scaling on Turing, fp32 on CPU-only machines."""

    activation_checkpointing: bool | Auto = "auto"
    """Recompute each block's activations in backward (costs about one extra forward pass)."""

    loss_chunks: int | Auto = "auto"
    """causal-lm: run the LM head + cross-entropy in N chunks over the sequence, each recomputed in
    backward, so the full logits never exist; 0: one pass; "auto": the planner's choice (docs/memory-knobs.md)."""

    activation_offload: bool | Auto = "auto"
    """GPU, with activation checkpointing: keep each checkpointed block's input in pinned CPU memory
    until backward (torch save_on_cpu); "auto": the planner's choice (docs/memory-knobs.md)."""

    embedding_offload: bool | Auto = "auto"
    """GPU, DDP, method lora/qlora, untied embedding: keep the frozen input embedding in host memory (its
    lookup runs there, only the rows go to the GPU); "auto": the planner's choice (docs/memory-knobs.md)."""

    method: Literal["full", "lora", "qlora", "auto"] = "full"
    """full: train every weight. lora: freeze the base, train low-rank adapters on its linear layers
    (peft). qlora: the same on a base stored in 4-bit NF4 (bitsandbytes). auto: the first of full,
    lora, qlora that fits (the plan says which and why)."""

    lora: LoraSection = Field(default_factory=LoraSection)
    """Adapter settings of `method: lora | qlora`."""

    quantization: QuantizationSection = Field(default_factory=QuantizationSection)
    """How `method: qlora` stores the frozen base."""

    optimizer: OptimizerSection = Field(default_factory=OptimizerSection)
    """Optimizer settings."""

    schedule: ScheduleSection = Field(default_factory=ScheduleSection)
    """Learning-rate schedule: linear warm-up then cosine decay."""

    max_steps: int = Field(default=100, gt=0, le=MAX_COUNT)
    """Optimizer steps to train."""

    grad_clip: float = Field(default=1.0, ge=0)
    """Clip the global gradient norm to this value; 0 disables clipping."""

    seed: int = Field(default=0, ge=0, le=2**32 - 1)
    """Seed for weights, data order and dropout; the same seed reproduces the same losses (0 to 2**32-1,
    the range numpy's seeding accepts)."""

    output_dir: str = "runs"
    """Where run directories are created (relative to the YAML file's directory)."""

    @field_validator("micro_batch_size")
    @classmethod
    def _positive_micro_batch(cls, v: int | str) -> int | str:
        if isinstance(v, int) and not 0 < v <= MAX_COUNT:
            raise ValueError("micro_batch_size must be a positive integer or auto")
        return v

    @field_validator("loss_chunks")
    @classmethod
    def _loss_chunks_range(cls, v: int | str) -> int | str:
        if isinstance(v, int) and not 0 <= v <= MAX_COUNT:
            raise ValueError("loss_chunks must be 0 (no chunking), a positive integer or auto")
        return v

    @field_validator("method")
    @classmethod
    def _adapter_libraries(cls, v: str) -> str:
        from orchestrate.config.finetune_deps import check_method_libraries

        return check_method_libraries(v)  # a missing library fails at plan time, not inside the worker

    eval_every: int = Field(default=0, ge=0, le=MAX_COUNT)
    """Evaluate every N steps (0: only at the end)."""

    eval_batches: int = Field(default=4, gt=0, le=MAX_COUNT)
    """Micro-batches per evaluation."""

    checkpoint_every: int = Field(default=0, ge=0, le=MAX_COUNT)
    """Write a resumable checkpoint every N steps (0: only at the end)."""

    keep_checkpoints: int = Field(default=2, gt=0, le=MAX_COUNT)
    """How many of the latest checkpoints to keep."""

    preemption_grace_s: int = Field(default=120, gt=0, le=7 * 24 * 3600)
    """Seconds between SIGTERM/SIGUSR1 (preemption, time limit) and the kill. The workers finish the
    current step and checkpoint when the last checkpoint's write time says it fits, else exit at once
    (the previous checkpoint stays); `orchestrate launch` gives torchrun this long before SIGKILL.
    Match it to SLURM's `--signal` lead time."""

    report_to: list[Literal["tensorboard", "wandb", "mlflow", "none"]] = Field(
        default_factory=lambda: ["tensorboard"])
    """Experiment trackers rank 0 logs every step to, under the run directory: tensorboard (RUN_DIR/tb),
    wandb (offline, RUN_DIR/wandb), mlflow (local file store, RUN_DIR/mlruns); ["none"] for none."""

    @field_validator("report_to")
    @classmethod
    def _trackers_installed(cls, v: list[str]) -> list[str]:
        from orchestrate.worker.tracker_deps import check_trackers

        return check_trackers(v)  # a missing library fails here, at plan time, not inside the worker


class StrategySection(WrapField):  # + wrap (custom_module.py)
    backend: Literal["auto", "deepspeed", "fsdp", "ddp"] = "auto"
    """Distributed backend; "auto" lets the planner choose."""

    zero_stage: int | Auto = "auto"
    """ZeRO stage 0-3 (for fsdp: 3 = full shard, 2 = shard grads and optimizer only)."""

    offload: Literal["auto", "none", "cpu", "nvme"] = "auto"
    """Where optimizer states live when not on the GPU."""

    offload_params: bool | Auto = "auto"
    """Also offload parameters (ZeRO-3 / FSDP full shard only) to the `offload` target."""

    nvme_path: str | None = None
    """Directory on a fast NVMe disk for NVMe offload (needed when offload is "nvme")."""

    gpu_memory_headroom: float = Field(default=0.90, gt=0.1, le=1.0)
    """Fraction of each GPU's memory the plan may use; the rest absorbs allocator fragmentation
    and what the model cannot see."""

    cpu_memory_headroom: float = Field(default=0.85, gt=0.1, le=1.0)
    """Fraction of each node's CPU RAM the plan may use (the OS, page cache and data loaders need the rest)."""

    @field_validator("zero_stage")
    @classmethod
    def _stage_range(cls, v: int | str) -> int | str:
        if isinstance(v, int) and not 0 <= v <= 3:
            raise ValueError("zero_stage must be 0, 1, 2, 3 or auto")
        return v


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
    """Knowledge distillation from a frozen teacher (orchestrate/config/distill.py); null: none."""

    source_dir: Path | None = Field(default=None, exclude=True)
    """Directory of the YAML file, for resolving relative paths (set by the loader, not by the user)."""

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
        return self

    def resolve_path(self, p: str) -> Path:
        """Resolve a user path relative to the YAML file's directory."""
        path = Path(p).expanduser()
        if not path.is_absolute() and self.source_dir is not None:
            path = self.source_dir / path
        return path
