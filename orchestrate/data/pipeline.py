"""From the data section to samples for this rank: check, prepare once (cached), map, split, sample.

    check_data_config(config, max_positions, vocab_size)   cheap launcher-side checks, no data read
    prepare_data(config, ...) -> PreparedData              tokenise into the cache, or find it there
    build_data(plan, plan_dir, rank, world, local_rank, sequence)    the worker's entry point -> TrainData

The launcher calls `prepare_data` before it starts the workers, so workers normally only map the
cache entry. A worker that finds no entry (a job started by hand or by SLURM without `orchestrate
prepare`) builds it on local rank 0 while the node's other ranks wait for it to appear.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrate.config.schema import RunConfig
from orchestrate.data.blocks import LabelledDocuments, PackedBlocks, PaddedDocuments, Subset, split_ids
from orchestrate.data.cache import TokenStream, cache_dir_of, check_ids
from orchestrate.data.checks import ensure_cache_dir, require_training_samples, too_long
from orchestrate.data.corpus import write_demo_corpus
from orchestrate.data.doc_labels import label_ids, read_labels
from orchestrate.data.identity import check_same_data, data_identity
from orchestrate.data.method_data import NO_METHOD_DATA, MethodData
from orchestrate.data.mixing import Mix, mix_line
from orchestrate.data.mlm import MLMMasker, mask_token_id
from orchestrate.data.prepare import TextSpec, ensure_stream
from orchestrate.data.sampler import DistributedBlockSampler
from orchestrate.data.sequence_slices import sequence_slice
from orchestrate.data.sft_prepare import SftSettings, is_sft
from orchestrate.data.sft_samples import PackedSamples, PaddedSamples, SampleView, describe_sft, sft_views
from orchestrate.data.sources import DataSources, check_entries, resolve_sources
from orchestrate.data.tokenizer import BYTE_VOCAB, Tokenizer, load_tokenizer
from orchestrate.data.tokenizer_choice import tokenizer_dir_of
from orchestrate.errors import Problem, UserError
from orchestrate.loading.labels import check_num_labels, configured_num_labels
from orchestrate.loading.packed_attention import varlen_ready
from orchestrate.model.meta import config_dict, shape_for

if TYPE_CHECKING:  # torch only in annotations: `orchestrate prepare` and cache hits never import it
    import numpy as np
    import torch

    from orchestrate.config.train import TrainSection
    from orchestrate.planner.plan import RunFiles, RunPlan

    Samples = PackedBlocks | PaddedDocuments | SampleView
    """A method's records are viewed as `SampleView`s too (orchestrate/data/method_data.py)."""

__all__ = ["PreparedData", "TrainData", "build_data", "check_data_config", "prepare_data"]

TOKENIZER_MEMO_SUBDIR = "tokenizers"
"""Under the data cache: each HF tokenizer's vocab_size and EOS id by file hash (`HFTokenizer`)."""


@dataclass
class TrainData:
    tokenizer: Tokenizer
    train: Samples
    """Training samples: `.shape` is (count, seq_len), `.batch(positions)` gives tensors."""
    validation: Samples
    """Validation samples; may be empty (no evaluation)."""
    sampler: DistributedBlockSampler
    tokenizer_dir: Path | None = None
    """The Hugging Face tokenizer directory, None for the built-in byte tokenizer."""
    label_names: list[str] | None = None
    """sequence-classification: the class names, id i is label_names[i]."""
    masker: MLMMasker | None = None
    """masked-lm: masks each batch (orchestrate.data.mlm)."""
    sequence: tuple[int, int] | None = None
    """Sequence parallelism: (this rank's slice, slices per sequence); each batch is cut to the slice
    (orchestrate/data/sequence_slices.py). The sampler is then keyed by the data-parallel rank."""

    def micro_batch(self, size: int) -> dict[str, torch.Tensor]:
        """This rank's next `size` samples: input_ids and labels (the model shifts them), plus
        attention_mask when packing is off; under sequence parallelism this rank's slice of them.
        Every rank must call it with the same size."""
        place = (0, self.sampler.epoch, self.sampler.position, self.sampler.rank)  # before take() moves it
        batch = self.train.batch(self.sampler.take(size))
        return self._sliced(self.masker(batch, place) if self.masker else batch)

    def _sliced(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return sequence_slice(batch, *self.sequence) if self.sequence else batch

    def blocks_read(self, train: TrainSection) -> np.ndarray:
        """The training samples a run of `train.max_steps` steps reads, sorted: the first max_steps x
        global_batch_size positions of the sampler's seeded stream, known before step 1 (what a
        precomputed teacher or reference covers)."""
        return self.sampler.blocks_read(train.max_steps * train.global_batch_size)

    def eval_batches(self, size: int, count: int, rank: int, world_size: int) -> list[dict[str, torch.Tensor]]:
        """`count` fixed micro-batches of this rank's strided share of the validation samples
        (the same ones at every evaluation, so eval losses are comparable across steps); `rank` and
        `world_size` are the data-parallel ones (`Rank.data_rank`), each batch sliced as `micro_batch`'s."""
        n = len(self.validation)
        if n == 0:
            return []
        order = [(rank + world_size * i) % n for i in range(size * count)]
        batches = [self.validation.batch(order[b * size: (b + 1) * size]) for b in range(count)]
        if self.masker:
            batches = [self.masker(b, (1, i, rank)) for i, b in enumerate(batches)]
        return [self._sliced(b) for b in batches]


@dataclass
class PreparedData:
    sources: DataSources
    train: TokenStream
    validation: TokenStream | None
    tokenized: list[str] = field(default_factory=list)
    """"train" / "validation" for each stream this call tokenised; empty on a full cache hit."""
    seconds: float = 0.0


def check_data_config(config: RunConfig, max_positions: int, vocab_size: int,
                      methods: MethodData = NO_METHOD_DATA) -> None:
    """Cheap checks the launcher runs before starting workers: files exist, lengths and vocab fit
    (`methods`: what the run's methods bring, data of their own checked by them)."""
    data = config.data
    if methods.own is not None:
        return methods.own.check(config)
    problems = check_entries(config)
    if not (data.train_files or data.datasets or data.dataset or data.generate_demo_corpus):
        problems.append(Problem("data.train_files", "no training files given",
                                "list files under data.train_files (or sources under data.datasets), name a dataset "
                                "in data.dataset, or set data.generate_demo_corpus: true"))
    if config.train.seq_len > max_positions:
        problems.append(Problem("train.seq_len", f"{config.train.seq_len} is longer than the model's "
                                f"{max_positions} positions", f"use train.seq_len <= {max_positions}"))
    if tokenizer_dir_of(config) is None and vocab_size < BYTE_VOCAB:
        problems.append(Problem("data.tokenizer", f"the built-in byte tokenizer needs {BYTE_VOCAB} ids but the model "
                                f"has vocab_size {vocab_size}", "set data.tokenizer to the model's tokenizer"))
    try:
        text_spec(config, methods).fields()
    except UserError as exc:
        problems += exc.problems
    if problems:
        raise UserError("the data section cannot be used with this model", problems)


def tokenizer_for(config: RunConfig, vocab_size: int | None = None) -> tuple[Tokenizer, Path | None]:
    """The configured tokenizer, checked against the model's vocabulary when `vocab_size` is given."""
    tokenizer_dir = tokenizer_dir_of(config)  # data.tokenizer, else the model directory's own
    # The memo lets a cache hit skip loading an HF tokenizer (and importing transformers).
    tokenizer = load_tokenizer(tokenizer_dir, cache_dir_of(config) / TOKENIZER_MEMO_SUBDIR,
                               config.model.trust_remote_code)
    if vocab_size is not None and tokenizer.vocab_size > vocab_size:
        raise UserError("the tokenizer does not fit the model", [Problem(
            "data.tokenizer", f"tokenizer has {tokenizer.vocab_size} ids, the model's vocab_size is {vocab_size}",
            "use the model's own tokenizer, or raise the model's vocab_size")])
    return tokenizer, tokenizer_dir


def prepare_data(config: RunConfig, plan_files: RunFiles | None = None, plan_dir: Path | None = None, *,
                 tokenizer: Tokenizer | None = None, progress: bool = False, force: bool = False,
                 may_build: bool = True, methods: MethodData = NO_METHOD_DATA) -> PreparedData:
    """Tokenise the configured data into the cache (`data.cache_dir`) unless it is there already
    (`methods`: what the run's methods bring, readers of their own records)."""
    start = time.perf_counter()
    data = config.data
    cache_dir = cache_dir_of(config)
    if may_build:  # a file or a read-only directory there: one clear error before any work
        ensure_cache_dir(cache_dir)
    demo_path = None
    if data.generate_demo_corpus and not (plan_files and plan_files.demo_corpus):
        # Outside a run directory (`orchestrate prepare`): the same text as the run's copy, so the
        # content-hashed cache entry is the one the run will look up.
        demo_path = cache_dir / "demo" / f"demo_corpus_seed{config.train.seed}.txt"
        if not demo_path.is_file():
            write_demo_corpus(demo_path, config.train.seed)
    sources = resolve_sources(config, plan_files, plan_dir, demo_path)
    if tokenizer is None:
        tokenizer, _ = tokenizer_for(config)
    spec = text_spec(config, methods)
    kwargs = {"num_proc": data.num_proc, "progress": progress, "force": force, "may_build": may_build}
    train = ensure_stream(sources.train, spec, tokenizer, cache_dir, **kwargs)
    validation = ensure_stream(sources.validation, spec, tokenizer, cache_dir, **kwargs) if sources.validation else None
    for result in (train, validation):
        if result is not None:
            check_ids(result.stream, tokenizer.vocab_size)
    tokenized = [name for name, r in (("train", train), ("validation", validation)) if r is not None and r.built]
    return PreparedData(sources, train.stream, validation.stream if validation else None, tokenized,
                        time.perf_counter() - start)


def text_spec(config: RunConfig, methods: MethodData) -> TextSpec:
    labelled = config.model.task == "sequence-classification"
    sft = SftSettings.of(config, methods) if config.model.task == "causal-lm" else None  # chat / instruction records
    return TextSpec(config.data.text_field, config.data.template, config.data.label_field if labelled else None, sft,
                    Mix.of(config))


def samples_for(prepared: PreparedData, config: RunConfig, flatten: bool = False,
                methods: MethodData = NO_METHOD_DATA) -> tuple[Samples, Samples]:
    """(train, validation) views: packed blocks or padded documents, split by ratio when no
    validation data is given; for chat and instruction records whole samples packed apart
    (`flatten`: one row per micro-batch, for the flash-attention varlen path) or padded; a method's
    own records (`methods`) as its reader views them."""
    seq_len, data = config.train.seq_len, config.data
    record_format = prepared.train.meta.get("record_format", "text")
    methods.check_records(record_format, prepared.sources.train[0].where)
    if (reader := methods.reader(record_format)) is not None:
        return reader.views(prepared.train, prepared.validation, config, flatten)
    if is_sft(record_format):
        return sft_views(prepared.train, prepared.validation, config, flatten)
    view = PackedBlocks if data.packing else PaddedDocuments
    if config.model.task == "sequence-classification":
        view = labelled_view(prepared)
    if prepared.validation is not None:
        return view(prepared.train, seq_len), view(prepared.validation, seq_len)
    n = view.count(prepared.train, seq_len)
    held = split_ids(n, data.validation_ratio, config.train.seed)
    return (view(prepared.train, seq_len, Subset(n, held, keep_held_out=False)),
            view(prepared.train, seq_len, Subset(n, held, keep_held_out=True)))


def label_names(prepared: PreparedData) -> list[str]:
    return list(prepared.train.meta["label_names"])


def labelled_view(prepared: PreparedData):
    """A `LabelledDocuments` constructor for either stream, with ids in the training label names."""
    names = label_names(prepared)

    def view(stream: TokenStream, seq_len: int, subset: Subset | None = None) -> LabelledDocuments:
        ids = read_labels(stream.directory, stream.num_documents)
        if stream is not prepared.train:
            ids = label_ids(ids, stream.meta["label_names"], names, "data.validation_files")
        return LabelledDocuments(stream, seq_len, ids, subset)

    view.count = PaddedDocuments.count
    return view


def check_labels(config: RunConfig, prepared: PreparedData) -> list[str] | None:
    """The data's label names, checked against a configured num_labels (None for unlabelled tasks)."""
    if config.model.task != "sequence-classification":
        return None

    names = label_names(prepared)
    configured = configured_num_labels(config_dict(config), config.model.num_labels)
    check_num_labels(names, configured, prepared.sources.train[0].describe())
    return names


def build_data(plan: RunPlan, plan_dir: Path, rank: int, world_size: int, local_rank: int | None = None,
               sequence: tuple[int, int] | None = None, methods: MethodData = NO_METHOD_DATA) -> TrainData:
    """This rank's data. Maps the prepared cache entry; builds it first when it is missing and this
    is local rank 0 (or `local_rank` is None), else waits for it. `plan_dir` resolves `plan.files`.
    `rank` and `world_size` are the data-parallel ones (`Rank.data_rank`): under sequence parallelism
    the ranks of a group read the same samples, each keeping slice `sequence` = (index, slices) of them.
    `methods`: what the run's methods bring (readers of their own records)."""
    config = plan.config
    check_data_config(config, plan.shape.max_position_embeddings, plan.shape.vocab_size, methods)
    tokenizer, tokenizer_dir = tokenizer_for(config, plan.shape.vocab_size)
    prepared = prepare_data(config, plan.files, plan_dir, tokenizer=tokenizer, may_build=local_rank in (None, 0),
                            methods=methods)

    flatten = is_sft(prepared.train.meta.get("record_format", "text")) and varlen_ready(plan)
    train, validation = samples_for(prepared, config, flatten, methods)
    if sequence and isinstance(train, PackedSamples):
        # Packed samples are kept apart by a mask per sample or positions restarting per sample; the
        # all-to-all attention carries neither (data/sequence_slices.py).
        raise UserError("sequence parallelism cannot keep packed samples apart", [Problem(
            "data.packing", "chat and instruction samples packed into one sequence would attend to each other",
            "set data.packing: false (padded samples), or train.sequence_parallel: 1")])
    require_sample_per_rank(train, world_size, prepared, config)
    sampler = DistributedBlockSampler(len(train), rank, world_size, config.train.seed,
                                      data_identity(config, prepared.train, prepared.validation))
    masker = None
    if config.model.task == "masked-lm":
        masker = MLMMasker(mask_token_id(tokenizer, plan.shape.vocab_size), tokenizer.vocab_size,
                           tokenizer.eos_id, config.train.seed)
    return TrainData(tokenizer, train, validation, sampler, tokenizer_dir, check_labels(config, prepared), masker,
                     sequence)


def dropped_for_length(train: Samples, config: RunConfig) -> tuple[int, int, str] | None:
    """(samples kept, samples the truncation policy dropped for their length, data.truncation) of
    chat / instruction / preference samples; None for plain text (cut into blocks, nothing dropped)."""
    kept = getattr(train, "kept", None)
    return None if kept is None else (len(kept.docs), kept.dropped, config.data.truncation)


def require_sample_per_rank(train: Samples, world_size: int, prepared: PreparedData, config: RunConfig) -> None:
    samples = len(train)
    if samples < world_size:
        where = prepared.sources.train[0].where
        dropped = dropped_for_length(train, config)
        if dropped is not None and dropped[1] > 0:
            message, fix = too_long(*dropped[:2], config.train.seq_len, dropped[2])
            raise UserError("not enough training samples fit train.seq_len", [Problem(
                where, f"{message}: {samples} training sample(s) for {world_size} ranks", fix)])
        names = "; ".join(s.describe() for s in prepared.sources.train)
        unit = f"block(s) of {config.train.seq_len} tokens" if config.data.packing else "document(s)"
        raise UserError("not enough training data", [Problem(
            where, f"{names} give {samples} training {unit}, fewer than the {world_size} ranks",
            "add data or lower train.seq_len")])


def describe_prepared(prepared: PreparedData, config: RunConfig, methods: MethodData = NO_METHOD_DATA) -> str:
    """One line for people: what was tokenised or found in the cache, and what it gives (and, for
    data.datasets, what each source gave; with train.num_epochs, the steps they make: `epochs_line`)."""
    train, validation = samples_for(prepared, config, methods=methods)
    text = _describe_stream(prepared, config, methods, train, validation) + epochs_line(config, len(train))
    if "mix" not in prepared.train.meta:
        return text
    summary, cache_line, cache = text.rpartition("\n  cache: ")  # the mix before the cache's line
    mix = f"\n  {mix_line(prepared.train.meta['mix'])}"
    return summary + mix + cache_line + cache if cache_line else text + mix


def epochs_line(config: RunConfig, samples: int) -> str:
    """train.num_epochs over `samples` training samples as optimizer steps (what every worker resolves,
    worker/stages.py `resolve_steps`); empty for a run of train.max_steps."""
    train = config.train
    if train.num_epochs is None:
        return ""
    return (f"\n  {train.resolved(samples).length()} ({samples:,} training samples per epoch, "
            f"global batch {train.global_batch_size})")


def _describe_stream(prepared: PreparedData, config: RunConfig, methods: MethodData, train: Samples,
                     validation: Samples) -> str:
    if (reader := methods.reader(prepared.train.meta.get("record_format", "text"))) is not None:
        return reader.describe(prepared.train, train, validation, config, prepared.tokenized, prepared.seconds)
    if isinstance(train, PackedSamples | PaddedSamples):
        return describe_sft(prepared.train, train, validation, config, prepared.tokenized, prepared.seconds)
    unit = f"blocks of {config.train.seq_len}" if config.data.packing else "padded documents"
    how = (f"tokenised {' and '.join(prepared.tokenized)} in {prepared.seconds:.1f} s" if prepared.tokenized
           else f"cache hit ({prepared.seconds:.2f} s)")
    text = (f"data: {how}: {int(prepared.train.meta['tokens']):,} tokens in {prepared.train.num_documents:,} "
            f"documents -> {len(train):,} train / {len(validation):,} validation {unit}\n  cache: {prepared.train.directory}")
    if isinstance(train, PaddedDocuments) and train.truncated():
        text += f"\n  {train.truncated():,} documents are longer than seq_len {config.train.seq_len} and are truncated"
    return text


def prepare_for_plan(plan: RunPlan, plan_dir: Path, methods: MethodData, progress: bool = False,
                     resumed: tuple[str, dict] | None = None) -> str:
    """The launcher's step before starting workers: prepare the plan's data; returns `describe_prepared`.
    `methods`: what the run's methods bring (data of their own, described by them; readers of their
    own records). `resumed`: (the checkpoint the workers continue from, the data identity it
    recorded): data that changed since is refused here, before any worker starts."""
    if methods.own is not None:
        return methods.own.describe(plan.config)
    tokenizer, _ = tokenizer_for(plan.config, plan.shape.vocab_size)
    prepared = prepare_data(plan.config, plan.files, plan_dir, tokenizer=tokenizer, progress=progress,
                            methods=methods)
    check_labels(plan.config, prepared)  # before any worker starts
    train, validation = samples_for(prepared, plan.config, methods=methods)
    require_sample_per_rank(train, plan.world_size, prepared, plan.config)
    check_eval_generate(plan.config, train, validation)
    if resumed is not None:
        check_same_data(resumed[1], data_identity(plan.config, prepared.train, prepared.validation), resumed[0])
    return describe_prepared(prepared, plan.config, methods)


def check_eval_generate(config: RunConfig, train: Samples, validation: Samples) -> None:
    """train.eval_generate answers held-out prompts: it needs chat / instruction samples (or a
    method's records viewed as such) held out."""
    if not config.train.eval_generate:
        return
    if not isinstance(train, SampleView):
        raise UserError("train.eval_generate needs prompts and answers", [Problem(
            "train.eval_generate", "the data is plain text: it has no prompt to answer and no answer to compare",
            "train on chat, prompt-completion or Alpaca records, or set eval_generate: 0")])
    if validation.samples == 0:
        raise UserError("train.eval_generate needs held-out samples", [Problem(
            "train.eval_generate", "no validation samples (data.validation_ratio is 0 and no validation files)",
            "set data.validation_ratio above 0 or give data.validation_files, or set eval_generate: 0")])


def prepare_from_config(config: RunConfig, methods: MethodData, *, progress: bool = True, force: bool = False) -> str:
    """`orchestrate prepare`: check the data section against the model, then tokenise into the cache
    (or find it there); returns `describe_prepared`. `methods`: what the config's methods bring."""
    shape = shape_for(config)
    check_data_config(config, shape.max_position_embeddings, shape.vocab_size, methods)
    tokenizer, _ = tokenizer_for(config, shape.vocab_size)
    prepared = prepare_data(config, tokenizer=tokenizer, progress=progress, force=force, methods=methods)
    check_labels(config, prepared)  # the launcher's check, so `orchestrate prepare` refuses the same data
    train = samples_for(prepared, config, methods=methods)[0]
    require_training_samples(len(train), int(prepared.train.meta["tokens"]), config.train.seq_len, config.data.packing,
                             prepared.sources.train[0].where, dropped_for_length(train, config))
    return describe_prepared(prepared, config, methods)
