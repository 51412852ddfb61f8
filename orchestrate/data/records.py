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
the characters that can hold seq_len tokens is cut there before anything renders or tokenises it, on
the side `data.truncation` cuts tokens from (`cuts_from_left`). The other policies keep its start:
the messages past the budget keep their role but no text (the conversation is split into turns only
as far as the budget reaches, sft_tokens.py). keep_answer keeps its end: the completion whole and the
prompt's last characters, or a conversation's last messages: those before the budget, and those before
its last `budget / BYTES_PER_TOKEN` (each renders a token at least), are left out, the conversation
starting again at a turn of the role it opened with (after its system message, kept), so templates
that want alternating roles still take it. The seq_len tokens the policy keeps are unchanged by it;
the record still counts as longer than seq_len for `data.truncation`; the cut records are counted
(`Sample.cut`, meta.json's `records_cut`).

A record's system prompt (its `system` column, else `data.system_prompt`) is its first turn when a
chat template renders it; without one it is the text before the prompt (in an Alpaca prompt, in place
of the preamble, as LLaMA-Factory's `alpaca` template takes its system: data/template.py).

Detection (`detect_format`) looks at the column names only; `data.record_format` overrides it and
`data.template` means text. Bad records are reported, not skipped: `problems` says what is wrong
with one record, and the caller raises one error naming the first few with the YAML path. Sources of
different formats make one stream when they are all chat and instruction records (`stream_format`).
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
ALPACA_PREAMBLES = (ALPACA_PROMPT.split("\n\n", 1)[0], ALPACA_PROMPT_NO_INPUT.split("\n\n", 1)[0])
"""The first paragraph of each prompt: what a system prompt replaces."""


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


def alpaca_prompt(instruction: str, extra: str | None = None, system: str | None = None) -> str:
    """Stanford Alpaca's prompt of an instruction (and its input, when there is one); a system prompt
    in place of its preamble."""
    with_input = bool(extra and extra.strip())
    prompt = (ALPACA_PROMPT.format(instruction=instruction, input=extra) if with_input
              else ALPACA_PROMPT_NO_INPUT.format(instruction=instruction))
    return prompt if system is None else system + prompt[len(ALPACA_PREAMBLES[0 if with_input else 1]):]


def raw_prompt(record_format: str, text: str, system: str | None = None) -> str:
    """A user's prompt as records of `record_format` put their prompt before the answer without a
    chat template: Alpaca's prompt around it (as an instruction without input; `system` in place of its
    preamble), else the text itself (after `system` and a blank line, as `_whole_sample` puts it)."""
    if record_format == "alpaca":
        return alpaca_prompt(text, None, system)
    return text if system is None else f"{system}\n\n{text}"


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


def expected_shapes(data: DataSection) -> str:
    """The shapes records may have, in this section's column names (for the error of a source of none)."""
    c = data.columns
    return (f"chat: a {c.messages!r} (or {SHAREGPT_MESSAGES!r}) list; prompt-completion: {c.prompt!r} + "
            f"{c.completion!r}; alpaca: {c.instruction!r} + {c.output!r}; preference: {c.chosen!r} + "
            f"{c.rejected!r}; plain text: {data.text_field!r} (data.text_field)")


def stream_format(formats: list[str], templated: bool) -> str | None:
    """The record format of one stream made of sources of `formats`: theirs when they share one; for
    chat and instruction records of different formats, rendered alike (`templated`: all through the chat
    template as chat, else all as raw prompt and completion); None when they cannot share a stream
    (text, preference pairs or labelled answers beside anything else: another loss)."""
    if len(set(formats)) == 1:
        return formats[0]
    if all(f in SFT_FORMATS for f in formats):
        return "chat" if templated else "prompt-completion"
    return None


@dataclass(frozen=True)
class Sample:
    """One record as the tokenizer sees it: a conversation, or a prompt and its completion."""

    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    """The prompt as raw text renders it (after the system prompt, when there is one)."""
    completion: str | None = None
    cut: bool = False
    """Its text was cut at the record budget (`record_chars`)."""
    system: str | None = None
    """A prompt-completion or Alpaca record's system prompt (`as_chat` makes it the first turn)."""


def _key(message: dict, configured: str | None, default: str, sharegpt: str) -> str:
    if configured is not None:
        return configured
    return default if message.get(default) is not None or sharegpt not in message else sharegpt


def cuts_from_left(data: DataSection) -> bool:
    """Whether `data.truncation` cuts a long sample's tokens from its left (keep_answer), so the record
    budget keeps a record's end."""
    return data.truncation == "keep_answer"


def _cut(text: str, chars: int | None, from_left: bool = False) -> str:
    if chars is None or len(text) <= chars:
        return text
    return text[len(text) - chars:] if from_left else text[:chars]


def _cut_messages(messages: list[dict[str, Any]], chars: int, from_left: bool) -> list[dict[str, Any]]:
    """The messages with their text past `chars` characters in all cut off (each keeps its role),
    counted from the last message's end when `from_left`, else from the first message's start."""
    out = []
    for message in reversed(messages) if from_left else messages:
        if "content" in message:
            message = {**message, "content": _cut(message["content"], chars, from_left)}
            chars -= len(message["content"])
        out.append(message)
    return out[::-1] if from_left else out


def _latest_turns(messages: list[dict[str, Any]], most: int) -> list[dict[str, Any]]:
    """The conversation without the messages before the first that holds text and before its last `most`,
    from a message of the role it opened with (the module docstring); its system message kept."""
    first = 1 if messages[0]["role"] == "system" else 0
    texted = next((i for i, m in enumerate(messages) if m.get("content")), len(messages))
    start = min(max(texted, len(messages) - most), len(messages) - 1)
    while start > first and messages[start]["role"] != messages[first]["role"]:
        start -= 1
    return messages[:first] + messages[max(start, first):]


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
    system, problem = system_prompt(record, data)
    if problem is not None:
        return None, problem
    sample, problem = _whole_sample(record, record_format, data, system)
    if sample is None or chars is None:
        return sample, problem
    from_left, over = cuts_from_left(data), _chars(sample) > chars
    if sample.messages is not None:
        messages = _cut_messages(sample.messages, chars, from_left) if over else sample.messages
        if from_left:  # keep_answer: only the turns that can reach the tokens it keeps (module docstring)
            messages = _latest_turns(messages, chars // BYTES_PER_TOKEN)
        return (Sample(messages=messages, cut=True) if over or len(messages) < len(sample.messages) else sample), None
    if not over:
        return sample, None
    if from_left:  # a completion past the budget is longer than seq_len: the policy drops it whatever its cut
        completion = _cut(sample.completion, chars)
        return Sample(prompt=_cut(sample.prompt, chars - len(completion), True), completion=completion, cut=True,
                      system=sample.system), None
    prompt = _cut(sample.prompt, chars)
    return Sample(prompt=prompt, completion=_cut(sample.completion, chars - len(prompt)), cut=True,
                  system=sample.system), None


def system_prompt(record: dict[str, Any], data: DataSection) -> tuple[str | None, str | None]:
    """(the record's system prompt: its `system` column's text, else `data.system_prompt`, else None;
    None) or (None, what is wrong with the column). A blank or missing cell is no system prompt."""
    value = record.get(data.columns.system)
    if value is not None and not isinstance(value, str):
        return None, f"{data.columns.system!r} holds {type(value).__name__}, not text"
    return (value if value and value.strip() else data.system_prompt or None), None


def with_system(messages: list[dict[str, Any]], system: str | None) -> list[dict[str, Any]]:
    """The conversation with `system` as its first turn, unless it opens with a system turn of its own."""
    if system is None or messages[0]["role"] == "system":
        return messages
    return [{"role": "system", "content": system}, *messages]


def _whole_sample(record: dict[str, Any], record_format: str, data: DataSection,
                  system: str | None) -> tuple[Sample | None, str | None]:
    c = data.columns
    if record_format == "chat":
        messages, problem = normalise_messages(record.get(messages_column(record, data)), data)
        return (Sample(messages=with_system(messages, system)), None) if messages else (None, problem)
    if record_format == "prompt-completion":
        prompt, completion = record.get(c.prompt), record.get(c.completion)
        if isinstance(prompt, list) and isinstance(completion, list):  # conversational prompt-completion
            messages, problem = normalise_messages(prompt + completion, data)
            return (Sample(messages=with_system(messages, system)), None) if messages else (None, problem)
        if _text(prompt) is None or _text(completion) is None:
            return None, f"{c.prompt!r} and {c.completion!r} must both be text (or both lists of messages)"
        raw = prompt if system is None else f"{system}\n\n{prompt}"
        return Sample(prompt=raw, completion=completion, system=system), None
    instruction, output, extra = record.get(c.instruction), record.get(c.output), record.get(c.input)
    if _text(instruction) is None or _text(output) is None or (extra is not None and _text(extra) is None):
        return None, f"{c.instruction!r}, {c.output!r} (and {c.input!r} when present) must be text"
    return Sample(prompt=alpaca_prompt(instruction, extra, system), completion=output, system=system), None


def as_chat(sample: Sample, record: dict[str, Any], record_format: str, data: DataSection) -> Sample:
    """A prompt-completion or Alpaca sample as one user turn and one assistant turn (with
    `data.chat_template` set): Alpaca's instruction and input in the user turn, without its preamble."""
    if sample.messages is not None:
        return sample
    if record_format == "alpaca":
        extra = record.get(data.columns.input)
        prompt = record[data.columns.instruction] + (f"\n\n{extra}" if extra and extra.strip() else "")
    else:
        prompt = record[data.columns.prompt]
    if sample.cut:  # the chat prompt holds no preamble: cut to the characters the cut prompt kept
        prompt = _cut(prompt, len(sample.prompt), cuts_from_left(data))
    turns = [{"role": "user", "content": prompt}, {"role": "assistant", "content": sample.completion}]
    return Sample(messages=with_system(turns, sample.system), cut=sample.cut)


def lacks_trained_turn(messages: list[dict[str, Any]], roles_to_train: list[str]) -> bool:
    return not any(m["role"] in roles_to_train for m in messages)
