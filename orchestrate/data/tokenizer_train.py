"""`orchestrate tokenizer train`: a byte-level BPE tokenizer (GPT-2's scheme) trained with
`tokenizers` on the data section's corpus, saved as a Hugging Face tokenizer directory.

Byte-level: the 256 byte values are the initial alphabet, so any text encodes without unknown
tokens; merges are learned from the corpus up to `vocab_size` ids, one of which is the
end-of-text token that separates documents.

Chat and instruction records with a named `data.chat_template` (chat_templates.py): the corpus is
each record as that template renders it, the template's special tokens (headers, end-of-turn, BOS)
are atomic ids, the tokenizer's BOS / EOS are the template's (EOS: the token a reply ends with), BOS
is prepended by `tokenizer(text)` where the family's tokenizers do it (Llama-3, Mistral, Gemma), and the
template is saved as its chat_template.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from orchestrate.config.schema import RunConfig
from orchestrate.data.cache import cache_dir_of, temp_dir_for
from orchestrate.data.chat_templates import NamedTemplate, known_names, named_template
from orchestrate.data.checks import check_vocab_size, ensure_cache_dir
from orchestrate.data.corpus import write_demo_corpus
from orchestrate.data.prepare import TextSpec, iter_documents, progress_bars
from orchestrate.data.sources import resolve_sources
from orchestrate.errors import Problem, UserError
from orchestrate.run.layout import os_errors_as_user_errors

EOS_TOKEN = "<|endoftext|>"
MIN_VOCAB = 256 + 1 + 1
"""The byte alphabet, the end-of-text token and at least one merge."""


def train_tokenizer(config: RunConfig, vocab_size: int, out_dir: Path, *, progress: bool = True) -> tuple[Path, int]:
    """Train on the configured training data and write the tokenizer to `out_dir` (atomically);
    returns the directory and the number of ids (below `vocab_size` when the corpus has fewer merges)."""
    from transformers import PreTrainedTokenizerFast

    if vocab_size < MIN_VOCAB:
        raise UserError("vocabulary too small", [Problem(
            "--vocab-size", f"{vocab_size} ids cannot hold the 256 bytes, the end-of-text token and a merge",
            f"use at least {MIN_VOCAB} (typical: 8,000 to 64,000)")])
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise UserError(f"{out_dir} is not empty", [Problem("--out", "refusing to overwrite files",
                                                            "choose a new directory")])
    with os_errors_as_user_errors("--out"):  # an unwritable --out is told now, not after the training
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        temp_dir_for(out_dir).rmdir()
    ensure_cache_dir(cache_dir_of(config))
    demo = None
    if config.data.generate_demo_corpus:
        demo = cache_dir_of(config) / "demo" / f"demo_corpus_seed{config.train.seed}.txt"
        if not demo.is_file():
            write_demo_corpus(demo, config.train.seed)
    sources = resolve_sources(config, demo_path=demo).train
    check_vocab_size(vocab_size, sources, MIN_VOCAB)  # before the trainer allocates for it
    spec = TextSpec(config.data.text_field, config.data.template)
    named = _named_template(config)

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = list(named.special_tokens) if named else [EOS_TOKEN]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    work = temp_dir_for(cache_dir_of(config) / "tokenizer-train")
    try:
        with progress_bars(progress):
            texts = iter_records_as_text(sources, config, named, work) if named else iter_documents(sources, spec, work)
            tokenizer.train_from_iterator(texts, trainer)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if tokenizer.get_vocab_size() <= MIN_VOCAB - 1:
        raise UserError("the corpus is too small to learn any merge", [Problem(
            sources[0].where, f"{sources[0].describe()} gave no token pairs", "train on more text")])

    if named is None:
        fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN,
                                       unk_token=None, model_max_length=2**62)
    else:
        fast = _chat_tokenizer(tokenizer, named)
    with os_errors_as_user_errors("--out"):
        tmp = temp_dir_for(out_dir)
        fast.save_pretrained(str(tmp))
        shutil.rmtree(out_dir, ignore_errors=True)  # empty (checked above)
        tmp.rename(out_dir)
    return out_dir, len(fast)


def _named_template(config: RunConfig) -> NamedTemplate | None:
    """The named template a tokenizer for chat records is made for (None: a plain-text tokenizer)."""
    given = config.data.chat_template
    if given is None:
        return None
    named = named_template(given)
    if named is None:
        raise UserError("the tokenizer trainer knows the special tokens of the named templates only", [Problem(
            "data.chat_template", f"{given[:60]!r} is not one of {known_names()}",
            "name one of those for `orchestrate tokenizer train` (the run may then use any template)")])
    return named


def iter_records_as_text(sources, config: RunConfig, named: NamedTemplate, work: Path):
    """Batches of texts: chat / instruction records as `named` renders them (records that cannot be
    rendered are left to `orchestrate prepare` to report), plain-text records as they are."""
    from transformers.utils.chat_template_utils import render_jinja_template

    from orchestrate.data.reading import read_parts
    from orchestrate.data.records import as_chat, detect_format, to_sample
    from orchestrate.data.sft_prepare import is_sft

    tokens = {"bos_token": named.bos or "", "eos_token": named.eos}
    for source in sources:
        data = config.data.for_source(source.listed)
        for part in read_parts(source, work, 1):
            record_format = detect_format(part.ds.column_names, data)
            if not is_sft(record_format):
                yield from iter_documents([part.source], TextSpec(data.text_field, data.template), work)
                continue
            for batch in part.ds.iter(batch_size=1000):
                texts = []
                for row in range(len(next(iter(batch.values())))):
                    record = {k: v[row] for k, v in batch.items()}
                    sample, _ = to_sample(record, record_format, data)
                    if sample is not None:
                        chat = as_chat(sample, record, record_format, data)
                        texts.append(render_jinja_template([chat.messages], chat_template=named.source, **tokens)[0][0])
                yield texts


def _chat_tokenizer(tokenizer, named: NamedTemplate):
    """The trained tokenizer with the template's BOS / EOS, its chat template, and a BOS prepended by
    `tokenizer(text)` where the template's family does that."""
    from transformers import PreTrainedTokenizerFast

    if named.bos is not None:
        bos = (named.bos, tokenizer.token_to_id(named.bos))
        tokenizer.post_processor = processors.TemplateProcessing(single=f"{named.bos} $A",
                                                                 pair=f"{named.bos} $A {named.bos} $B", special_tokens=[bos])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=named.bos, eos_token=named.eos,
                                   pad_token=named.eos, unk_token=None, model_max_length=2**62,
                                   chat_template=named.source)
