"""Family-style tokenizers built locally (no download): a byte-level BPE learned from a few sentences,
the family's special tokens, and its post-processor, as the family's own tokenizer behaves with
`add_special_tokens=True` (Llama-3, Mistral and Gemma prepend their BOS; Qwen2 and Phi-3-instruct add
nothing). BOS / EOS names follow each family's tokenizer_config.json (the instruct models')."""

from __future__ import annotations

from pathlib import Path

FAMILIES = {
    # family: (special tokens, bos, eos, the named template of orchestrate that fits it)
    "llama-3": (["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
                "<|begin_of_text|>", "<|eot_id|>", "llama-3"),
    "qwen2": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>", "chatml"),
    "mistral": (["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"], "<s>", "</s>", "mistral"),
    "phi-3": (["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>"], None,
              "<|endoftext|>", "phi-3"),
    "gemma": (["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], "<bos>", "<eos>", "gemma"),
}

CORPUS = ["the cat sees the dog", "what is the capital of france", "paris is the capital", "hello there",
          "upper case this word please", "you are a helpful assistant", "apple banana cherry"] * 20


def family_tokenizer(directory: Path, family: str, with_template: bool = True, template: str | None = None) -> Path:
    """A PreTrainedTokenizerFast of `family` saved in `directory` (with orchestrate's named template of
    the family as its chat_template unless `with_template` is False, or `template` when given)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from orchestrate.data.chat_templates import NAMED_TEMPLATES

    specials, bos, eos, named = FAMILIES[family]
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    if bos is not None:
        raw.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, raw.token_to_id(bos))])
    chat = template if template is not None else NAMED_TEMPLATES[named].source if with_template else None
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token=bos, eos_token=eos, unk_token=None,
                                  pad_token=eos, chat_template=chat)
    tok.save_pretrained(directory)
    return directory


def word_chat_tokenizer(directory: Path, words: list[str], specials: list[str], eos: str, bos: str | None = None,
                        template: str | None = None) -> Path:
    """A word-level tokenizer (ids: the specials, then [UNK], then `words`; whitespace and punctuation
    split) whose token-by-token encodings a test can write down by hand; with `bos`, `tokenizer(text)`
    prepends it (as Llama's does)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate([*specials, "[UNK]", *words])}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    if bos is not None:
        raw.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, vocab[bos])])
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token=bos, eos_token=eos, unk_token="[UNK]",
                                  pad_token=eos, chat_template=template, additional_special_tokens=[
                                      s for s in specials if s not in (bos, eos)])
    tok.save_pretrained(directory)
    return directory
