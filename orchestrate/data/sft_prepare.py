"""Chat and instruction records into the cache: the settings that decide ids and masks (part of the
cache key), the column checks, and the `Dataset.map` function that writes each record's ids, its
loss mask (entry/mask.bin, one uint8 per token: TRAINED, plus ANSWER on the answers, which evaluation
cuts held-out samples at) and what is wrong with it.

A bad record is not raised inside `Dataset.map` (its worker processes would lose the error's
problems): the function returns its problem as a column and `raise_record_problems` raises one
error naming the first few with the YAML path. A record whose template renders no trained token is
left out and counted (`dropped_untrained` in meta.json); none trainable at all is an error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jinja2
import numpy as np

from orchestrate.data.chat_template import (
    ChatTemplate,
    TemplateLimit,
    limit_error,
    resolve_template,
    yaml_template,
)
from orchestrate.data.method_data import MethodData
from orchestrate.data.records import (
    PREFERENCE_FORMATS,
    SFT_FORMATS,
    as_chat,
    conversational_column,
    lacks_trained_turn,
    lone_surrogate,
    record_chars,
    required_columns,
    to_sample,
    uses_chat_template,
)
from orchestrate.data.sft_tokens import TemplateNotIncremental, encode_chat, encode_completion, mask_method
from orchestrate.errors import Problem, UserError

if TYPE_CHECKING:
    from orchestrate.config.data import DataSection
    from orchestrate.config.schema import RunConfig
    from orchestrate.data.sources import Source
    from orchestrate.data.tokenizer import Tokenizer

MASK_FILE = "mask.bin"
TRAINED, ANSWER, REJECTED = 1, 2, 4
"""Bits of a mask.bin byte: the loss trains the token; the token is part of an answer; the token is
part of a preference pair's rejected sequence, or of an undesirable answer (a preference reader's,
orchestrate/data/method_data.py)."""
PREFERENCE_ANSWERS = "each answer after its prompt (preference)"
TEMPLATE_PROBLEM = "template: "
"""Prefix of a problem that is the template's, not the record's."""
TEMPLATE_LIMIT = "template limit: "
"""Prefix of a template's render that hit a limit (chat_template.py `TemplateLimit`)."""
_SHOWN = 5


@dataclass(frozen=True)
class SftSettings:
    """What decides a chat / instruction sample's ids and mask, from the data section."""

    data: DataSection
    template: ChatTemplate | None
    """The YAML's chat template (None: the tokenizer's own, if the records need one)."""
    methods: MethodData
    """What the run's methods bring: readers of their own records, which decide the record format
    the data must have and tokenise those records (no part of `identity`: the reader's tokens are
    the record's, whichever run reads them)."""
    chars: int | None = None
    """The record budget (records.py `record_chars` of train.seq_len); None: no cut."""

    @classmethod
    def of(cls, config: RunConfig, methods: MethodData) -> SftSettings:
        return cls(config.data, yaml_template(config), methods, record_chars(config.train.seq_len))

    def identity(self) -> dict[str, Any]:
        d = self.data
        return {"record_format": d.record_format, "columns": d.columns.model_dump(), "roles": dict(sorted(d.roles.items())),
                "chat_template": self.template.source if self.template else None,
                "train_on_inputs": d.train_on_inputs, "roles_to_train": list(d.roles_to_train), "record_chars": self.chars, "version": 3}

    def template_for(self, record_format: str, tokenizer: Tokenizer, conversational: bool = False) -> ChatTemplate | None:
        """The template the records of `record_format` render with (records.py `uses_chat_template`:
        prompt-completion, Alpaca and text preference records only when the YAML names one; None: raw
        text); a chat (or records of messages: `conversational`) with the byte tokenizer or no template
        is an error."""
        if not uses_chat_template(record_format, self.template is not None, conversational):
            return None
        if record_format != "chat" and not conversational:
            return self.template
        hf = getattr(tokenizer, "tok", None)
        if hf is None:
            raise UserError("chat records need a Hugging Face tokenizer", [Problem(
                "data.tokenizer", "the built-in byte tokenizer has no special tokens for a chat template's turns",
                "set data.tokenizer to the model's tokenizer directory (`orchestrate tokenizer train` makes one "
                "with data.chat_template's special tokens)")])
        return resolve_template(self.template, hf)

    def mask_method(self, template: ChatTemplate | None, record_format: str = "chat") -> str:
        if record_format in PREFERENCE_FORMATS:
            return PREFERENCE_ANSWERS
        return mask_method(template, self.data.roles_to_train, self.data.train_on_inputs)


def _is_list(feature) -> bool:
    import datasets

    return isinstance(feature, (list, datasets.Sequence, getattr(datasets, "List", ()), getattr(datasets, "LargeList", ())))


def _is_text(feature) -> bool:
    import datasets

    return isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")


def _is_bool(feature) -> bool:
    import datasets

    return isinstance(feature, datasets.Value) and feature.dtype == "bool"


def is_conversational(ds, record_format: str, data: DataSection) -> bool:
    """Prompt-completion or preference records whose prompt or answers are lists of messages (they need a
    chat template; records.py `conversational_column`)."""
    column = conversational_column(record_format, data)
    return column is not None and column in ds.features and _is_list(ds.features[column])


def check_sft_columns(ds, source: Source, record_format: str, data: DataSection) -> None:
    """The record format's columns exist and have the right kind (a list of messages, text)."""
    columns = ds.column_names
    wanted = required_columns(record_format, columns, data)
    missing = [c for c in wanted if c not in columns]
    where = "data.columns" if data.record_format == "auto" else "data.record_format"
    if missing:
        raise UserError(f"{source.describe()} has no column {missing[0]!r} for {record_format} records", [Problem(
            where, f"{record_format} records need {', '.join(map(repr, wanted))}; {source.describe()} has {columns}",
            "name the columns in data.columns (e.g. {messages: conversations}) or set data.record_format")])
    for name in wanted:
        feature = ds.features[name]
        if name == data.columns.label and record_format == "unpaired-preference":
            ok, kind = _is_bool(feature), "true / false"
        else:
            ok = _is_list(feature) if record_format == "chat" else (_is_text(feature) or (
                record_format in ("prompt-completion", *PREFERENCE_FORMATS) and _is_list(feature)))
            kind = "a list of messages" if record_format == "chat" else "text"
        if not ok:
            raise UserError(f"{source.describe()}: column {name!r} is not {kind}", [Problem(
                f"data.columns ({record_format} records)", f"column {name!r} of {source.describe()} holds {feature}",
                f"point data.columns at the column holding {kind}, or set data.record_format: text for plain text")])


def _encode(record: dict, record_format: str, settings: SftSettings, template: ChatTemplate | None,
            tokenizer: Tokenizer) -> tuple[Any, str | None, bool]:
    """(the record encoded, None, whether it was cut at the record budget) or (None, what is wrong, ...)."""
    data = settings.data
    sample, problem = to_sample(record, record_format, data, settings.chars)
    if sample is None:
        return None, problem, False
    if template is not None:
        sample = as_chat(sample, record, record_format, data)
    if sample.messages is None:
        return encode_completion(getattr(tokenizer, "tok", None), sample.prompt, sample.completion,
                                 tokenizer.eos_id), None, sample.cut
    if not data.train_on_inputs and lacks_trained_turn(sample.messages, list(data.roles_to_train)):
        return None, f"it has no {' or '.join(data.roles_to_train)} turn to train on", sample.cut
    try:
        return encode_chat(tokenizer.tok, template, sample.messages, list(data.roles_to_train),
                           data.train_on_inputs, settings.chars), None, sample.cut
    except TemplateNotIncremental as exc:
        return None, TEMPLATE_PROBLEM + str(exc), sample.cut
    except TemplateLimit as exc:
        return None, TEMPLATE_LIMIT + str(exc), sample.cut
    except jinja2.TemplateError as exc:  # the template's own raise_exception ("roles must alternate", ...)
        return None, f"the chat template refused it: {exc}", sample.cut


def _tokens(record: dict, record_format: str, settings: SftSettings, template: ChatTemplate | None,
            tokenizer: Tokenizer) -> tuple[tuple[list[int], np.ndarray] | None, str | None, bool]:
    """(ids, mask.bin bits) of one record, None when it trains nothing; or (None, what is wrong); and
    whether its text was cut at the record budget."""
    surrogate = lone_surrogate(record)
    if surrogate is not None:
        return None, f"its text holds the lone surrogate {surrogate}, which is no character", False
    reader = settings.methods.reader(record_format)
    if reader is not None:  # a method's own records (preference pairs)
        return (*reader.tokens(record, record_format, settings.data, template, tokenizer), False)
    encoded, problem, cut = _encode(record, record_format, settings, template, tokenizer)
    if encoded is None or not any(encoded.mask):
        return None, problem, cut
    return (encoded.ids, TRAINED * np.asarray(encoded.mask) + ANSWER * np.asarray(encoded.answer)), None, cut


def tokenize_records(batch: dict, indices: list[int], *, tokenizer: Tokenizer, settings: SftSettings,
                     record_format: str, template: ChatTemplate | None, dtype: str) -> dict:
    """`Dataset.map` function (batched, with_indices): one row per record: its ids and mask (empty
    when it has a problem or trains nothing), its problem ("" when none) and whether it was cut."""
    ids_out, mask_out, problems, cuts = [], [], [], []
    for row, index in enumerate(indices):
        tokens, problem, cut = _tokens({k: v[row] for k, v in batch.items()}, record_format, settings, template,
                                       tokenizer)
        ids_out.append(np.asarray(tokens[0] if tokens else [], dtype=dtype))
        mask_out.append(np.asarray(tokens[1] if tokens else [], dtype=np.uint8))
        problems.append("" if problem is None else problem if problem.startswith((TEMPLATE_PROBLEM, TEMPLATE_LIMIT))
                        else f"record {index}: {problem}")
        cuts.append(cut)
    return {"input_ids": ids_out, "mask": mask_out, "problem": problems, "cut": cuts}


def raise_record_problems(problems: list[str], source: Source, record_format: str, template: ChatTemplate | None) -> None:
    """One error for the records of `source` that cannot be trained on (none: returns)."""
    if not problems:
        return
    limit = next((p for p in problems if p.startswith(TEMPLATE_LIMIT)), None)
    if limit is not None:
        raise limit_error(template, limit[len(TEMPLATE_LIMIT):])
    if any(p.startswith(TEMPLATE_PROBLEM) for p in problems):
        first = next(p for p in problems if p.startswith(TEMPLATE_PROBLEM))[len(TEMPLATE_PROBLEM):]
        raise UserError("the chat template's trained tokens cannot be found", [Problem(
            "data.chat_template", f"{template.origin if template else 'the template'}: {first}, so the answers' "
            "tokens cannot be found by rendering the conversation turn by turn",
            "render message.content in every assistant turn and wrap it (with its end-of-turn token) in "
            "{% generation %} ... {% endgeneration %}, or use a named template (chatml, llama-3, mistral, phi-3, gemma)")])
    shown = "; ".join(problems[:_SHOWN]) + (f"; and {len(problems) - _SHOWN} more" if len(problems) > _SHOWN else "")
    raise UserError(f"{len(problems)} {record_format} record(s) of {source.describe()} cannot be trained on", [Problem(
        source.where, shown, "fix or remove those records (data.roles maps other role names; "
        "data.columns other column names)")])


def raise_nothing_trainable(source: Source, record_format: str, template: ChatTemplate | None, method: str) -> None:
    where = "data.chat_template" if template is not None else "data.roles_to_train"
    raise UserError("no record has a token to train on", [Problem(
        where, f"every {record_format} record of {source.describe()} renders no trained token "
        f"({method}{', template: ' + template.origin if template else ''})",
        "check that the template renders each message's content (message.content) inside the assistant turns, "
        "and that data.roles_to_train names roles the records have")])


def sft_meta(infos: list[dict], sources: list[Source], dropped: int, cut: int = 0) -> dict:
    """meta.json's account of chat / instruction records (all sources of a stream share one format)."""
    formats = sorted({info["record_format"] for info in infos})
    if len(formats) > 1:
        raise UserError("the sources hold records of different formats", [Problem(
            sources[0].where, f"{', '.join(s.describe() for s in sources)} hold {' and '.join(formats)} records",
            "train on one record format at a time (data.record_format names it)")])
    first = infos[0]
    if not is_sft(first["record_format"]):
        return {"record_format": first["record_format"]}
    template = first["template"]
    return {"record_format": first["record_format"], "mask_method": first["mask_method"],
            "template_origin": template.origin if template else None,
            "records": sum(info["records"] for info in infos), "dropped_untrained": dropped, "records_cut": cut}


def is_sft(record_format: str) -> bool:
    """Records with a loss mask (mask.bin): chat, instruction and preference records."""
    return record_format in SFT_FORMATS or record_format in PREFERENCE_FORMATS
