"""The tokenizer of a GGUF export (gguf_export.py): a run's tokenizer.json as the tokenizer.ggml.*
metadata llama.cpp reads, following convert_hf_to_gguf.py's `_set_vocab_gpt2` (byte-level BPE:
Llama-3's, Qwen2's, GPT-2's) and `_set_vocab_llama_hf` (SentencePiece converted to a byte_fallback BPE:
Llama-2's, Mistral v0.1-v0.3's, Gemma's); any other kind is refused with one error."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from orchestrate.errors import Problem, UserError

HF_EXPORT_FIX = "export --format hf and convert that with llama.cpp's convert_hf_to_gguf.py"

_PRE_TOKENIZERS = {
    # The Split regex of a tokenizer.json -> the llama.cpp pre-tokenizer that runs it (llama-vocab.cpp
    # keeps each original regex beside its rewrite; convert_hf_to_gguf.py's get_vocab_base_pre picks
    # the name by hashing known tokenizers' output, which a tokenizer trained here never matches).
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
    "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+": "llama-bpe",
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
    "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+": "qwen2",
}

_SPACE = "\u2581"
"""SentencePiece's visible space: a converted tokenizer.json turns each " " into it before the merges,
as llama.cpp's SPM tokenizer does (llama_escape_whitespace)."""
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
"""A byte_fallback token, typed BYTE (gguf.LlamaHfVocab.get_token_type)."""


def _steps(part: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The steps of a tokenizer.json normalizer or pre-tokenizer: none, itself, or its Sequence's."""
    if not part:
        return []
    return part.get("normalizers", part.get("pretokenizers", [])) if part.get("type") == "Sequence" else [part]


def _pre_tokenizer(tokenizer_json: dict[str, Any]) -> str:
    """tokenizer.ggml.pre: the llama.cpp pre-tokenizer that splits text as this tokenizer.json does,
    for byte-level BPE (convert_hf_to_gguf.py `_set_vocab_gpt2`); a UserError for anything else."""
    model = tokenizer_json.get("model") or {}
    pre = tokenizer_json.get("pre_tokenizer") or {}
    steps = _steps(pre)
    byte_level = [s for s in steps if s.get("type") == "ByteLevel"]
    if model.get("type") == "BPE" and not model.get("byte_fallback") and len(byte_level) == 1:
        others = [s for s in steps if s.get("type") != "ByteLevel"]
        if not others and byte_level[0].get("use_regex", True):
            return "gpt-2"  # ByteLevel's own split is GPT-2's regex, llama.cpp's LLAMA_VOCAB_PRE_TYPE_GPT2
        if not others and not model.get("merges"):
            return "gpt-2"  # no merges (the byte tokenizer): every byte is its own token however text is split
        if (len(others) == 1 and others[0].get("type") == "Split" and steps[-1] is byte_level[0]
                and not byte_level[0].get("use_regex", True)):
            name = _PRE_TOKENIZERS.get((others[0].get("pattern") or {}).get("Regex"))
            if name is not None:
                return name
    raise UserError("GGUF export does not cover this tokenizer", [Problem(
        "tokenizer.json", f"model {model.get('type')!r} (byte_fallback {model.get('byte_fallback')}), "
        f"normalizer {json.dumps(tokenizer_json.get('normalizer'))[:200]}, pre-tokenizer {json.dumps(pre)[:200]}: "
        "written are byte-level BPE with the GPT-2, Llama-3 or Qwen2 split, and SentencePiece-converted BPE "
        f"(byte_fallback, spaces made {_SPACE!r} by a Replace normalizer or a Metaspace that does not split)",
        HF_EXPORT_FIX)])


def _sentencepiece_prefix(tokenizer_json: dict[str, Any]) -> bool | None:
    """For a SentencePiece-converted tokenizer.json, whether it puts a "▁" before the text (llama.cpp's
    tokenizer.ggml.add_space_prefix, which `_set_vocab_sentencepiece` reads from tokenizer.model's
    add_dummy_prefix); None for any other tokenizer. Converted (transformers' LlamaConverter) means a plain
    BPE with byte_fallback whose spaces become "▁" before the merges and whose text nothing else splits:
    - a Replace " " -> "▁" normalizer, after a Prepend "▁" or not (the files Llama-2, Mistral v0.1-v0.3
      and Gemma ship; transformers' GemmaTokenizer adds a Split on " ", a no-op once no space is left), or
    - a Metaspace pre-tokenizer that does not split: prepend_scheme "first" or "always" prepends, "never"
      does not (transformers 5's LlamaTokenizer rewrites the normalizer so).
    GemmaModel.set_vocab writes False whatever the file; here the file decides for every family: the
    same for Gemma's own tokenizer, and a gemma model trained with another one is tokenized as it does."""
    model = tokenizer_json.get("model") or {}
    if (model.get("type") != "BPE" or not model.get("byte_fallback") or model.get("continuing_subword_prefix")
            or model.get("end_of_word_suffix")):
        return None
    norms, pres = _steps(tokenizer_json.get("normalizer")), _steps(tokenizer_json.get("pre_tokenizer"))
    replaces_spaces = bool(norms) and norms[-1] == {"type": "Replace", "pattern": {"String": " "}, "content": _SPACE}
    if replaces_spaces and norms[:-1] in ([], [{"type": "Prepend", "prepend": _SPACE}]) and all(
            p.get("type") == "Split" and p.get("pattern") == {"String": " "} for p in pres):
        return len(norms) == 2
    if not norms and len(pres) == 1 and pres[0].get("type") == "Metaspace" and (
            pres[0].get("replacement") == _SPACE and pres[0].get("split") is False):
        return pres[0].get("prepend_scheme") != "never"
    return None


def _gpt2_tokens(tokenizer, vocab_size: int) -> list[tuple[str, int]]:
    """(token, type) for convert_hf_to_gguf.py's `_set_vocab_gpt2` (`get_vocab_base`): ids the
    tokenizer lacks up to the model's vocab_size are "[PAD<id>]", UNUSED; added tokens CONTROL when
    special, else USER_DEFINED."""
    import gguf

    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    rows = []
    for i in range(vocab_size):
        if i not in by_id:
            rows.append((f"[PAD{i}]", gguf.TokenType.UNUSED))
            continue
        rows.append((by_id[i], gguf.TokenType.NORMAL if i not in added else
                     gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED))
    return rows


def _llama_tokens(tokenizer_json: dict[str, Any], tokenizer, vocab_size: int) -> list[tuple[str, float, int]]:
    """(token, score, type) for llama.cpp's SPM tokenizer as convert_hf_to_gguf.py's `_set_vocab_llama_hf`
    writes them from tokenizer.json alone (gguf.LlamaHfVocab): <0xNN> tokens BYTE, the tokenizer's special
    tokens CONTROL, other added tokens USER_DEFINED with "▁" written as a space (as
    `_create_vocab_sentencepiece` does: llama.cpp finds them in the raw text), the rest NORMAL, ids up to
    the model's vocab_size "[PAD<id>]" UNUSED. A UserError unless the 256 byte tokens are all there
    (llama.cpp's byte fallback looks each one up).

    The scores depart from LlamaHfVocab, whose get_token_score is a placeholder of -1000 for every token:
    llama.cpp merges the adjacent pair whose joined token scores highest, the leftmost among equals
    (llm_tokenizer_spm_session), so equal scores would merge left to right, not in the BPE's order. Here a
    token a merge makes scores minus the rank of the first merge that makes it, so llama.cpp merges in
    tokenizer.json's order. A converted tokenizer.json lists each piece's splits in the order of the
    pieces' SentencePiece scores (transformers' generate_merges), so these order the tokens as the scores
    `_set_vocab_sentencepiece` copies from tokenizer.model do. Every other token (characters, bytes,
    special and padding tokens) scores below all merges."""
    import gguf

    vocab = tokenizer.get_vocab()
    missing = [f"<0x{b:02X}>" for b in range(256) if f"<0x{b:02X}>" not in vocab]
    if missing:
        raise UserError("GGUF export needs the byte tokens of a byte_fallback tokenizer", [Problem(
            "tokenizer.json", f"{len(missing)} of the 256 byte tokens are missing ({', '.join(missing[:4])}, ...), "
            "which llama.cpp's byte fallback looks up", f"add them to the vocabulary, or {HF_EXPORT_FIX}")])
    merges = tokenizer_json["model"].get("merges") or []
    first_rank: dict[str, int] = {}
    for rank, merge in enumerate(merges):
        left, right = merge if isinstance(merge, list) else merge.split(" ", 1)
        first_rank.setdefault(left + right, rank)
    floor = -float(len(merges))
    by_id = {i: t for t, i in vocab.items()}
    added = tokenizer.added_tokens_decoder
    special_ids = set(tokenizer.all_special_ids)
    rows = []
    for i in range(vocab_size):
        if i not in by_id:
            rows.append((f"[PAD{i}]", floor, gguf.TokenType.UNUSED))
            continue
        text = by_id[i]
        score = -float(first_rank[text]) if text in first_rank else floor
        if _BYTE_TOKEN.fullmatch(text):
            rows.append((text, score, gguf.TokenType.BYTE))
        elif i in special_ids or (i in added and added[i].special):
            rows.append((text, score, gguf.TokenType.CONTROL))
        elif i in added:
            rows.append((text.replace(_SPACE, " "), score, gguf.TokenType.USER_DEFINED))
        else:
            rows.append((text, score, gguf.TokenType.NORMAL))
    return rows


def add_vocab(writer, tokenizer_dir: Path, vocab_size: int, eot_token: str | None) -> list[str]:
    """tokenizer.ggml.*: a byte-level BPE as convert_hf_to_gguf.py's `_set_vocab_gpt2` writes it (model
    "gpt2", the pre-tokenizer's name, tokens and types, the merges), a SentencePiece-converted one as its
    `_set_vocab_llama_hf` does (model "llama", pre "default", tokens, scores and types, whether a space is
    prepended; no merges: llama.cpp's SPM tokenizer merges by score); then for both bos / eos / unk / pad
    ids, whether a bos and an eos are added (what the HF tokenizer does), the end-of-turn id (the
    family's `eot_token`, when the vocabulary has it) and
    the chat template (gguf.SpecialVocab). Returns the texts that end a reply (eos, eot): the Modelfile's stops."""
    import gguf
    from transformers import AutoTokenizer

    tokenizer_json = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    space_prefix = _sentencepiece_prefix(tokenizer_json)
    pre = _pre_tokenizer(tokenizer_json) if space_prefix is None else "default"
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    vocab = tokenizer.get_vocab()
    if max(vocab.values()) >= vocab_size:
        raise UserError("the tokenizer has more tokens than the model has embeddings", [Problem(
            str(tokenizer_dir), f"token id {max(vocab.values())} >= vocab_size {vocab_size}",
            "export the run whose tokenizer this is")])
    if space_prefix is None:
        tokens, types = zip(*_gpt2_tokens(tokenizer, vocab_size), strict=True)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
    else:
        tokens, scores, types = zip(*_llama_tokens(tokenizer_json, tokenizer, vocab_size), strict=True)
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_add_space_prefix(space_prefix)
    special = gguf.SpecialVocab(tokenizer_dir, load_merges=space_prefix is None, n_vocab=vocab_size)
    if eot_token in vocab:
        special.special_token_ids.setdefault("eot", vocab[eot_token])
    # What HF's tokenizer does, rather than SpecialVocab's reading of the post-processor (absent: no key,
    # and llama.cpp's own default per tokenizer model would decide).
    ids = tokenizer("a")["input_ids"]
    special.add_special_token["bos"] = tokenizer.bos_token_id is not None and ids[:1] == [tokenizer.bos_token_id]
    special.add_special_token["eos"] = tokenizer.eos_token_id is not None and ids[-1:] == [tokenizer.eos_token_id]
    special.add_to_gguf(writer, quiet=True)
    by_id = {i: t for t, i in vocab.items()}
    ends = [special.special_token_ids.get(kind) for kind in ("eos", "eot")]
    return list(dict.fromkeys(by_id[i] for i in ends if i is not None))
