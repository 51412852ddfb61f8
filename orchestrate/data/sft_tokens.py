"""One sample's token ids and its loss mask (1: a token the loss trains on), as the template and the
tokenizer define them: nothing added, nothing dropped.

Chat: the conversation is rendered by the chat template (chat_template.py `render`, as transformers'
`apply_chat_template` renders it, within its limits) and the
text tokenized without the tokenizer's own special tokens, as `apply_chat_template(tokenize=True)`
does: a BOS appears once where the template renders `bos_token`, each turn ends with the template's
own end-of-turn token, no EOS is appended. The trained tokens are

- with `{% generation %}` markers in the template and the default `roles_to_train: [assistant]`:
  the tokens overlapping a marked span (transformers' `return_assistant_tokens_mask` rule);
- otherwise: found by rendering turn by turn. An assistant turn's span runs from the end of the
  conversation before it rendered with `add_generation_prompt=True` (so its header is not trained) to
  the end of the conversation including it, trailing whitespace left out (the newline ChatML puts
  after `<|im_end|>`); another trained role's span is its whole rendered turn. Tokens overlapping a
  span are trained (transformers' rule). A template that re-renders earlier turns differently once
  later ones follow, or renders an answer without its content, cannot be split this way and is
  refused with the fix (markers, or a template that renders message.content).

Either way the span includes the end-of-turn token after the answer, so the model learns to stop.

`data.last_turn_only` keeps the last turn of a trained role alone (LLaMA-Factory's `mask_history`,
data/processor/supervised.py: every pair but the last labelled IGNORE_INDEX): its start is where the
conversation rendered up to it ends, so only that turn's marked spans (markers) or its own span
(turn by turn) are trained, from a few renders whatever the conversation's length.

Prompt-completion and Alpaca without a chat template: the tokenizer's own special tokens around the
text (what `tokenizer(text)` adds: Llama's BOS, nothing for GPT-2 or Qwen), prompt and completion
encoded apart (so the prompt's ids are those `tokenizer(prompt)` gives at inference), then EOS unless
the tokenizer's suffix or the completion already ends with it. The completion and the EOS are trained.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from orchestrate.data.chat_template import ChatTemplate, render

MARKERS = "generation markers (transformers' return_assistant_tokens_mask)"
INCREMENTAL = "incremental rendering"
ALL_TOKENS = "every token (train_on_inputs)"
COMPLETION = "the completion and its EOS"
LAST_TURN = ", the last trained turn only (data.last_turn_only)"


class TemplateNotIncremental(ValueError):
    """The template renders a conversation's beginning differently once more turns follow, or an
    answer without its content: its trained tokens cannot be found by rendering turn by turn."""


@dataclass(frozen=True)
class Encoded:
    ids: list[int]
    mask: list[int]
    """1 where the token is a target of the loss."""
    answer: list[int]
    """1 on the assistant's answers (or the completion) with their end token, whatever the loss covers:
    where evaluation cuts a held-out sample into prompt and reference (`train.eval_generate`)."""


def mask_method(template: ChatTemplate | None, roles_to_train: list[str], train_on_inputs: bool,
                last_turn_only: bool = False) -> str:
    """How the trained tokens of a sample are found (reported in the data summary and meta.json)."""
    if train_on_inputs:
        return ALL_TOKENS
    if template is None:
        return COMPLETION
    found = MARKERS if template.has_generation_markers and list(roles_to_train) == ["assistant"] else INCREMENTAL
    return found + LAST_TURN if last_turn_only else found


def _render(tok, template: ChatTemplate, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
    return render(template, tok, messages, generation_prompt)[0]


def _turn(tok, template: ChatTemplate, messages: list[dict[str, Any]], i: int, full: str,
          before: str) -> tuple[str, tuple[int, int]]:
    """(the conversation rendered up to and including turn i, the character span of turn i in `full`);
    `before`: the conversation rendered up to turn i. An assistant turn starts after the generation
    prompt (its header untrained); its end leaves out trailing whitespace."""
    message = messages[i]
    upto = _render(tok, template, messages[: i + 1], False)
    if not full.startswith(upto):
        raise TemplateNotIncremental(f"turn {i} renders differently once later turns follow")
    start, end = len(before), len(upto.rstrip())
    if message["role"] == "assistant":
        if i > 0:
            prompt = _render(tok, template, messages[:i], True)
            if not upto.startswith(prompt):
                raise TemplateNotIncremental(f"the generation prompt before turn {i} is not where its answer starts")
            start = len(prompt)
        content = (message.get("content") or "").strip()
        if content and content not in full[start:end]:
            raise TemplateNotIncremental(f"turn {i} (assistant): its content is not rendered inside its answer")
    return upto, (start, end)


def _spans(tok, template: ChatTemplate, messages: list[dict[str, Any]], trained: list[str],
           full: str, upto_chars: int | None) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(the character spans of the assistant's answers, those of the turns of `trained` roles), in one
    pass rendering turn by turn up to the first turn that starts past `upto_chars` (later turns lie
    past the tokens kept: rendering each prefix of a long conversation is quadratic, so it stops)."""
    answers, turns, before = [], [], ""
    for i, message in enumerate(messages):
        if upto_chars is not None and len(before) > upto_chars:
            break
        upto, (start, end) = _turn(tok, template, messages, i, full, before)
        if end > start and message["role"] == "assistant":
            answers.append((start, end))
        if end > start and message["role"] in trained:
            turns.append((start, end))
        before = upto
    return answers, turns


def _last_turn(tok, template: ChatTemplate, messages: list[dict[str, Any]], trained: list[str],
               full: str) -> tuple[int, tuple[int, int]]:
    """(where the conversation before the last turn of a `trained` role ends, that turn's span), from
    two or three renders whatever the conversation's length (`last_turn_only`). The caller has checked
    that such a turn exists (records.py `lacks_trained_turn`)."""
    i = max(k for k, m in enumerate(messages) if m["role"] in trained)
    before = _render(tok, template, messages[:i], False) if i > 0 else ""
    if not full.startswith(before):
        raise TemplateNotIncremental(f"turn {i - 1} renders differently once later turns follow")
    return len(before), _turn(tok, template, messages, i, full, before)[1]


def _overlapping(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for every token overlapping a span (the rule of transformers' return_assistant_tokens_mask), in
    one pass over both: the tokens' offsets and the disjoint spans are in order (a conversation of
    thousands of trained turns is no product of its tokens and its turns)."""
    spans, mask, k = sorted(spans), [], 0
    for start, end in offsets:
        while k < len(spans) and spans[k][1] <= start:
            k += 1
        mask.append(int(k < len(spans) and end > spans[k][0] and start < spans[k][1]))
    return mask


def encode_chat(tok, template: ChatTemplate, messages: list[dict[str, Any]], roles_to_train: list[str],
                train_on_inputs: bool, upto_chars: int | None = None, last_turn_only: bool = False) -> Encoded:
    """A conversation's ids and mask (module docstring). `tok`: a fast transformers tokenizer.
    `upto_chars`: the rendered characters that can hold the tokens kept (the record budget,
    records.py), past which the turn-by-turn rendering stops. `last_turn_only`: the mask keeps the
    last turn of `roles_to_train` alone (`data.last_turn_only`)."""
    full, generation = render(template, tok, messages, False)
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    trained = list(roles_to_train)
    markers = template.has_generation_markers
    by_markers = markers and trained == ["assistant"]  # the marked spans are the trained ones
    answers, turns = generation, []
    if not markers or not (train_on_inputs or by_markers or last_turn_only):
        spans = _spans(tok, template, messages, trained, full, upto_chars)
        answers, turns = (answers, spans[1]) if markers else spans
    answer = _overlapping(offsets, answers)
    if train_on_inputs:
        return Encoded(ids, [1] * len(ids), answer)
    if last_turn_only:
        starts, span = _last_turn(tok, template, messages, trained, full)
        return Encoded(ids, _overlapping(offsets, [g for g in generation if g[0] >= starts] if by_markers else [span]),
                       answer)
    return Encoded(ids, answer if by_markers else _overlapping(offsets, turns), answer)


@lru_cache(maxsize=8)
def _wrapping(tok) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ids `tok(text)` puts before and after the text's own (its post-processor's BOS / EOS)."""
    plain = tok("a", add_special_tokens=False)["input_ids"]
    full = tok("a", add_special_tokens=True)["input_ids"]
    for i in range(len(full) - len(plain) + 1):
        if full[i: i + len(plain)] == plain:
            return tuple(full[:i]), tuple(full[i + len(plain):])
    return (), ()


def completion_prompt_ids(tok, prompt: str) -> list[int]:
    """The ids a sample without a chat template starts with: the tokenizer's prefix (its BOS) and the
    prompt's own ids, nothing after them; what `orchestrate chat` feeds a run trained on such samples.
    `tok`: as `encode_completion`'s."""
    if tok is None:
        return list(prompt.encode("utf-8"))
    return [*_wrapping(tok)[0], *tok(prompt, add_special_tokens=False)["input_ids"]]


def encode_completion(tok, prompt: str, completion: str, eos_id: int) -> Encoded:
    """Prompt and completion without a chat template (module docstring). `tok`: a transformers
    tokenizer, or None for the built-in byte tokenizer (UTF-8 bytes, no special tokens)."""
    if tok is None:
        suffix, completion_ids = (), list(completion.encode("utf-8"))
    else:
        suffix, completion_ids = _wrapping(tok)[1], tok(completion, add_special_tokens=False)["input_ids"]
    end = list(suffix)
    if not (end and end[-1] == eos_id) and not (not end and completion_ids and completion_ids[-1] == eos_id):
        end.append(eos_id)
    head = completion_prompt_ids(tok, prompt)
    tail = [*completion_ids, *end]
    answer = [0] * len(head) + [1] * len(tail)
    return Encoded(head + tail, answer, answer)
