"""GRPO's prompts (docs/grpo.md): records with a `prompt` (data.columns.prompt), a string or a list of
chat messages, and any other columns the rewards read (an answer to match). They are the method's own
data (orchestrate/data/method_data.py `OwnData`): the token pipeline's cache holds ids, not the
columns a reward reads, and a prompt's completion does not exist until the policy samples it.

Read from data.train_files / data.validation_files (JSON lines; without validation files
data.validation_ratio of the records is held out, seeded). A prompt is rendered as TRL renders it
(`maybe_apply_chat_template`): messages with the chat template and its generation prompt; a string
with data.chat_template as one user turn, else as it is (with the tokenizer's BOS). A batch is the
records' positions (`prompt_index`); the objective renders and samples them (objective.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from orchestrate.config.schema import RunConfig
from orchestrate.data.method_data import OwnData
from orchestrate.data.pipeline import TrainData
from orchestrate.data.records import lone_surrogate, normalise_messages
from orchestrate.data.sampler import DistributedBlockSampler
from orchestrate.data.sources import sniff
from orchestrate.data.tokenizer import load_tokenizer
from orchestrate.data.tokenizer_choice import tokenizer_dir_of
from orchestrate.errors import Problem, UserError

if TYPE_CHECKING:
    import torch

    from orchestrate.planner.plan import RunPlan

WHERE = "data.train_files"


def _read(config: RunConfig, entries: list[str], where: str) -> list[dict[str, Any]]:
    """Every record of the files, each line checked where it is read (data/sources.py `sniff`: a
    regular file of UTF-8 text; one JSON object per line)."""
    records = []
    for entry in entries:
        path = config.resolve_path(entry)
        paths = sorted(path.parent.glob(path.name)) if any(ch in path.name for ch in "*?[") else [path]
        for p in paths:
            if not p.exists():
                raise UserError("GRPO prompts not found", [Problem(where, f"{p} does not exist",
                                                                   "give JSON-lines files of prompt records")])
            unfit = sniff(p, "json")
            if unfit is not None:
                raise UserError("GRPO prompts cannot be read", [Problem(where, unfit,
                                                                        "give JSON-lines files of prompt records")])
            for n, line in enumerate(p.read_bytes().splitlines(), 1):
                if line.strip():
                    records.append(_record(line, p, n, where))
    return records


def _record(line: bytes, path: Path, n: int, where: str) -> dict[str, Any]:
    try:
        record = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise UserError("GRPO prompts are not UTF-8", [Problem(
            where, f"{path} line {n}: byte {exc.start} ({line[exc.start]:#04x}) is no UTF-8 character",
            "save the file as UTF-8 (convert it with iconv)")]) from None
    except json.JSONDecodeError as exc:
        raise UserError("GRPO prompts are not JSON lines", [Problem(
            where, f"{path} line {n}: {exc}", "one JSON object per line")]) from None
    if not isinstance(record, dict):
        raise UserError("GRPO prompts are not JSON objects", [Problem(
            where, f"{path} line {n} holds {type(record).__name__}, not an object",
            '{"prompt": ..., "answer": ...}: one JSON object per line')])
    surrogate = lone_surrogate(record)
    if surrogate is not None:
        raise UserError("a GRPO prompt holds no text", [Problem(
            where, f"{path} line {n} holds the lone surrogate {surrogate} (a \\u escape without its pair), "
            "which no tokenizer encodes", "write the character itself, or both halves of its surrogate pair")])
    return record


def _check(records: list[dict[str, Any]], config: RunConfig, where: str) -> None:
    prompt, columns = config.data.columns.prompt, {r.column for r in config.grpo.rewards if r.column}
    for n, record in enumerate(records):
        missing = [c for c in (prompt, *sorted(columns)) if c not in record]
        what = None
        if missing or not isinstance(record[prompt], str | list):
            what = f"has no {missing}" if missing else f"its {prompt!r} is neither text nor messages"
        elif isinstance(record[prompt], list):
            wrong = normalise_messages(record[prompt], config.data)[1]
            what = f"its {prompt!r} messages: {wrong}" if wrong else None
        if what is not None:
            raise UserError("a GRPO record cannot be used", [Problem(
                where, f"record {n} {what}", f"every record needs {prompt!r} (text or chat messages) and the "
                "columns the rewards read")])


def load_prompts(config: RunConfig) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training, validation) records, checked."""
    d = config.data
    if not d.train_files:
        raise UserError("GRPO needs prompt records", [Problem(
            WHERE, "grpo reads its prompts from JSON-lines files", "set data.train_files")])
    train = _read(config, d.train_files, WHERE)
    if d.validation_files:
        validation = _read(config, d.validation_files, "data.validation_files")
    else:
        order = np.random.default_rng([config.train.seed, 1]).permutation(len(train))
        held = min(len(train) - 1, int(round(d.validation_ratio * len(train))))
        validation = [train[i] for i in sorted(order[:held])]
        train = [train[i] for i in sorted(order[held:])]
    _check(train, config, WHERE)
    _check(validation, config, "data.validation_files")
    return train, validation


def render_prompt(prompt: str | list, config: RunConfig, tokenizer: Any, template: Any) -> list[int]:
    """A prompt's ids (module docstring): `tokenizer` the run's (orchestrate/data/tokenizer.py),
    `template` the chat template of message prompts (data.chat_template's, else the tokenizer's)."""
    hf = getattr(tokenizer, "tok", None)
    # a string is one user turn only where the YAML names a template (records.py `uses_chat_template`, as
    # for a prompt-completion record's prompt): the tokenizer's own template is for messages
    if isinstance(prompt, str) and (template is None or config.data.chat_template is None):
        return list(tokenizer.encode(prompt)) if hf is None else hf(prompt)["input_ids"]
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else \
        normalise_messages(prompt, config.data)[0]
    if messages is None or hf is None or template is None:
        raise UserError("a GRPO prompt cannot be rendered", [Problem(
            WHERE, f"{prompt!r:.120}: chat messages need a Hugging Face tokenizer and a chat template",
            "give {role, content} messages, the model's tokenizer (data.tokenizer) and a chat template, or "
            "plain-text prompts")])
    text = hf.apply_chat_template(messages, chat_template=template.source, tokenize=False, add_generation_prompt=True)
    return hf(text, add_special_tokens=False)["input_ids"]


@dataclass
class PromptSamples:
    """Records as the sampler's samples: `.batch` names their positions; `records` hold the columns."""

    records: list[dict[str, Any]]
    seq_len: int

    def __len__(self) -> int:
        return len(self.records)

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self.records), self.seq_len)

    def batch(self, positions: list[int]) -> dict[str, torch.Tensor]:
        """The records' positions, and labels of one ignored position (the step's loss_tokens count
        nothing before the completions exist)."""
        import torch

        index = torch.as_tensor(list(positions), dtype=torch.long)
        return {"prompt_index": index, "labels": torch.full((len(index), 1), -100, dtype=torch.long)}


def check_prompts(config: RunConfig) -> None:
    load_prompts(config)


def describe_prompts(config: RunConfig) -> str:
    train, validation = load_prompts(config)
    return (f"data: {len(train):,} prompts / {len(validation):,} held out, {config.grpo.num_generations} "
            f"completions each of at most {config.grpo.max_completion_length} tokens")


def prompt_data(plan: RunPlan, rank: int, world_size: int) -> TrainData:
    config = plan.config
    train, validation = load_prompts(config)
    if len(train) < world_size:
        raise UserError("not enough prompts", [Problem(WHERE, f"{len(train)} prompts for {world_size} ranks",
                                                       "give at least one prompt per rank")])
    directory = tokenizer_dir_of(config)
    tokenizer = load_tokenizer(directory, trust_remote_code=config.model.trust_remote_code)
    sampler = DistributedBlockSampler(len(train), rank, world_size, config.train.seed)
    seq_len = config.train.seq_len
    return TrainData(tokenizer, PromptSamples(train, seq_len), PromptSamples(validation, seq_len), sampler,
                     tokenizer_dir=directory)


def data_path(config: RunConfig) -> OwnData:
    return OwnData(check_prompts, describe_prompts, prompt_data)
