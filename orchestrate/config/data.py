"""The `data:` section: what to train on (files, a dataset, or your own dataset factory) and how it
becomes samples: plain text, or chat and instruction records (their columns, roles, chat template,
which tokens carry the loss, what happens to samples longer than seq_len; docs/sft.md)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from orchestrate.config.section import MAX_COUNT, Auto, Section
from orchestrate.methods.custom.config import check_module_path

RecordFormat = Literal["auto", "text", "chat", "prompt-completion", "alpaca", "preference", "unpaired-preference"]
Role = Literal["system", "user", "assistant", "tool"]
Truncation = Literal["keep_answer", "keep_start", "drop", "error"]
OLD_TRUNCATION_NAMES: dict[str, str] = {"truncate": "keep_start"}
"""Names `data.truncation` had before keep_answer became the default, still accepted."""
ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")

SHAREGPT_ROLES: dict[str, str] = {"human": "user", "gpt": "assistant", "model": "assistant",
                                  "observation": "tool", "function_call": "assistant"}
"""Role names of ShareGPT-style data (`from` values; LLaMA-Factory's sharegpt format adds observation and
function_call) and Gemma's `model`, mapped onto the chat roles."""


class Columns(Section):
    """The data's column (and message key) names, where they differ from the defaults."""

    messages: str = "messages"
    """Chat records: the column holding each conversation's list of messages (ShareGPT: conversations)."""
    role: str | None = None
    """The message key naming the speaker; null: `role`, else `from` (ShareGPT)."""
    content: str | None = None
    """The message key holding the text; null: `content`, else `value` (ShareGPT)."""
    prompt: str = "prompt"
    """prompt-completion records: the prompt column."""
    completion: str = "completion"
    """prompt-completion records: the answer column."""
    instruction: str = "instruction"
    """Alpaca records: the instruction column."""
    input: str = "input"
    """Alpaca records: the optional input column (left out of the prompt when missing or blank)."""
    output: str = "output"
    """Alpaca records: the answer column."""
    chosen: str = "chosen"
    """Preference records: the preferred answer (text, or a list of messages)."""
    rejected: str = "rejected"
    """Preference records: the dispreferred answer."""
    label: str = "label"
    """Unpaired preference records (KTO): whether `completion` is desirable (true / false)."""
    system: str = "system"
    """Chat, prompt-completion and Alpaca records: the optional column holding a record's system prompt
    (LLaMA-Factory's `system` column of its alpaca and sharegpt formats, data/README.md), which becomes
    its first turn (docs/sft.md "System prompts")."""


class DatasetSource(Section):
    """One entry of `data.datasets`: where its records are, how they read, and how many the mix takes.
    The keys follow Axolotl's `datasets:` list (path, name, split) and LLaMA-Factory's dataset_info.json
    (per-dataset `columns`; its `num_samples` is `samples` here)."""

    path: str
    """A file, directory or glob pattern (relative to the YAML file's directory), a `save_to_disk`
    directory, or a dataset name passed to `datasets.load_dataset` (e.g. "tatsu-lab/alpaca": a name is
    one or two words joined by "/", without a data file's extension)."""

    name: str | None = None
    """The configuration of a dataset name (`load_dataset(path, name)`; Axolotl's `name`)."""

    split: str = "train"
    """The split of a dataset name or of a `save_to_disk` DatasetDict directory."""

    record_format: RecordFormat | None = None
    """This source's record format; null: `data.record_format` (auto: detected from this source's own
    columns, whatever the other sources hold)."""

    columns: Columns | None = None
    """This source's column names, over `data.columns` (the keys given here replace those), e.g.
    {messages: conversations, role: from, content: value} for ShareGPT."""

    system_prompt: str | None = None
    """This source's default system prompt, instead of `data.system_prompt`; "" gives this source none."""

    weight: float | None = Field(default=None, gt=0)
    """This source's share of the mixed stream, relative to the other sources' weights (docs/sft.md
    "Several datasets"). Give every source without `samples` a weight, or none (every record of each)."""

    samples: int | None = Field(default=None, ge=1, le=MAX_COUNT)
    """Exactly this many records of this source, chosen by `train.seed`: without replacement when the
    source holds as many, else every record as many whole times as fit and the rest without replacement."""

    @model_validator(mode="after")
    def _one_amount(self) -> DatasetSource:
        if self.weight is not None and self.samples is not None:
            raise ValueError("give `weight` (a share of the mix) or `samples` (an exact count), not both")
        return self


class DataSection(Section):
    module: str | None = None
    """With `model.module`: "package.module:factory" returning a torch Dataset (map-style: `len` and
    `[i]`) of dicts (keys = the model's keyword arguments, `labels` the target) or tuples (inputs...,
    label). `validation_ratio` of it is held out for evaluation."""

    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of `data.module`."""

    train_files: list[str] = Field(default_factory=list)
    """Local training data: files, directories or glob patterns, in any format `datasets.load_dataset`
    reads locally: text (.txt), JSON / JSON-lines (.json, .jsonl), CSV (.csv, .tsv), Parquet
    (.parquet), Arrow (.arrow), optionally compressed (.gz, .zst, ...), or a directory written by
    `Dataset.save_to_disk`. Relative paths are resolved against the directory of the YAML file."""

    datasets: list[DatasetSource] = Field(default_factory=list)
    """Instead of `train_files` / `dataset`: several sources, each read and detected on its own (files of
    other columns or formats load side by side), then mixed into one stream by `weight` or `samples`
    (docs/sft.md "Several datasets"). `train_files` is the one-source shorthand of this list."""

    stopping_strategy: Literal["first_exhausted", "all_exhausted"] = "first_exhausted"
    """`datasets` with weights: how large the mix is (the names of `datasets.interleave_datasets`).
    first_exhausted: the largest mix that takes no record twice (the source that is short for its share
    decides it); all_exhausted: the smallest mix that takes every record, repeating the records of the
    sources that are short for their share."""

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
    validation data is given; chosen by a permutation seeded with `train.seed`. 0: no evaluation."""

    format: Literal["auto", "text", "json", "csv", "parquet", "arrow"] = "auto"
    """The `datasets` builder for `train_files` and `validation_files`; "auto" picks it per file from
    the extension."""

    text_field: str = "text"
    """The column (JSON key, CSV header) holding each document's text."""

    template: str | None = None
    """Instead of `text_field`: plain `{column}` fields over the record's text columns and literal text
    that make one document, e.g. "### Question:\\n{prompt}\\n### Answer:\\n{response}" (the loss covers all
    of it; for the loss on the answers only use prompt-completion or chat records, docs/sft.md)."""

    label_field: str = "label"
    """model.task sequence-classification: the column holding each document's label (integers or
    strings). The label names are its distinct values, sorted; they go into the saved config.json as
    `id2label` / `label2id`."""

    text_unit: Literal["paragraph", "line", "file"] = "paragraph"
    """What one document is in a .txt file: a paragraph (text between blank lines), a line, or the whole file."""

    packing: bool = True
    """Plain text: join documents with the EOS id and cut the stream into `train.seq_len` blocks (no
    padding). Chat and instruction records: whole samples fitted into blocks of seq_len, each attending
    only to itself (position ids restart per sample). Preference records: each micro-batch's records
    fitted whole into blocks of 2 x seq_len (a sample is still a record: train.global_batch_size counts
    pairs either way). If false, every document or sample is one row,
    truncated to `seq_len` and padded, with an attention mask and padded positions left out of the loss."""

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

    # Chat and instruction records (docs/sft.md): orchestrate/data/records.py, sft_tokens.py, sft_samples.py.
    record_format: RecordFormat = "auto"
    """What one record is. auto: detected from the columns: `chosen` + `rejected` is a preference pair
    and `prompt` + `completion` + `label` an unpaired preference (the `preference:` section trains on
    them, docs/preference.md), a `messages` list is chat, `prompt` + `completion` is prompt-completion,
    `instruction` + `output` is Alpaca, anything else plain text (`text_field` or `template`, the loss
    on every token, packed as one stream)."""

    columns: Columns = Field(default_factory=Columns)
    """Column and message-key names, e.g. {messages: conversations, role: from, content: value} for ShareGPT."""

    roles: dict[str, Role] = Field(default_factory=lambda: dict(SHAREGPT_ROLES))
    """Role names of the data mapped onto system/user/assistant/tool (ShareGPT's human/gpt by default);
    a role that is neither one of those nor mapped here is an error naming the record."""

    chat_template: str | None = None
    """The chat template of chat records: null uses the tokenizer's own (`chat_template` in its
    tokenizer_config.json / chat_template.jinja); a name (chatml, llama-3, mistral, phi-3, gemma, zephyr,
    alpaca, or what users call them: qwen2.5, llama3, llama-3.1, phi3, gemma2, ...; docs/sft.md), a
    .jinja file, or inline Jinja otherwise. Saved with the tokenizer in RUN_DIR/model and RUN_DIR/adapter.
    Set, it also renders prompt-completion and Alpaca records as one user and one assistant turn."""

    train_on_inputs: bool = False
    """false: the loss covers the answers only (the turns of `roles_to_train` and the end-of-turn
    token after each); true: every token, prompts and template included."""

    roles_to_train: list[Role] = Field(default_factory=lambda: ["assistant"])
    """Chat records with train_on_inputs false: the roles whose turns carry the loss."""

    system_prompt: str | None = None
    """A system prompt given to every chat, prompt-completion and Alpaca sample that has none of its own
    (no system turn, no text in the `system` column): the first turn through a chat template; without
    one, the text before the prompt (an Alpaca prompt's, in place of its preamble). A source of
    `datasets` may set its own."""

    truncation: Truncation = "keep_answer"
    """Chat, instruction and preference samples longer than train.seq_len (docs/sft.md). keep_answer:
    the prompt is cut from the left (the earliest turns first; a leading BOS token stays) so the
    answers and their end-of-turn token stay whole; an answer is kept whole or not at all, so a long
    chat keeps its last answers, and a sample whose last answer alone does not fit is dropped and
    counted. keep_start: cut to the first seq_len tokens (the answer's end may be lost; samples left
    with no trained token are dropped and counted; `truncate` is its old name). drop: dropped and
    counted. error: an error naming the first. A preference pair's two sequences are cut alike."""

    last_turn_only: bool = Field(default=False, exclude_if=lambda v: not v)
    """Chat records: only the conversation's last turn of `roles_to_train` (by default its final
    assistant answer, with its end-of-turn token) carries the loss; the turns before it are context
    (LLaMA-Factory's `mask_history`). Under `truncation: keep_answer` a long chat keeps that answer
    (the prompt is cut from the left); under keep_start a last answer past seq_len is cut away and the
    sample, left with nothing to train, is dropped (counted). Part of the data cache key."""

    @field_validator("roles_to_train")
    @classmethod
    def _some_role(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("name at least one role (system, user, assistant, tool), or set train_on_inputs: true")
        return v

    @field_validator("truncation", mode="before")
    @classmethod
    def _old_truncation_name(cls, v: Any) -> Any:
        return OLD_TRUNCATION_NAMES.get(v, v) if isinstance(v, str) else v

    @field_validator("last_turn_only")
    @classmethod
    def _last_turn_of_answers(cls, v: bool, info: ValidationInfo) -> bool:
        if v and info.data.get("train_on_inputs"):
            raise ValueError("train_on_inputs trains every token, last_turn_only one turn: set one of them")
        return v

    @field_validator("module")
    @classmethod
    def _module_path(cls, v: str | None) -> str | None:
        return check_module_path(v)

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
        if self.datasets and (self.train_files or self.dataset is not None):
            given = "train_files" if self.train_files else "dataset"
            raise ValueError(f"give `datasets` or `{given}`, not both (list the {given} as one more "
                             "`- path: ...` entry of datasets)")
        weighted = [i for i, d in enumerate(self.datasets) if d.weight is not None]
        unweighted = [i for i, d in enumerate(self.datasets) if d.weight is None and d.samples is None]
        if weighted and unweighted:
            raise ValueError(f"datasets[{unweighted[0]}] has no weight while datasets[{weighted[0]}] has one: "
                             "weights are shares of the mix; give every source without `samples` a weight, or none")
        if self.validation_files and self.validation_split is not None:
            raise ValueError("give `validation_files` or `validation_split`, not both")
        return self

    def for_source(self, listed: int | None) -> DataSection:
        """This section as entry `listed` of `datasets` reads its records (its record_format, columns and
        system_prompt over these); the section itself for None (train_files, dataset)."""
        if listed is None:
            return self
        entry, update = self.datasets[listed], {}
        if entry.record_format is not None:
            update["record_format"] = entry.record_format
        if entry.columns is not None:
            update["columns"] = self.columns.model_copy(update=entry.columns.model_dump(exclude_unset=True))
        if entry.system_prompt is not None:
            update["system_prompt"] = entry.system_prompt or None
        return self.model_copy(update=update)
