"""`orchestrate tokenizer train`: a byte-level BPE tokenizer (GPT-2's scheme) trained with
`tokenizers` on the data section's corpus, saved as a Hugging Face tokenizer directory.

Byte-level: the 256 byte values are the initial alphabet, so any text encodes without unknown
tokens; merges are learned from the corpus up to `vocab_size` ids, one of which is the
end-of-text token that separates documents.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from orchestrate.config.schema import RunConfig
from orchestrate.data.cache import cache_dir_of, temp_dir_for
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
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
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

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN], show_progress=progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    work = temp_dir_for(cache_dir_of(config) / "tokenizer-train")
    try:
        with progress_bars(progress):
            tokenizer.train_from_iterator(iter_documents(sources, spec, work), trainer)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if tokenizer.get_vocab_size() <= MIN_VOCAB - 1:
        raise UserError("the corpus is too small to learn any merge", [Problem(
            sources[0].where, f"{sources[0].describe()} gave no token pairs", "train on more text")])

    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN,
                                   unk_token=None, model_max_length=2**62)
    with os_errors_as_user_errors("--out"):
        tmp = temp_dir_for(out_dir)
        fast.save_pretrained(str(tmp))
        shutil.rmtree(out_dir, ignore_errors=True)  # empty (checked above)
        tmp.rename(out_dir)
    return out_dir, len(fast)
