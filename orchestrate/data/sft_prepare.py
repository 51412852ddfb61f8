"""Chat and instruction records into the cache: the settings that decide ids and masks (part of the
cache key), the column checks, and the `Dataset.map` function that writes each record's ids, its
loss mask (entry/mask.bin, one uint8 per token: TRAINED, plus ANSWER on the answers, which evaluation
cuts held-out samples at) and what is wrong with it.

The sources of one stream render alike (`render_parts`): chat and instruction records of different
formats mix (prompt-completion and Alpaca records become one user and one assistant turn of the chat
template when any source is a chat, as LLaMA-Factory renders every format through one template);
text, preference pairs or labelled answers beside other records are one error naming both files.

A bad record is not raised inside `Dataset.map` (its worker processes would lose the error's
problems): the function returns its problem as a column and `raise_record_problems` raises one
error naming the first few with the YAML path. A record whose template renders no trained token is
left out and counted (`dropped_untrained` in meta.json); none trainable at all is an error.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
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
    cuts_from_left,
    detect_format,
    lacks_trained_turn,
    lone_surrogate,
    record_chars,
    required_columns,
    stream_format,
    to_sample,
    uses_chat_template,
)
from orchestrate.data.sft_tokens import TemplateNotIncremental, encode_chat, encode_completion, mask_method
from orchestrate.errors import Problem, UserError

if TYPE_CHECKING:
    from orchestrate.config.data import DataSection
    from orchestrate.config.schema import RunConfig
    from orchestrate.data.reading import Part
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
        """The cache key's part: what decides the ids and masks. Of `data.truncation` only the side the
        record budget cuts from (records.py `cuts_from_left`), named only when it is the left: the
        entries made before keep_answer, and the runs that resume on them, keep their key."""
        d = self.data
        left = {"record_cut_from_left": True} if cuts_from_left(d) else {}
        identity = {"record_format": d.record_format, "columns": d.columns.model_dump(),
                    "roles": dict(sorted(d.roles.items())), "chat_template": self.template.source if self.template else None,
                    "train_on_inputs": d.train_on_inputs, "roles_to_train": list(d.roles_to_train),
                    "record_chars": self.chars, "system_prompt": d.system_prompt,
                    **left, "version": 4,
                    **({"last_turn_only": True} if d.last_turn_only else {})}  # absent when off: the keys made before it stay
        if d.datasets:  # each source's own reading of its records
            identity["datasets"] = [{"record_format": e.record_format, "system_prompt": e.system_prompt,
                                     "columns": e.columns.model_dump(exclude_unset=True) if e.columns else None}
                                    for e in d.datasets]
        return identity

    def for_source(self, listed: int | None) -> SftSettings:
        """These settings as entry `listed` of data.datasets reads its records (`DataSection.for_source`)."""
        return self if listed is None else replace(self, data=self.data.for_source(listed))

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
        return mask_method(template, self.data.roles_to_train, self.data.train_on_inputs, self.data.last_turn_only)


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
        # keep_answer keeps a conversation's end, its turns already bounded (records.py `to_sample`): every
        # turn is split; the others keep its start, split only as far as the record budget reaches
        upto = None if cuts_from_left(data) else settings.chars
        return encode_chat(tokenizer.tok, template, sample.messages, list(data.roles_to_train),
                           data.train_on_inputs, upto, data.last_turn_only), None, sample.cut
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
            "{% generation %} ... {% endgeneration %}, or use a named template (chatml, llama-3, mistral, phi-3, gemma, zephyr, alpaca)")])
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


@dataclass(frozen=True)
class Rendering:
    """How one part of a stream becomes documents."""

    record_format: str
    settings: SftSettings | None = None
    """Its source's settings (None: plain text of a task without records)."""
    template: ChatTemplate | None = None


def render_parts(parts: list[Part], settings: SftSettings, tokenizer: Tokenizer) -> tuple[str, list[Rendering]]:
    """The stream's record format (records.py `stream_format`) and how each part renders: each part's
    format detected from its own columns (its source's settings), checked by the run's methods; every
    chat and instruction part through the chat template when any one needs it."""
    own = [settings.for_source(part.source.listed) for part in parts]
    formats = [detect_format(part.ds.column_names, s.data) for part, s in zip(parts, own, strict=True)]
    native = [uses_chat_template(f, s.template is not None, is_conversational(part.ds, f, s.data))
              for part, f, s in zip(parts, formats, own, strict=True)]
    templated = any(n and f in SFT_FORMATS for f, n in zip(formats, native, strict=True))
    record_format = stream_format(formats, templated)
    if record_format is None:
        raise _unmixable(parts, formats)
    renderings = []
    for part, f, s, n in zip(parts, formats, own, native, strict=True):
        if f not in SFT_FORMATS and s.data.system_prompt is not None:
            raise _system_prompt_unused(part.source, f, settings.data)
        settings.methods.check_records(f, part.source.where)
        if not is_sft(f):
            renderings.append(Rendering(f, s))
            continue
        check_sft_columns(part.ds, part.source, f, s.data)
        conversational = is_conversational(part.ds, f, s.data)
        as_chat_too = templated and f in SFT_FORMATS and not n  # an instruction record in a chat stream
        renderings.append(Rendering(f, s, s.template_for("chat" if as_chat_too else f, tokenizer, conversational)))
    return record_format, renderings


def _system_prompt_unused(source: Source, record_format: str, data: DataSection) -> UserError:
    listed = source.listed
    own = listed is not None and data.datasets[listed].system_prompt is not None
    return UserError("a system prompt is given for records without turns", [Problem(
        f"data.datasets[{listed}].system_prompt" if own else "data.system_prompt",
        f"{source.describe()} holds {record_format} records; a default system prompt is the first turn of chat, "
        "prompt-completion and Alpaca records only",
        "remove it (preference records of messages carry their own system turn in the prompt)")])


def _unmixable(parts: list[Part], formats: list[str]) -> UserError:
    """The error of a stream whose parts hold records of losses that differ, naming the first two."""
    other = next(k for k, f in enumerate(formats) if stream_format([formats[0], f], False) is None)
    a, b = parts[0].source, parts[other].source
    pair = {formats[0], formats[other]}
    why = ("preference records train with a preference loss, other records with the next-token loss"
           if pair & set(PREFERENCE_FORMATS) else
           "plain text trains every token of one packed stream, chat and instruction records their answers")
    return UserError("the training sources hold records that cannot share one stream", [Problem(
        b.where, f"{a.describe()} holds {formats[0]} records and {b.describe()} holds {formats[other]} records: {why}",
        "train on them in separate runs (the second from the first's output), or convert one; a source whose "
        "format was detected wrongly takes its own record_format (data.datasets[i].record_format)")])


def sft_meta(record_format: str, infos: list[dict], dropped: int, cut: int = 0, bos_id: int | None = None) -> dict:
    """meta.json's account of chat / instruction records (`record_format`: the stream's, `render_parts`);
    `bos_id`: the tokenizer's BOS token, which a sample cut from the left keeps (sft_samples.py)."""
    if not is_sft(record_format):
        return {"record_format": record_format}
    first = infos[0]
    template = first["template"]
    return {"record_format": record_format, "mask_method": first["mask_method"],
            "template_origin": template.origin if template else None,
            "records": sum(info["records"] for info in infos), "dropped_untrained": dropped, "records_cut": cut,
            "bos_id": bos_id}


def is_sft(record_format: str) -> bool:
    """Records with a loss mask (mask.bin): chat, instruction and preference records."""
    return record_format in SFT_FORMATS or record_format in PREFERENCE_FORMATS
