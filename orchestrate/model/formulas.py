"""A model's shape from its config.json dict alone: per-family parameter formulas, no torch.

`orchestrate.model.meta` builds the model on the meta device and counts, which is exact but imports
torch and transformers (seconds). For the families below the same numbers follow from the block
structure of transformers' modeling code, cited per family, and agree with the meta-device build
field by field (docs/measurements.md#modelformulaspy). `shape_from_dict` returns None whenever it
cannot be sure (unknown family, custom code, a value of the wrong type, a layout option not modelled
here): the caller then builds on the meta device, which also produces transformers' own error messages.

Each module contributes the parameters it holds directly (DeepSpeed's `largest_layer_params` is the
largest of these, see `meta.shape_from_config`); tied weights are counted once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from orchestrate.model.shape import ModelShape


def linear(n_in: int, n_out: int, bias: bool) -> int:
    return n_in * n_out + (n_out if bias else 0)


@dataclass(frozen=True)
class Layout:
    """Parameters held directly by each module, grouped the way `ModelShape` reports them."""

    embeddings: list[int]
    """nn.Embedding modules outside the blocks (token, learned positions, token types)."""
    block: list[int]
    """The modules of one transformer block."""
    others: list[int]
    """Everything else counted once (final norm, BERT's prediction-head transform)."""
    head: int
    """Parameters held directly by the output-embedding module (including a tied weight)."""
    head_untied: int
    """The part of `head` not shared with the input embedding."""


@dataclass(frozen=True)
class Dims:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    positions: int
    tied: bool


@dataclass(frozen=True)
class Family:
    defaults: dict
    """The transformers config class defaults of the fields used here (read from its source)."""
    aliases: dict
    """The config class's `attribute_map` (config.json name -> canonical name)."""
    layout: Callable[[dict, Dims], Layout]
    head_dim_null_ok: bool = True
    """Whether an explicit `head_dim: null` means hidden // heads (llama and mistral __post_init__;
    gpt2 and bert modules never read it); qwen2/phi3 modules would use the null, gemma's class rejects it."""
    rope: bool = True
    """Rotary positions: transformers refuses an odd head_dim > 4 (modeling_rope_utils.validate_rope)."""
    unsupported: tuple[str, ...] = ()
    """Truthy keys that change the layout in a way not modelled here: fall back to the meta build."""


def _decoder_layout(c: dict, d: Dims, *, qkv_bias: bool, o_bias: bool, mlp_bias: bool,
                    fused: bool = False) -> Layout:
    """Llama-style decoder: RMSNorm (weight only) before attention and MLP, GQA attention, gated MLP
    (gate/up/down), final RMSNorm, lm_head without bias."""
    q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    if fused:  # phi3: qkv_proj and gate_up_proj are single Linear modules
        attn = [linear(d.hidden, q + 2 * kv, qkv_bias), linear(q, d.hidden, o_bias)]
        mlp = [linear(d.hidden, 2 * d.intermediate, mlp_bias), linear(d.intermediate, d.hidden, mlp_bias)]
    else:
        attn = [linear(d.hidden, q, qkv_bias), linear(d.hidden, kv, qkv_bias), linear(d.hidden, kv, qkv_bias),
                linear(q, d.hidden, o_bias)]
        mlp = [linear(d.hidden, d.intermediate, mlp_bias)] * 2 + [linear(d.intermediate, d.hidden, mlp_bias)]
    head = d.vocab * d.hidden
    return Layout(embeddings=[d.vocab * d.hidden], block=[d.hidden, *attn, d.hidden, *mlp], others=[d.hidden],
                  head=head, head_untied=0 if d.tied else head)


def _llama(c: dict, d: Dims) -> Layout:
    # transformers/models/llama/modeling_llama.py: LlamaAttention (q/k/v/o bias=attention_bias),
    # LlamaMLP (bias=mlp_bias), LlamaRMSNorm x2 per layer, LlamaModel.norm, LlamaForCausalLM.lm_head.
    return _decoder_layout(c, d, qkv_bias=c["attention_bias"], o_bias=c["attention_bias"], mlp_bias=c["mlp_bias"])


def _mistral(c: dict, d: Dims) -> Layout:
    # transformers/models/mistral/modeling_mistral.py: every Linear bias=False.
    return _decoder_layout(c, d, qkv_bias=False, o_bias=False, mlp_bias=False)


def _qwen2(c: dict, d: Dims) -> Layout:
    # transformers/models/qwen2/modeling_qwen2.py: q/k/v bias=True, o_proj and the MLP bias=False.
    return _decoder_layout(c, d, qkv_bias=True, o_bias=False, mlp_bias=False)


def _phi3(c: dict, d: Dims) -> Layout:
    # transformers/models/phi3/modeling_phi3.py: fused qkv_proj (heads*hd + 2*kv*hd) and
    # gate_up_proj (2*intermediate), every Linear bias=False.
    return _decoder_layout(c, d, qkv_bias=False, o_bias=False, mlp_bias=False, fused=True)


def _gemma(c: dict, d: Dims) -> Layout:
    # transformers/models/gemma/modeling_gemma.py: q/k/v/o bias=attention_bias, MLP bias=False,
    # GemmaRMSNorm holds one weight of hidden_size; head_dim is its own field (default 256).
    return _decoder_layout(c, d, qkv_bias=c["attention_bias"], o_bias=c["attention_bias"], mlp_bias=False)


def _gpt2(c: dict, d: Dims) -> Layout:
    # transformers/models/gpt2/modeling_gpt2.py: GPT2Block = ln_1, GPT2Attention (c_attn Conv1D
    # H -> 3H, c_proj H -> H, both with bias), ln_2, GPT2MLP (c_fc H -> inner, c_proj inner -> H,
    # with bias); LayerNorms hold weight and bias. wte + wpe, ln_f, lm_head without bias.
    h = d.hidden
    block = [2 * h, linear(h, 3 * h, True), linear(h, h, True), 2 * h,
             linear(h, d.intermediate, True), linear(d.intermediate, h, True)]
    head = d.vocab * h
    return Layout(embeddings=[d.vocab * h, d.positions * h], block=block, others=[2 * h],
                  head=head, head_untied=0 if d.tied else head)


def _bert(c: dict, d: Dims) -> Layout:
    # transformers/models/bert/modeling_bert.py, BertLMHeadModel: BertModel(add_pooling_layer=False):
    # word/position/token-type embeddings + LayerNorm; BertLayer = query/key/value/dense (bias) +
    # LayerNorm, intermediate dense, output dense + LayerNorm. cls.predictions: transform (dense +
    # LayerNorm), decoder Linear(H, V, bias) whose bias is tied to predictions.bias
    # (_tied_weights_keys) and whose weight is tied to word_embeddings. transformers 5 applies both
    # ties only under tie_word_embeddings; untied, predictions.bias is a parameter of its own.
    h = d.hidden
    block = [linear(h, h, True)] * 4 + [2 * h, linear(h, d.intermediate, True), linear(d.intermediate, h, True), 2 * h]
    embeddings = [d.vocab * h, d.positions * h, c["type_vocab_size"] * h]
    others = [2 * h, linear(h, h, True), 2 * h] + ([] if d.tied else [d.vocab])
    return Layout(embeddings=embeddings, block=block, others=others,
                  head=linear(h, d.vocab, True), head_untied=d.vocab + (0 if d.tied else d.vocab * h))


# Defaults: the dataclass fields of each transformers 5 config class
# (transformers/models/<family>/configuration_<family>.py), equal to AutoConfig.for_model(model_type)'s
# (docs/measurements.md#modelformulaspy).
_DECODER = {"num_key_value_heads": None, "head_dim": None}
FAMILIES: dict[str, Family] = {
    "gpt2": Family(
        defaults={"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12,
                  "n_inner": None, "tie_word_embeddings": True, "head_dim": None},
        aliases={"hidden_size": "n_embd", "max_position_embeddings": "n_positions",
                 "num_attention_heads": "n_head", "num_hidden_layers": "n_layer"},
        layout=_gpt2, rope=False, unsupported=("add_cross_attention",)),
    "llama": Family(
        defaults={**_DECODER, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
                  "num_hidden_layers": 32, "num_attention_heads": 32, "max_position_embeddings": 2048,
                  "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "pad_token_id": None},
        aliases={}, layout=_llama),
    "mistral": Family(
        defaults={**_DECODER, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                  "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                  "max_position_embeddings": 4096 * 32, "tie_word_embeddings": False,
                  "pad_token_id": None},
        aliases={}, layout=_mistral),
    "qwen2": Family(
        defaults={**_DECODER, "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
                  "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
                  "max_position_embeddings": 32768, "tie_word_embeddings": False,
                  "pad_token_id": None},
        aliases={}, layout=_qwen2, head_dim_null_ok=False),
    "phi3": Family(
        defaults={**_DECODER, "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192,
                  "num_hidden_layers": 32, "num_attention_heads": 32, "max_position_embeddings": 4096,
                  "tie_word_embeddings": False, "pad_token_id": 32000},
        aliases={}, layout=_phi3, head_dim_null_ok=False),
    "gemma": Family(
        defaults={"vocab_size": 256000, "hidden_size": 3072, "intermediate_size": 24576, "num_hidden_layers": 28,
                  "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 256,
                  "max_position_embeddings": 8192, "tie_word_embeddings": True, "attention_bias": False,
                  "pad_token_id": 0},
        aliases={}, layout=_gemma, head_dim_null_ok=False),
    "bert": Family(
        defaults={"vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                  "intermediate_size": 3072, "max_position_embeddings": 512, "type_vocab_size": 2,
                  "tie_word_embeddings": True, "head_dim": None, "pad_token_id": 0},
        aliases={}, layout=_bert, rope=False, unsupported=("add_cross_attention",)),
}
_INTS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings",
         "intermediate_size", "num_key_value_heads", "head_dim", "type_vocab_size", "n_inner")
_BOOLS = ("tie_word_embeddings", "attention_bias", "mlp_bias")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _resolve(family: Family, config: dict) -> dict | None:
    """config.json values over the class defaults, under canonical names; None when a value is unusable."""
    canonical = {v: k for k, v in family.aliases.items()}
    merged = {canonical.get(k, k): v for k, v in family.defaults.items()}
    for key, value in config.items():
        merged[canonical.get(key, key)] = value
    for key in _INTS:
        if merged.get(key) is not None and not _is_int(merged[key]):
            return None
    if any(key in merged and not isinstance(merged[key], bool) for key in _BOOLS):
        return None
    return merged


def _dims(family: Family, c: dict, config: dict) -> Dims | None:
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    if hidden is None or heads is None or c["vocab_size"] is None or c["num_hidden_layers"] is None:
        return None
    if "n_inner" in c:  # the GPT-2 family (GPT2Block): n_inner null means 4 * n_embd
        intermediate = c["n_inner"] or 4 * hidden
    else:
        intermediate = c.get("intermediate_size")
    head_dim = c.get("head_dim")
    if head_dim is None and "head_dim" in config and not family.head_dim_null_ok:
        return None  # an explicit null qwen2/phi3 modules cannot use and gemma's config class rejects
    pad = c.get("pad_token_id")  # nn.Embedding(padding_idx=pad_token_id) refuses one outside the vocabulary
    if "pad_token_id" in family.defaults and pad is not None and not (
            isinstance(pad, int) and -c["vocab_size"] <= pad < c["vocab_size"]):
        return None
    if hidden % heads:
        return None  # llama's config refuses it, gpt2/bert modules split hidden by heads: the meta build reports it
    head_dim = head_dim or hidden // heads
    if family.rope and head_dim > 4 and head_dim % 2:
        return None  # odd rotary dimension (partial_rotary_factor aside): the config class refuses it
    kv = c.get("num_key_value_heads") or heads
    if intermediate is None or c.get("max_position_embeddings") is None:
        return None
    return Dims(hidden=hidden, layers=c["num_hidden_layers"], heads=heads, kv_heads=kv,
                head_dim=head_dim, intermediate=intermediate, vocab=c["vocab_size"],
                positions=c["max_position_embeddings"], tied=c["tie_word_embeddings"])


def shape_from_dict(config: dict) -> ModelShape | None:
    """The `ModelShape` of a config.json dict (or a model.architecture mapping), or None when this
    module does not cover it and the meta-device build must measure it."""
    model_type = config.get("model_type")
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None or config.get("auto_map") or any(config.get(k) for k in family.unsupported):
        return None
    c = _resolve(family, config)
    d = _dims(family, c, config) if c is not None else None
    if d is None:
        return None
    lay = family.layout(c, d)
    block = sum(lay.block)
    embedding = sum(lay.embeddings)
    return ModelShape(
        model_type=config["model_type"],
        parameters=embedding + d.layers * block + sum(lay.others) + lay.head_untied,
        largest_layer_parameters=max([*lay.embeddings, *lay.block, *lay.others, lay.head]),
        embedding_parameters=embedding,
        lm_head_parameters=lay.head_untied,
        block_parameters=block,
        hidden_size=d.hidden,
        num_layers=d.layers,
        num_heads=d.heads,
        num_kv_heads=d.kv_heads,
        head_dim=d.head_dim,
        intermediate_size=d.intermediate,
        vocab_size=d.vocab,
        max_position_embeddings=d.positions,
        tied_embeddings=d.tied,
    )
