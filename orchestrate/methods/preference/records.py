"""Preference records and their tokens (docs/preference.md), on the chat data path (orchestrate/data:
records.py, sft_tokens.py, the cache's mask.bin).

    preference            `chosen` + `rejected` (+ `prompt`): TRL's preference format, strings or
                          lists of messages; without a prompt column, message lists whose leading
                          turns are the same (the prompt: TRL's "implicit prompt")
    unpaired-preference   `prompt` + `completion` + `label` (true: desirable): TRL's unpaired format (KTO)

A pair is stored as one document: the chosen sequence (prompt + chosen answer) then the rejected one
(prompt + rejected answer), every token of the rejected one carrying mask.bin's REJECTED bit; the loss
covers each answer's tokens (TRAINED | ANSWER), never the prompt. Both sequences begin with the same
prompt tokens, so cutting both at seq_len keeps their prompts equal (samples.py). An unpaired record
is one sequence, all REJECTED when undesirable.

Tokens: with message lists, the conversation as the chat template renders it (sft_tokens.encode_chat),
the answer being the assistant turns after the prompt: the prompt rendered with the generation prompt
must be where both conversations begin (token for token), else the template is refused. With strings,
the prompt and the answer as prompt-completion records have them (the tokenizer's BOS, the answer
and an EOS; with `data.chat_template` one user and one assistant turn).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jinja2
import numpy as np

from orchestrate.data.records import PREFERENCE_FORMATS, normalise_messages
from orchestrate.data.sft_prepare import ANSWER, REJECTED, TEMPLATE_PROBLEM, TRAINED
from orchestrate.data.sft_tokens import TemplateNotIncremental, encode_chat, encode_completion

if TYPE_CHECKING:
    from orchestrate.config.data import DataSection
    from orchestrate.data.chat_template import ChatTemplate
    from orchestrate.data.tokenizer import Tokenizer

PAIRED, UNPAIRED = PREFERENCE_FORMATS


@dataclass(frozen=True)
class Preference:
    """One record: a prompt and its answers, as text or as messages (conversational)."""

    prompt: str | list[dict[str, Any]]
    answers: tuple[str | list[dict[str, Any]], ...]
    """(chosen, rejected), or (completion,) for an unpaired record."""
    desirable: bool = True

    @property
    def conversational(self) -> bool:
        return isinstance(self.prompt, list)


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, (str, list)) and not (value.strip() if isinstance(value, str) else value))


def _messages(value: Any, what: str, data: DataSection) -> tuple[list[dict] | None, str | None]:
    if not isinstance(value, list):
        return None, f"its {what} is {type(value).__name__}, where the other fields are lists of messages"
    messages, problem = normalise_messages(value, data)
    return messages, None if messages else f"{what}: {problem}"


def _implicit_prompt(chosen: list[dict], rejected: list[dict]) -> int:
    """How many leading messages chosen and rejected share (TRL's extract_prompt)."""
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    return shared


def to_preference(record: dict[str, Any], record_format: str, data: DataSection) -> tuple[Preference | None, str | None]:
    """One record as a Preference, or (None, what is wrong with it)."""
    c = data.columns
    prompt = record.get(c.prompt)
    if record_format == UNPAIRED:
        completion, label = record.get(c.completion), record.get(c.label)
        if _missing(completion):
            return None, f"it has no {c.completion!r} answer"
        if not isinstance(label, bool):
            return None, f"its {c.label!r} is {label!r}, not true (desirable) or false"
        answers, problem = _answers(prompt, [completion], data)
        return (Preference(answers[0], answers[1:], label), None) if answers else (None, problem)
    chosen, rejected = record.get(c.chosen), record.get(c.rejected)
    for name, value in ((c.chosen, chosen), (c.rejected, rejected)):
        if _missing(value):
            return None, f"it has no {name!r} answer"
    if prompt is None and isinstance(chosen, list) and isinstance(rejected, list):
        chosen, problem = _messages(chosen, c.chosen, data)
        rejected, problem = (rejected, problem) if problem else _messages(rejected, c.rejected, data)
        if problem:
            return None, problem
        shared = _implicit_prompt(chosen, rejected)
        if shared == 0:
            return None, (f"no {c.prompt!r} column and {c.chosen!r} and {c.rejected!r} share no leading turn "
                          "to be the prompt")
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
        if not chosen or not rejected:
            return None, f"its {c.chosen!r} and {c.rejected!r} answers are identical"
        return Preference(prompt, (chosen, rejected)), None
    if prompt is None:
        return None, f"it has no {c.prompt!r} (needed unless {c.chosen!r} and {c.rejected!r} are message lists)"
    answers, problem = _answers(prompt, [chosen, rejected], data)
    if answers is None:
        return None, problem
    if answers[1] == answers[2]:
        return None, f"its {c.chosen!r} and {c.rejected!r} answers are identical"
    return Preference(answers[0], tuple(answers[1:])), None


def _answers(prompt: Any, answers: list[Any], data: DataSection) -> tuple[list | None, str | None]:
    """[prompt, *answers] all text, or all messages (normalised); else (None, the problem)."""
    c = data.columns
    if isinstance(prompt, str) and all(isinstance(a, str) for a in answers):
        return [prompt, *answers], None
    if not isinstance(prompt, list) or not all(isinstance(a, list) for a in answers):
        return None, (f"its {c.prompt!r} and answers mix text and message lists: give all of them as text, "
                      "or all as lists of messages")
    out = []
    for value, what in zip([prompt, *answers], [c.prompt, "an answer", "an answer"], strict=False):
        messages, problem = _messages(value, what, data)
        if problem:
            return None, problem
        out.append(messages)
    return out, None


def _conversation(tok, template: ChatTemplate, prompt: list[dict], answer: list[dict]) -> tuple[list[int], list[int]]:
    """(ids, answer mask) of prompt + answer, the mask on the answer's assistant turns only."""
    if any(m["role"] != "assistant" for m in answer):
        raise TemplateNotIncremental("an answer holds a turn that is not the assistant's")
    encoded = encode_chat(tok, template, [*prompt, *answer], ["assistant"], train_on_inputs=False)
    rendered = tok.apply_chat_template(prompt, chat_template=template.source, tokenize=False, add_generation_prompt=True)
    head = tok(rendered, add_special_tokens=False)["input_ids"]
    if encoded.ids[: len(head)] != list(head):
        raise TemplateNotIncremental("the prompt with its generation prompt does not begin the conversation with an "
                                     "answer token for token")
    return encoded.ids, [0] * len(head) + encoded.answer[len(head):]


def encode_preference(preference: Preference, tokenizer: Tokenizer,
                      template: ChatTemplate | None) -> list[tuple[list[int], list[int]]]:
    """(ids, answer mask) of each sequence of a record: prompt + chosen and prompt + rejected, or prompt +
    completion (module docstring). Raises TemplateNotIncremental where the template's answers cannot be found."""
    hf = getattr(tokenizer, "tok", None)
    out = []
    for answer in preference.answers:
        if preference.conversational:
            out.append(_conversation(hf, template, preference.prompt, answer))
        elif template is not None:
            out.append(_conversation(hf, template, [{"role": "user", "content": preference.prompt}],
                                     [{"role": "assistant", "content": answer}]))
        else:
            encoded = encode_completion(hf, preference.prompt, answer, tokenizer.eos_id)
            out.append((encoded.ids, encoded.answer))
    return out


def preference_document(record: dict, record_format: str, data: DataSection, template: ChatTemplate | None,
                        tokenizer: Tokenizer) -> tuple[tuple[list[int], np.ndarray] | None, str | None]:
    """A preference record's document: its sequences one after the other, each answer TRAINED | ANSWER,
    the rejected (or undesirable) sequence REJECTED; None when a sequence has no answer token
    (the reader's `tokens`, orchestrate/data/method_data.py)."""
    preference, problem = to_preference(record, record_format, data)
    if preference is None:
        return None, problem
    if preference.conversational and template is None:
        return None, "its answers are messages and no chat template renders them"
    try:
        sequences = encode_preference(preference, tokenizer, template)
    except TemplateNotIncremental as exc:
        return None, TEMPLATE_PROBLEM + str(exc)
    except jinja2.TemplateError as exc:
        return None, f"the chat template refused it: {exc}"
    if not all(any(answer) for _, answer in sequences):
        return None, None
    rejected = [side == 1 or not preference.desirable for side in range(len(sequences))]
    bits = [(TRAINED | ANSWER) * np.asarray(answer, dtype=np.uint8) | (REJECTED if r else 0)
            for (_, answer), r in zip(sequences, rejected, strict=True)]
    return ([i for ids, _ in sequences for i in ids], np.concatenate(bits)), None
