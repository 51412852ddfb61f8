"""From the plan's data section to packed train/validation blocks and a sampler for this rank."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from orchestrate.config.schema import RunConfig
from orchestrate.data.corpus import read_documents
from orchestrate.data.packing import pack, split_validation
from orchestrate.data.sampler import DistributedBlockSampler
from orchestrate.data.tokenizer import Tokenizer, load_tokenizer
from orchestrate.errors import Problem, UserError

if TYPE_CHECKING:
    from orchestrate.planner.plan import Plan

DEMO_CORPUS_ROLE = "demo_corpus"
"""plan.files role of the generated corpus the launcher writes into the run directory."""


@dataclass
class TrainData:
    tokenizer: Tokenizer
    train: torch.Tensor
    """[num_blocks, seq_len] int64."""
    validation: torch.Tensor
    """[num_blocks, seq_len] int64; may have zero rows (no evaluation)."""
    sampler: DistributedBlockSampler
    tokenizer_dir: Path | None = None
    """The Hugging Face tokenizer directory, None for the built-in byte tokenizer."""

    def micro_batch(self, size: int) -> dict[str, torch.Tensor]:
        """This rank's next `size` blocks; labels = input_ids (the model shifts them)."""
        ids = self.train[self.sampler.take(size)]
        return {"input_ids": ids, "labels": ids.clone()}

    def eval_batches(self, size: int, count: int, rank: int, world_size: int) -> list[dict[str, torch.Tensor]]:
        """`count` fixed micro-batches of this rank's strided share of the validation blocks
        (the same ones at every evaluation, so eval losses are comparable across steps)."""
        n = self.validation.shape[0]
        if n == 0:
            return []
        order = [(rank + world_size * i) % n for i in range(size * count)]
        out = []
        for b in range(count):
            ids = self.validation[order[b * size : (b + 1) * size]]
            out.append({"input_ids": ids, "labels": ids.clone()})
        return out


def data_sources(config: RunConfig, plan_files: dict[str, str], plan_dir: Path) -> list[tuple[Path, str]]:
    """(path, config key) of every training file, the demo corpus included (`check_data_config`
    has made sure there is one or the other)."""
    if config.data.train_files:
        return [(config.resolve_path(p), f"data.train_files[{i}]") for i, p in enumerate(config.data.train_files)]
    if DEMO_CORPUS_ROLE not in plan_files:
        raise UserError("the plan has no demo corpus", [Problem(
            "data.generate_demo_corpus", "plan.json lists no generated corpus",
            "create the run with `orchestrate launch` or `orchestrate config`, which write it")])
    return [(plan_dir / plan_files[DEMO_CORPUS_ROLE], "data.generate_demo_corpus")]


def check_data_config(config: RunConfig, max_positions: int, vocab_size: int) -> None:
    """Cheap checks the launcher runs before starting workers: files exist, lengths and vocab fit."""
    problems = []
    data = config.data
    for key, paths in (("data.train_files", data.train_files), ("data.validation_files", data.validation_files)):
        for i, p in enumerate(paths):
            path = config.resolve_path(p)
            if not path.is_file():
                problems.append(Problem(f"{key}[{i}]", f"{path} does not exist",
                                        "relative paths are resolved against the YAML file's directory"))
            elif path.suffix not in (".txt", ".jsonl"):
                problems.append(Problem(f"{key}[{i}]", f"unsupported file type {path.suffix!r}",
                                        "use .txt or .jsonl"))
    if not data.train_files and not data.generate_demo_corpus:
        problems.append(Problem("data.train_files", "no training files given",
                                "list files under data.train_files, or set data.generate_demo_corpus: true"))
    if config.train.seq_len > max_positions:
        problems.append(Problem("train.seq_len", f"{config.train.seq_len} is longer than the model's "
                                f"{max_positions} positions", f"use train.seq_len <= {max_positions}"))
    if data.tokenizer is None and vocab_size < 257:
        problems.append(Problem("data.tokenizer", f"the built-in byte tokenizer needs 257 ids but the model "
                                f"has vocab_size {vocab_size}", "set data.tokenizer to the model's tokenizer"))
    if problems:
        raise UserError("the data section cannot be used with this model", problems)


def build_data(plan: Plan, plan_dir: Path, rank: int, world_size: int) -> TrainData:
    """Tokenise, pack and split the plan's data; every rank does it (cheap at this scale) and
    gets a sampler over its share. `plan_dir` resolves `plan.files` paths."""
    config, vocab_size = plan.config, plan.shape.vocab_size
    check_data_config(config, plan.shape.max_position_embeddings, vocab_size)
    data = config.data
    tokenizer_dir = config.resolve_path(data.tokenizer) if data.tokenizer else None
    tokenizer = load_tokenizer(tokenizer_dir)
    if tokenizer.vocab_size > vocab_size:
        raise UserError("the tokenizer does not fit the model", [Problem(
            "data.tokenizer", f"tokenizer has {tokenizer.vocab_size} ids, the model's vocab_size is {vocab_size}",
            "use the model's own tokenizer")])
    seq_len = config.train.seq_len

    def blocks(sources: list[tuple[Path, str]]) -> torch.Tensor:
        docs = (tokenizer.encode(doc) for path, where in sources
                for doc in read_documents(path, data.text_field, where))
        return pack(docs, tokenizer.eos_id, seq_len)

    train_sources = data_sources(config, plan.files, plan_dir)
    train = blocks(train_sources)
    if data.validation_files:
        validation = blocks([(config.resolve_path(p), f"data.validation_files[{i}]")
                             for i, p in enumerate(data.validation_files)])
    else:
        train, validation = split_validation(train, data.validation_ratio, config.train.seed)
    if train.shape[0] < world_size:
        names = ", ".join(str(p) for p, _ in train_sources)
        raise UserError("not enough training data", [Problem(
            train_sources[0][1], f"{names} give {train.shape[0]} block(s) of {seq_len} tokens, "
            f"fewer than the {world_size} ranks", "add data or lower train.seq_len")])
    sampler = DistributedBlockSampler(train.shape[0], rank, world_size, config.train.seed)
    return TrainData(tokenizer, train, validation, sampler, tokenizer_dir)
