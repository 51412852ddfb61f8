"""`orchestrate export RUN_DIR --out DIR --format gguf [--quant f16|q8_0]`: the consolidated model of a
run as one GGUF file for llama.cpp and Ollama (model.gguf), its tokenizer and chat template in the
file's metadata, and an Ollama `Modelfile` beside it.

Written with llama.cpp's own Python package (`gguf`: GGUFWriter, the tensor-name maps, SpecialVocab,
the quantizers), following llama.cpp's convert_hf_to_gguf.py rule for rule: each function below names
the part of that script it mirrors. Four families (FAMILIES), whose graphs llama.cpp builds from the
keys written here; any other is refused before a checkpoint is read (`check_family`). Two kinds of
tokenizer.json: byte-level BPE (Llama-3's, Qwen2's, GPT-2's: llama.cpp's "gpt2" model) and
SentencePiece converted to a byte_fallback BPE (Llama-2's, Mistral v0.1-v0.3's, Gemma's: its "llama"
model); any other is refused (`_add_vocab`).
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrate.errors import Problem, UserError

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

GGUF_FILE = "model.gguf"
MODELFILE = "Modelfile"
QUANTS = ("f16", "q8_0")
"""What --quant offers: llama.cpp's `--outtype f16` and `--outtype q8_0` (convert_hf_to_gguf.py)."""


@dataclass(frozen=True)
class Family:
    """How one Hugging Face `model_type` becomes a llama.cpp architecture."""

    arch: str
    """The name of gguf.MODEL_ARCH's member (convert_hf_to_gguf.py's `model_arch` of the family's class)."""
    permute_qk: bool = False
    """LlamaModel.modify_tensors: llama.cpp's LLAMA graph applies RoPE to interleaved pairs (GPT-J
    style) where HF rotates the two halves of each head, so q_proj / k_proj rows are re-ordered
    (`LlamaModel.permute`). QWEN2 and GEMMA use llama.cpp's NEOX rope (the halves): no permutation."""
    norm_shift: float = 0.0
    """GemmaModel.modify_tensors: Gemma's RMSNorm scales by (1 + weight), llama.cpp's by weight, so
    every `*norm.weight` is written + 1."""
    tied_output: bool = False
    """GemmaModel.filter_tensors: lm_head.weight is never written (Gemma ties it to the embedding,
    llama.cpp reuses token_embd when `output` is absent)."""
    eot_token: str | None = None
    """GemmaModel.set_vocab: tokenizer.ggml.eot_token_id, id 107 of Gemma's vocabulary, written here as
    the id of its text so that any vocabulary gets it right. The script also sets prefix / suffix / middle
    / fsep ids (CodeGemma's fill-in-the-middle tokens), which gguf's GGUFWriter has no key for: its
    SpecialVocab skips them, so they are not in its files either."""


FAMILIES = {
    # convert_hf_to_gguf.py registers LlamaForCausalLM and MistralForCausalLM both on LlamaModel.
    "llama": Family("LLAMA", permute_qk=True),
    "mistral": Family("LLAMA", permute_qk=True),
    "qwen2": Family("QWEN2"),  # Qwen2Model: TextModel's tensors as they are, q/k/v biases included
    "gemma": Family("GEMMA", norm_shift=1.0, tied_output=True, eot_token="<end_of_turn>"),
}

_ROPE_SCALINGS = ("default", "linear", "yarn", "llama3")
"""rope types TextModel.set_gguf_parameters / LlamaModel.generate_extra_tensors write; others are refused."""

_PRE_TOKENIZERS = {
    # The Split regex of a tokenizer.json -> the llama.cpp pre-tokenizer that runs it (llama-vocab.cpp
    # keeps each original regex beside its rewrite; convert_hf_to_gguf.py's get_vocab_base_pre picks
    # the name by hashing known tokenizers' output, which a tokenizer trained here never matches).
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
    "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+": "llama-bpe",
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
    "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+": "qwen2",
}
_HF_EXPORT_FIX = "export --format hf and convert that with llama.cpp's convert_hf_to_gguf.py"


def check_gguf_installed() -> None:
    """UserError unless the `gguf` package (the optional extra `export`) is importable."""
    if importlib.util.find_spec("gguf") is None:
        raise UserError("--format gguf needs the gguf package", [Problem(
            "--format gguf", "llama.cpp's gguf package is not installed",
            "pip install 'orchestrate[export]' (or pip install gguf)")])


def check_family(hf_config) -> Family:
    """The Family of `hf_config`, or one UserError naming it, the supported ones and the way out."""
    model_type = getattr(hf_config, "model_type", None)
    family = FAMILIES.get(model_type)
    if family is None:
        raise UserError(f"GGUF export does not cover the {model_type!r} family", [Problem(
            "--format gguf", f"supported: {', '.join(FAMILIES)}", f"{_HF_EXPORT_FIX}, or export --format hf")])
    rope_type = _rope(hf_config.to_dict()).get("rope_type", "default")
    if rope_type not in _ROPE_SCALINGS or (rope_type == "llama3" and family.arch != "LLAMA"):
        raise UserError(f"GGUF export does not cover rope scaling {rope_type!r}", [Problem(
            "--format gguf", f"covered: {', '.join(_ROPE_SCALINGS)} (llama3 for llama / mistral)", _HF_EXPORT_FIX)])
    return family


def write_gguf(state: dict[str, torch.Tensor], hf_config, tokenizer_dir: Path, out_dir: Path, quant: str,
               say: Callable[[str], None]) -> Path:
    """Write out_dir/model.gguf and out_dir/Modelfile; returns the GGUF's path. `state`: the full model
    (it is emptied, each tensor freed once converted); `tokenizer_dir`: the run's tokenizer as export
    saves it (tokenizer.json, tokenizer_config.json, chat_template.jinja). Tensors that q8_0 cannot
    hold are named to `say`."""
    import gguf

    family = check_family(hf_config)
    hparams = hf_config.to_dict()
    arch = gguf.MODEL_ARCH[family.arch]
    writer = gguf.GGUFWriter(path=None, arch=gguf.MODEL_ARCH_NAMES[arch])
    ftype = gguf.LlamaFileType.MOSTLY_F16 if quant == "f16" else gguf.LlamaFileType.MOSTLY_Q8_0
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(out_dir.name)  # ModelBase.prepare_metadata: "fallback to model directory name"
    _add_hyper_parameters(writer, hparams, family, ftype)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    stops = _add_vocab(writer, tokenizer_dir, hparams["vocab_size"], family)
    _add_tensors(writer, state, hparams, family, arch, quant, say)
    path = out_dir / GGUF_FILE
    writer.write_header_to_file(path=path)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (out_dir / MODELFILE).write_text(modelfile(stops))
    return path


def _rope(hparams: dict[str, Any]) -> dict[str, Any]:
    """The rope settings wherever the config keeps them: transformers 5 `rope_parameters` (rope_theta
    inside), older `rope_scaling` + `rope_theta` (TextModel.__init__ mirrors them the same way)."""
    rope = dict(hparams.get("rope_parameters") or hparams.get("rope_scaling") or {})
    if "rope_theta" not in rope and hparams.get("rope_theta") is not None:
        rope["rope_theta"] = hparams["rope_theta"]
    if "rope_type" not in rope and "type" in rope:
        rope["rope_type"] = rope["type"]
    return rope


def _add_hyper_parameters(writer, hparams: dict[str, Any], family: Family, ftype) -> None:
    """TextModel.set_gguf_parameters, with LlamaModel's vocab size and rope dimension count and
    GemmaModel's head_count_kv default (the attention head count)."""
    import gguf

    n_head = hparams["num_attention_heads"]
    head_dim = hparams.get("head_dim") or hparams["hidden_size"] // n_head
    writer.add_context_length(hparams["max_position_embeddings"])
    writer.add_embedding_length(hparams["hidden_size"])
    writer.add_block_count(hparams["num_hidden_layers"])
    writer.add_feed_forward_length(hparams["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(hparams.get("num_key_value_heads") or n_head)
    writer.add_layer_norm_rms_eps(hparams["rms_norm_eps"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_file_type(ftype)
    rope = _rope(hparams)
    if "rope_theta" in rope:
        writer.add_rope_freq_base(rope["rope_theta"])
    if family.arch == "LLAMA":
        writer.add_vocab_size(hparams["vocab_size"])
        writer.add_rope_dimension_count(head_dim)
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])


def _llama3_rope_factors(hparams: dict[str, Any]) -> torch.Tensor:
    """LlamaModel.generate_extra_tensors: Llama 3.1's frequency-dependent rope scaling as the per-pair
    divisors llama.cpp reads from the `rope_freqs` tensor. original_max_position_embeddings is read
    where transformers reads it (the rope settings; the script looks at the top level, default 8192,
    Llama 3.1's value)."""
    import torch

    rope = _rope(hparams)
    base = rope.get("rope_theta", 10000.0)
    dim = hparams.get("head_dim") or hparams["hidden_size"] // hparams["num_attention_heads"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_context = rope.get("original_max_position_embeddings", 8192)
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old_context / high:
            factors.append(1.0)
        elif wavelen > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def permute_qk(weights: torch.Tensor, n_head: int) -> torch.Tensor:
    """LlamaModel.permute: within each of `n_head` heads, the rows of the first half and of the second
    half (the pairs HF's rotate_half rotates together) become adjacent: rows 0, d/2, 1, d/2 + 1, ..."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _hf_tensors(state: dict[str, torch.Tensor], hparams: dict[str, Any], family: Family):
    """(HF name, float tensor as llama.cpp wants it) for each tensor to write, popped from `state`:
    ModelBase.prepare_tensors' skips and float32 cast, then the family's modify_tensors."""
    import torch

    n_head = hparams["num_attention_heads"]
    n_kv = hparams.get("num_key_value_heads") or n_head
    if _rope(hparams).get("rope_type") == "llama3":
        yield "rope_freqs.weight", _llama3_rope_factors(hparams)
    for name in list(state):
        tensor = state.pop(name)
        if name.endswith(".rotary_emb.inv_freq") or (name == "lm_head.weight" and (
                family.tied_output or hparams.get("tie_word_embeddings"))):
            continue  # recomputed by llama.cpp / the embedding itself, as for a tied HF checkpoint on disk
        if tensor.dtype not in (torch.float16, torch.float32):
            tensor = tensor.to(torch.float32)
        if family.permute_qk and name.endswith(("q_proj.weight", "q_proj.bias")):
            tensor = permute_qk(tensor, n_head)
        elif family.permute_qk and name.endswith(("k_proj.weight", "k_proj.bias")):
            tensor = permute_qk(tensor, n_kv)
        if family.norm_shift and name.endswith("norm.weight"):
            tensor = tensor + family.norm_shift
        yield name, tensor


def _add_tensors(writer, state, hparams, family: Family, arch, quant: str, say) -> None:
    """Each tensor under its llama.cpp name (gguf.TensorNameMap) in the type convert_hf_to_gguf.py's
    prepare_tensors gives it: 1-D tensors and norms float32 ("most of the codebase that takes in 1D
    tensors or norms only handles F32"), the rest f16 or q8_0; a row q8_0 cannot cut into its blocks
    of 32 falls back to f16 (its QuantError branch), and is named to `say`."""
    import gguf

    tensor_map = gguf.get_tensor_name_map(arch, hparams["num_hidden_layers"])
    wanted = gguf.GGMLQuantizationType.F16 if quant == "f16" else gguf.GGMLQuantizationType.Q8_0
    fell_back = []
    for name, tensor in _hf_tensors(state, hparams, family):
        new_name = name if name == "rope_freqs.weight" else tensor_map.get_name(name, try_suffixes=(".weight", ".bias"))
        if new_name is None:
            raise UserError(f"GGUF export does not know the tensor {name}", [Problem(
                "--format gguf", f"llama.cpp's {gguf.MODEL_ARCH_NAMES[arch]} architecture has no tensor for it",
                _HF_EXPORT_FIX)])
        data = tensor.detach().numpy()
        qtype = gguf.GGMLQuantizationType.F32 if data.ndim <= 1 or new_name.endswith("_norm.weight") else wanted
        try:
            out = gguf.quants.quantize(data, qtype)
        except gguf.QuantError:
            qtype = gguf.GGMLQuantizationType.F16
            out = gguf.quants.quantize(data, qtype)
            fell_back.append(f"{new_name} {list(data.shape)}")
        writer.add_tensor(new_name, out, raw_dtype=qtype)
    if fell_back:
        say(f"{len(fell_back)} tensor(s) written as f16, not q8_0 (a row is not a multiple of q8_0's blocks "
            f"of 32 values, as llama.cpp does): {', '.join(fell_back)}")


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
        _HF_EXPORT_FIX)])


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
            "which llama.cpp's byte fallback looks up", f"add them to the vocabulary, or {_HF_EXPORT_FIX}")])
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


def _add_vocab(writer, tokenizer_dir: Path, vocab_size: int, family: Family) -> list[str]:
    """tokenizer.ggml.*: a byte-level BPE as convert_hf_to_gguf.py's `_set_vocab_gpt2` writes it (model
    "gpt2", the pre-tokenizer's name, tokens and types, the merges), a SentencePiece-converted one as its
    `_set_vocab_llama_hf` does (model "llama", pre "default", tokens, scores and types, whether a space is
    prepended; no merges: llama.cpp's SPM tokenizer merges by score); then for both bos / eos / unk / pad
    ids, whether a bos and an eos are added (what the HF tokenizer does), the family's end-of-turn id and
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
    if family.eot_token in vocab:
        special.special_token_ids.setdefault("eot", vocab[family.eot_token])
    # What HF's tokenizer does, rather than SpecialVocab's reading of the post-processor (absent: no key,
    # and llama.cpp's own default per tokenizer model would decide).
    ids = tokenizer("a")["input_ids"]
    special.add_special_token["bos"] = tokenizer.bos_token_id is not None and ids[:1] == [tokenizer.bos_token_id]
    special.add_special_token["eos"] = tokenizer.eos_token_id is not None and ids[-1:] == [tokenizer.eos_token_id]
    special.add_to_gguf(writer, quiet=True)
    by_id = {i: t for t, i in vocab.items()}
    ends = [special.special_token_ids.get(kind) for kind in ("eos", "eot")]
    return list(dict.fromkeys(by_id[i] for i in ends if i is not None))


def modelfile(stops: list[str]) -> str:
    """An Ollama Modelfile for model.gguf beside it. No TEMPLATE: a Go template cannot be derived from
    a Jinja chat template faithfully, and Ollama takes the template from the GGUF's
    tokenizer.chat_template when the Modelfile has none. The stops: the tokens that end a reply."""
    lines = [f"FROM ./{GGUF_FILE}", *(f"PARAMETER stop {json.dumps(stop)}" for stop in stops)]
    return "\n".join(lines) + "\n"
