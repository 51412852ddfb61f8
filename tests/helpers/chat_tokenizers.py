"""Family-style tokenizers built locally (no download): a byte-level BPE learned from a few sentences,
the family's special tokens, and its post-processor, as the family's own tokenizer behaves with
`add_special_tokens=True` (Llama-3, Mistral and Gemma prepend their BOS; Qwen2 and Phi-3-instruct add
nothing). BOS / EOS names follow each family's tokenizer_config.json (the instruct models').
`sentencepiece_tokenizer` builds the other kind Llama-2, Mistral v0.1-v0.3 and Gemma ship: a SentencePiece
model converted to a byte_fallback BPE tokenizer.json."""

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


SENTENCEPIECE_FORMS = ("hub", "transformers")
"""How a SentencePiece-converted tokenizer.json spells its spaces. "hub": as Llama-2's, Mistral's and
Gemma's repositories ship it, a normalizer (Prepend "▁" then Replace " " by "▁"; Gemma's Replace only).
"transformers": as transformers 5 rewrites it when it loads and saves such a tokenizer (what a run does
with data.tokenizer): LlamaTokenizer drops the normalizer for a Metaspace pre-tokenizer that prepends on
the first section only; GemmaTokenizer keeps the Replace and adds a Split on " "."""


def sentencepiece_tokenizer(directory: Path, family: str, form: str = "transformers") -> Path:
    """A SentencePiece-converted tokenizer of `family` ("mistral": Llama-2's and Mistral's layout; "gemma")
    saved in `directory` in `form` (SENTENCEPIECE_FORMS), laid out as transformers' LlamaConverter writes
    one (convert_slow_tokenizer.py): a BPE with byte_fallback whose vocabulary is <unk>, the family's
    special tokens, the 256 byte tokens <0x00>..<0xFF>, then the pieces (learned here from CORPUS within
    words that start with "▁", as SentencePiece splits), and whose merges are every split of a piece into
    two pieces, in the pieces' order (transformers' `generate_merges`, what its SentencePieceExtractor
    makes of a tokenizer.model). The family's bos is prepended and its named chat template set."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import AutoTokenizer, GemmaTokenizerFast, LlamaTokenizerFast, PreTrainedTokenizerFast
    from transformers.tokenization_utils_base import generate_merges

    from orchestrate.data.chat_templates import NAMED_TEMPLATES

    specials, bos, eos, named = FAMILIES[family]
    prefix = family != "gemma"  # Gemma's SentencePiece model adds no dummy prefix
    pieces = Tokenizer(models.BPE())
    pieces.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first" if prefix else "never")
    pieces.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=110, show_progress=False))
    learned = sorted(pieces.get_vocab(), key=pieces.get_vocab().get)
    vocab = {t: i for i, t in enumerate(dict.fromkeys(
        ["<unk>", *specials, *(f"<0x{b:02X}>" for b in range(256)), *learned]))}
    raw = Tokenizer(models.BPE(vocab, generate_merges(vocab), unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    replace = normalizers.Replace(" ", "▁")
    raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), replace]) if prefix else replace
    raw.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     *([decoders.Strip(" ", 1, 0)] if prefix else [])])
    raw.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, vocab[bos])])
    # The family's class is what its tokenizer_config.json names, and what makes transformers rewrite it.
    wrapper = (PreTrainedTokenizerFast if form == "hub" else GemmaTokenizerFast if family == "gemma"
               else LlamaTokenizerFast)
    tok = wrapper(tokenizer_object=raw, bos_token=bos, eos_token=eos, unk_token="<unk>", pad_token=eos,
                  additional_special_tokens=[s for s in specials if s not in (bos, eos)],
                  chat_template=NAMED_TEMPLATES[named].source)
    tok.save_pretrained(directory)
    if form == "transformers":
        AutoTokenizer.from_pretrained(directory).save_pretrained(directory)
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
