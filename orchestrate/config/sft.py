"""The fields of chat and instruction fine-tuning (docs/sft.md), mixed into schema.py's `data:` and
`train:` sections: which record format the data is in, how its columns and roles are named, the chat
template, which tokens carry the loss, what happens to samples longer than `train.seq_len`, and how
many held-out answers evaluation generates."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from orchestrate.config.sections_base import MAX_COUNT, Section

RecordFormat = Literal["auto", "text", "chat", "prompt-completion", "alpaca"]
Role = Literal["system", "user", "assistant", "tool"]
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


class ChatDataFields(Section):
    record_format: RecordFormat = "auto"
    """What one record is. auto: detected from the columns: a `messages` list is chat, `prompt` +
    `completion` is prompt-completion, `instruction` + `output` is Alpaca, anything else plain text
    (`text_field` or `template`, the loss on every token, packed as one stream)."""

    columns: Columns = Field(default_factory=Columns)
    """Column and message-key names, e.g. {messages: conversations, role: from, content: value} for ShareGPT."""

    roles: dict[str, Role] = Field(default_factory=lambda: dict(SHAREGPT_ROLES))
    """Role names of the data mapped onto system/user/assistant/tool (ShareGPT's human/gpt by default);
    a role that is neither one of those nor mapped here is an error naming the record."""

    chat_template: str | None = None
    """The chat template of chat records: null uses the tokenizer's own (`chat_template` in its
    tokenizer_config.json / chat_template.jinja); a name (chatml, llama-3, mistral, phi-3, gemma), a
    .jinja file, or inline Jinja otherwise. Saved with the tokenizer in RUN_DIR/model and RUN_DIR/adapter.
    Set, it also renders prompt-completion and Alpaca records as one user and one assistant turn."""

    train_on_inputs: bool = False
    """false: the loss covers the answers only (the turns of `roles_to_train` and the end-of-turn
    token after each); true: every token, prompts and template included."""

    roles_to_train: list[Role] = Field(default_factory=lambda: ["assistant"])
    """Chat records with train_on_inputs false: the roles whose turns carry the loss."""

    truncation: Literal["truncate", "drop", "error"] = "truncate"
    """Chat and instruction samples longer than train.seq_len: cut to seq_len (samples left with no
    trained token are dropped and counted), dropped, or an error naming the first."""

    @field_validator("roles_to_train")
    @classmethod
    def _some_role(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("name at least one role (system, user, assistant, tool), or set train_on_inputs: true")
        return v


class EvalGenerateField(Section):
    eval_generate: int = Field(default=0, ge=0, le=MAX_COUNT)
    """Chat and instruction records: at each evaluation, generate this many held-out answers (greedy) and
    log their exact-match rate against the data's answers (`eval_exact_match`) and the texts
    (`eval_generations`) in metrics.jsonl; 0: none."""
