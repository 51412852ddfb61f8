"""Record formats: what one record of the training data is, detected from its columns, and each
record normalised to what the tokenizer sees (orchestrate/data/sft_tokens.py).

    preference         `chosen` + `rejected` (+ `prompt`), or `prompt` + `completion` + `label`:
                       pairs of answers or labelled answers (orchestrate/methods/preference/records.py)
    chat               a `messages` list of {role, content} (OpenAI); ShareGPT's `conversations` of
                       {from, value}, its human/gpt roles mapped by `data.roles`; tool turns and
                       `tool_calls` passed through to the template
    prompt-completion  `prompt` + `completion` strings (TRL's "standard" prompt-completion); lists of
                       messages in both (TRL's conversational form) are a chat
    alpaca             `instruction` (+ optional `input`) + `output`, prompted as Stanford Alpaca was
    text               anything else: `text_field` or `data.template`, the loss on every token

Every record is held to a budget where it comes in (`to_sample`, `record_chars`): a text longer than
the characters that can hold seq_len tokens is cut there before anything renders or tokenises it
(its first seq_len tokens, all that trains, are unchanged; it still counts as longer than seq_len for
`data.truncation`), and the messages past that budget keep their role but no text; the cut records
are counted (`Sample.cut`, meta.json's `records_cut`).

Detection (`detect_format`) looks at the column names only; `data.record_format` overrides it and
`data.template` means text. Bad records are reported, not skipped: `problems` says what is wrong
with one record, and the caller raises one error naming the first few with the YAML path.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from orchestrate.config.data import ROLES

if TYPE_CHECKING:
    from orchestrate.config.data import DataSection

SFT_FORMATS = ("chat", "prompt-completion", "alpaca")
PREFERENCE_FORMATS = ("preference", "unpaired-preference")
"""Preference records (orchestrate/methods/preference/records.py): pairs of answers, or single answers
labelled desirable or not."""
SHAREGPT_MESSAGES = "conversations"
"""ShareGPT's messages column, detected as chat like `messages`."""
MESSAGE_EXTRAS = ("tool_calls", "name", "tool_call_id")
"""Message keys passed through to the template besides role and content."""
BYTES_PER_TOKEN = 32
"""More characters than a token of a real vocabulary spans (most span under 8): seq_len tokens
never reach past seq_len * BYTES_PER_TOKEN characters of text."""
BUDGET_STEP = 4
FIRST_BUDGET = 256
"""The record budget is that of the seq_len rounded up to 256 * 4**k tokens: seq_len changes within
one step keep the tokenised cache entry (seq_len is a view over it), a change across one rebuilds it."""


def lone_surrogate(value: Any) -> str | None:
    """The first lone surrogate in a record's strings (nested in lists and mappings), as U+XXXX; None
    when every string is text. Python's json reads a `\\ud800` escape without its pair as one, and
    no tokenizer encodes it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return f"U+{ord(value[exc.start]):04X}"
        return None
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list | tuple) else ()
    return next((found for item in items if (found := lone_surrogate(item)) is not None), None)


def record_chars(seq_len: int) -> int:
    """Characters of a record's text that hold more than its first seq_len tokens (BYTES_PER_TOKEN),
    seq_len rounded up to a step of BUDGET_STEP (part of the cache key)."""
    tokens = FIRST_BUDGET
    while tokens < seq_len:
        tokens *= BUDGET_STEP
    return (tokens + 1) * BYTES_PER_TOKEN


# Stanford Alpaca's prompts (tatsu-lab/stanford_alpaca, train.py PROMPT_DICT): the instruction, the input
# when there is one, then the answer after "### Response:".
ALPACA_PROMPT = ("Below is an instruction that describes a task, paired with an input that provides further "
                 "context. Write a response that appropriately completes the request.\n\n"
                 "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
ALPACA_PROMPT_NO_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately "
                          "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")


def messages_column(columns: Iterable[str], data: DataSection) -> str | None:
    cols = set(columns)
    if data.columns.messages in cols:
        return data.columns.messages
    return SHAREGPT_MESSAGES if SHAREGPT_MESSAGES in cols else None


def detect_format(columns: Iterable[str], data: DataSection) -> str:
    """The record format of data with these columns (see the module docstring)."""
    if data.record_format != "auto":
        return data.record_format
    if data.template is not None:
        return "text"
    cols, c = set(columns), data.columns
    if c.chosen in cols and c.rejected in cols:
        return "preference"
    if c.prompt in cols and c.completion in cols and c.label in cols:
        return "unpaired-preference"
    if messages_column(cols, data) is not None:
        return "chat"
    if c.prompt in cols and c.completion in cols:
        return "prompt-completion"
    if c.instruction in cols and c.output in cols:
        return "alpaca"
    return "text"


def uses_chat_template(record_format: str, chat_template_set: bool, messages: bool = False) -> bool:
    """Whether records of `record_format` are rendered through a chat template: chat records and
    records whose prompt or answers are lists of messages (`messages`) always (data.chat_template, else
    the tokenizer's own); prompt-completion, Alpaca and text preference records only when
    data.chat_template is set (one user and one assistant turn, `as_chat`), else as raw text; plain
    text never. The one rule of the data pipeline (sft_prepare.py `template_for`) and of
    `orchestrate chat`, so that chat renders a prompt the way training rendered the run's records."""
    if record_format == "text":
        return False
    return record_format == "chat" or messages or chat_template_set


def conversational_column(record_format: str, data: DataSection) -> str | None:
    """The column that holds a list of messages when prompt-completion or preference records are in
    TRL's conversational form (rendered by a chat template like a chat); None for other formats."""
    c = data.columns
    return {"prompt-completion": c.prompt, "preference": c.chosen, "unpaired-preference": c.completion}.get(record_format)


def holds_messages(record: dict[str, Any], record_format: str, data: DataSection) -> bool:
    """One record of `record_format` in the conversational form (`conversational_column`)."""
    column = conversational_column(record_format, data)
    return column is not None and isinstance(record.get(column), list)


def alpaca_prompt(instruction: str, extra: str | None = None) -> str:
    """Stanford Alpaca's prompt of an instruction (and its input, when there is one)."""
    if extra and extra.strip():
        return ALPACA_PROMPT.format(instruction=instruction, input=extra)
    return ALPACA_PROMPT_NO_INPUT.format(instruction=instruction)


def raw_prompt(record_format: str, text: str) -> str:
    """A user's prompt as records of `record_format` put their prompt before the answer without a
    chat template: Alpaca's prompt around it (as an instruction without input), else the text itself."""
    return alpaca_prompt(text) if record_format == "alpaca" else text


def required_columns(record_format: str, columns: Iterable[str], data: DataSection) -> list[str]:
    c = data.columns
    if record_format == "chat":
        return [messages_column(columns, data) or c.messages]
    if record_format == "prompt-completion":
        return [c.prompt, c.completion]
    if record_format == "alpaca":
        return [c.instruction, c.output]
    if record_format == "preference":
        return [c.chosen, c.rejected]
    if record_format == "unpaired-preference":
        return [c.prompt, c.completion, c.label]
    return []


@dataclass(frozen=True)
class Sample:
    """One record as the tokenizer sees it: a conversation, or a prompt and its completion."""

    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    completion: str | None = None
    cut: bool = False
    """Its text was cut at the record budget (`record_chars`)."""


def _key(message: dict, configured: str | None, default: str, sharegpt: str) -> str:
    if configured is not None:
        return configured
    return default if message.get(default) is not None or sharegpt not in message else sharegpt


def _cut(text: str, chars: int | None) -> str:
    return text if chars is None or len(text) <= chars else text[:chars]


def _cut_messages(messages: list[dict[str, Any]], chars: int) -> list[dict[str, Any]]:
    """The messages with their text past `chars` characters in all cut off (each keeps its role)."""
    out = []
    for message in messages:
        if "content" in message:
            message = {**message, "content": _cut(message["content"], chars)}
            chars -= len(message["content"])
        out.append(message)
    return out


def normalise_messages(raw: Any, data: DataSection) -> tuple[list[dict[str, Any]] | None, str | None]:
    """(messages with roles mapped and only the keys a template reads, None) or (None, what is wrong)."""
    if not isinstance(raw, list) or not raw:
        return None, "its messages are not a non-empty list"
    out = []
    for i, message in enumerate(raw):
        if not isinstance(message, dict):
            return None, f"message {i} is not a mapping"
        role_key = _key(message, data.columns.role, "role", "from")
        content_key = _key(message, data.columns.content, "content", "value")
        raw_role = message.get(role_key)
        role = data.roles.get(raw_role, raw_role) if isinstance(raw_role, str) else raw_role
        if role not in ROLES:
            return None, (f"message {i} has role {raw_role!r} (key {role_key!r}), none of {', '.join(ROLES)}; "
                          f"map it with data.roles: {{{raw_role}: assistant}} (or user, system, tool)")
        content = message.get(content_key)
        extras = {k: message[k] for k in MESSAGE_EXTRAS if message.get(k) is not None}
        if content is None and "tool_calls" not in extras:
            return None, f"message {i} ({role}) has no {content_key!r} text"
        if content is not None and not isinstance(content, str):
            return None, f"message {i} ({role}): {content_key!r} holds {type(content).__name__}, not text"
        calls = extras.get("tool_calls")
        if calls is not None and not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
            return None, (f"message {i} ({role}): 'tool_calls' holds {type(calls).__name__}, not a list of calls "
                          "({type: function, function: {name, arguments}})")
        out.append({"role": role, **({"content": content} if content is not None else {}), **extras})
    return out, None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _chars(sample: Sample) -> int:
    texts = [m.get("content") or "" for m in sample.messages] if sample.messages is not None else [
        sample.prompt or "", sample.completion or ""]
    return sum(len(t) for t in texts)


def to_sample(record: dict[str, Any], record_format: str, data: DataSection,
              chars: int | None = None) -> tuple[Sample | None, str | None]:
    """One record of `record_format` as a Sample (its text cut at `chars`, the record budget
    `record_chars`), or (None, what is wrong with it)."""
    sample, problem = _whole_sample(record, record_format, data)
    if sample is None or chars is None or _chars(sample) <= chars:
        return sample, problem
    if sample.messages is not None:
        return Sample(messages=_cut_messages(sample.messages, chars), cut=True), None
    prompt = _cut(sample.prompt, chars)
    return Sample(prompt=prompt, completion=_cut(sample.completion, chars - len(prompt)), cut=True), None


def _whole_sample(record: dict[str, Any], record_format: str, data: DataSection) -> tuple[Sample | None, str | None]:
    c = data.columns
    if record_format == "chat":
        messages, problem = normalise_messages(record.get(messages_column(record, data)), data)
        return (Sample(messages=messages), None) if messages else (None, problem)
    if record_format == "prompt-completion":
        prompt, completion = record.get(c.prompt), record.get(c.completion)
        if isinstance(prompt, list) and isinstance(completion, list):  # conversational prompt-completion
            messages, problem = normalise_messages(prompt + completion, data)
            return (Sample(messages=messages), None) if messages else (None, problem)
        if _text(prompt) is None or _text(completion) is None:
            return None, f"{c.prompt!r} and {c.completion!r} must both be text (or both lists of messages)"
        return Sample(prompt=prompt, completion=completion), None
    instruction, output, extra = record.get(c.instruction), record.get(c.output), record.get(c.input)
    if _text(instruction) is None or _text(output) is None or (extra is not None and _text(extra) is None):
        return None, f"{c.instruction!r}, {c.output!r} (and {c.input!r} when present) must be text"
    return Sample(prompt=alpaca_prompt(instruction, extra), completion=output), None


def as_chat(sample: Sample, record: dict[str, Any], record_format: str, data: DataSection) -> Sample:
    """A prompt-completion or Alpaca sample as one user turn and one assistant turn (with
    `data.chat_template` set): Alpaca's instruction and input in the user turn, without its preamble."""
    if sample.messages is not None:
        return sample
    prompt = sample.prompt
    if record_format == "alpaca":
        extra = record.get(data.columns.input)
        prompt = record[data.columns.instruction] + (f"\n\n{extra}" if extra and extra.strip() else "")
        prompt = prompt[: len(sample.prompt)] if sample.cut else prompt
    return Sample(messages=[{"role": "user", "content": prompt}, {"role": "assistant", "content": sample.completion}],
                  cut=sample.cut)


def lacks_trained_turn(messages: list[dict[str, Any]], roles_to_train: list[str]) -> bool:
    return not any(m["role"] in roles_to_train for m in messages)
