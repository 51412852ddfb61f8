"""`orchestrate export RUN_DIR --out DIR --format gguf [--quant f16|q8_0]`: the consolidated model of a
run as one GGUF file for llama.cpp and Ollama (model.gguf), its tokenizer and chat template in the
file's metadata, and an Ollama `Modelfile` beside it.

Written with llama.cpp's own Python package (`gguf`: GGUFWriter, the tensor-name maps, SpecialVocab,
the quantizers), following llama.cpp's convert_hf_to_gguf.py rule for rule: each function below names
the part of that script it mirrors. Four families (FAMILIES), whose graphs llama.cpp builds from the
keys written here; any other is refused before a checkpoint is read (`check_family`). Two kinds of
tokenizer.json: byte-level BPE (Llama-3's, Qwen2's, GPT-2's: llama.cpp's "gpt2" model) and
SentencePiece converted to a byte_fallback BPE (Llama-2's, Mistral v0.1-v0.3's, Gemma's: its "llama"
model); any other is refused (gguf_vocab.py).
"""

from __future__ import annotations

import importlib.util
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrate.errors import Problem, UserError
from orchestrate.gguf_vocab import HF_EXPORT_FIX, add_vocab

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
            "--format gguf", f"supported: {', '.join(FAMILIES)}", f"{HF_EXPORT_FIX}, or export --format hf")])
    rope_type = _rope(hf_config.to_dict()).get("rope_type", "default")
    if rope_type not in _ROPE_SCALINGS or (rope_type == "llama3" and family.arch != "LLAMA"):
        raise UserError(f"GGUF export does not cover rope scaling {rope_type!r}", [Problem(
            "--format gguf", f"covered: {', '.join(_ROPE_SCALINGS)} (llama3 for llama / mistral)", HF_EXPORT_FIX)])
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
    stops = add_vocab(writer, tokenizer_dir, hparams["vocab_size"], family.eot_token)
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
                HF_EXPORT_FIX)])
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


def modelfile(stops: list[str]) -> str:
    """An Ollama Modelfile for model.gguf beside it. No TEMPLATE: a Go template cannot be derived from
    a Jinja chat template faithfully, and Ollama takes the template from the GGUF's
    tokenizer.chat_template when the Modelfile has none. The stops: the tokens that end a reply."""
    lines = [f"FROM ./{GGUF_FILE}", *(f"PARAMETER stop {json.dumps(stop)}" for stop in stops)]
    return "\n".join(lines) + "\n"
