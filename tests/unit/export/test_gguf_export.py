"""`orchestrate export --format gguf`: a run directory of a tiny llama / mistral / qwen2 / gemma model
(one DDP step on one gloo rank, real checkpoint files) with a locally trained family tokenizer, exported
and read back with llama.cpp's own `gguf.GGUFReader`: every tensor is the checkpoint's (after undoing
llama.cpp's q/k permutation and Gemma's norm + 1) within the type's rounding, the hyper-parameters,
tokenizer, chat template and special ids are the run's, and the Modelfile stops on the run's eos (and
Gemma's end of turn). A SentencePiece-converted tokenizer (Llama-2's, Mistral's, Gemma's kind) is written
as llama.cpp's "llama" vocabulary, which llama.cpp's SPM algorithm (transcribed below) tokenizes as the
HF tokenizer does. Families GGUF does not cover, tokenizers it cannot carry and files it would overwrite
are refused."""

from __future__ import annotations

import heapq
import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from orchestrate.cli import cli
from orchestrate.errors import UserError
from orchestrate.export import export_checkpoint, read_model_state
from orchestrate.gguf_export import permute_qk, write_gguf
from orchestrate.planner.strategy import Strategy
from tests.helpers.chat_tokenizers import CORPUS, family_tokenizer, sentencepiece_tokenizer
from tests.helpers.plans import TINY_GPT2, make_plan
from tests.helpers.word_tokenizers import word_tokenizer

gguf = pytest.importorskip("gguf")

DDP = Strategy("ddp", 0, "none", "none", "fp32", False, 1)
SAMPLER = {"epoch": 0, "position": 0, "seed": 0, "num_blocks": 100}
SHAPE = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 416, "max_position_embeddings": 128, "rms_norm_eps": 1e-5}
ARCHS = {
    # model_type: (extra config, the family tokenizer of tests/helpers/chat_tokenizers.py, GGUF architecture)
    "llama": ({}, "llama-3", "llama"),
    "mistral": ({"sliding_window": None}, "mistral", "llama"),
    "qwen2": ({"rope_theta": 1e6, "tie_word_embeddings": True}, "qwen2", "qwen2"),  # tied as Qwen2-0.5B
    "gemma": ({"head_dim": 16}, "gemma", "gemma"),
}


def _run(root: Path, arch: dict, tokenizer: Path | None) -> Path:
    """root/run: one checkpoint (step 1) of a DDP run of `arch` after one training step, whose data.tokenizer
    is `tokenizer` (None: the byte tokenizer)."""
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    from orchestrate.backends.ddp import DDPBackend
    from orchestrate.worker import checkpointing as ck
    from tests.helpers.engines import cpu_rank, setup_engine

    torch.manual_seed(0)
    config = dict(arch)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(config.pop("model_type"), **config)).save_pretrained(
        root / "init")
    plan = make_plan(DDP, ranks=1, config={"model": {"architecture": dict(arch)},
                                           "data": {"tokenizer": str(tokenizer)} if tokenizer else {}})
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        engine = setup_engine(DDPBackend(), plan, cpu_rank(), root / "init")
        ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
        engine.train_step([{"input_ids": ids, "labels": ids}] * plan.chosen.gradient_accumulation)
        ck.Checkpointer(plan, engine, cpu_rank(), root / "run", root / "init").save(1, dict(SAMPLER))
    finally:
        dist.destroy_process_group()
    return root / "run"


def _family_run(root: Path, model_type: str, tokenizer: Path | None = None, **shape) -> tuple[Path, Path]:
    """A run of `model_type` whose tokenizer is `tokenizer`, else its family tokenizer (ARCHS)."""
    extra, tokenizer_family, _ = ARCHS[model_type]
    tokenizer = tokenizer or family_tokenizer(root / "tokenizer", tokenizer_family)
    return _run(root, {"model_type": model_type, **SHAPE, **extra, **shape}, tokenizer), tokenizer


def _unpermute_qk(weights: torch.Tensor, n_head: int) -> torch.Tensor:
    """The HF row order of a q / k tensor llama.cpp's permutation wrote."""
    return (weights.reshape(n_head, weights.shape[0] // n_head // 2, 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def test_the_q_k_permutation_puts_the_rows_hf_rotates_together_side_by_side():
    rows = torch.arange(16.0).reshape(8, 2)  # 2 heads of 4 rows (head_dim 4): HF pairs rows i and i + 2
    permuted = permute_qk(rows, 2)
    assert permuted[:, 0].tolist() == [0, 4, 2, 6, 8, 12, 10, 14]
    assert torch.equal(_unpermute_qk(permuted, 2), rows)


def _fields(reader) -> dict:
    return {name: field.contents() for name, field in reader.fields.items()}


def _hf_view(name: str, data: np.ndarray, model_type: str, config: dict) -> np.ndarray:
    """A GGUF tensor back in the checkpoint's layout: llama.cpp's q/k row order undone (llama, mistral),
    Gemma's norm + 1 taken off."""
    if ARCHS[model_type][2] == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = config["num_attention_heads"] if "q_proj" in name else config["num_key_value_heads"]
        return _unpermute_qk(torch.from_numpy(data), heads).numpy()
    if model_type == "gemma" and name.endswith("norm.weight"):
        return data - 1.0
    return data


def _check_tensors(reader, state: dict[str, torch.Tensor], model_type: str, config: dict, q8_rows: bool) -> None:
    """Every tensor of the checkpoint is in the GGUF under llama.cpp's name and equal to it: float32
    norms exactly (Gemma's as float32(w + 1), llama.cpp's convention), f16 to f16 rounding, q8_0 within half a step of its block's scale (amax / 127) and
    that scale's own f16 rounding."""
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[ARCHS[model_type][2].upper()], config["num_hidden_layers"])
    written = {t.name: t for t in reader.tensors}
    tied = model_type == "gemma" or config.get("tie_word_embeddings", False)
    expected = {names.get_name(k, try_suffixes=(".weight", ".bias")): k for k in state
                if not (tied and k == "lm_head.weight")}
    assert set(written) == set(expected)
    for gguf_name, hf_name in expected.items():
        t = written[gguf_name]
        data = gguf.quants.dequantize(t.data, t.tensor_type).reshape(state[hf_name].shape)
        got, want = _hf_view(hf_name, data.astype(np.float32), model_type, config), state[hf_name].float().numpy()
        if t.tensor_type == gguf.GGMLQuantizationType.F32:  # Gemma's norms are written as float32(w + 1)
            shifted = want + np.float32(1.0) if model_type == "gemma" and hf_name.endswith("norm.weight") else want
            assert state[hf_name].dim() == 1 and np.array_equal(data.astype(np.float32), shifted), gguf_name
        elif t.tensor_type == gguf.GGMLQuantizationType.F16:
            assert np.allclose(got, want, rtol=2**-11, atol=2**-24), gguf_name
        else:
            assert t.tensor_type == gguf.GGMLQuantizationType.Q8_0 and q8_rows, gguf_name
            blocks = want.reshape(-1, 32)
            step = np.abs(blocks).max(axis=1, keepdims=True) / 127  # q8_0's scale d; stored as f16
            bound = step * (0.5 + 127 * 2**-11)  # rounding to a step, plus 127 steps of d's f16 rounding
            assert (np.abs(got.reshape(-1, 32) - blocks) <= bound).all(), gguf_name


def _exported(root: Path, model_type: str, tokenizer: Path | None = None) -> tuple[dict[str, torch.Tensor], Path]:
    """(the model's tensors, its tokenizer) exported from a trained run's checkpoint as root/out/model.gguf."""
    run, tokenizer = _family_run(root, model_type, tokenizer)
    return read_model_state(export_checkpoint(run, root / "out", fmt="gguf", say=print)), tokenizer


def _stops(tok, model_type: str) -> list[str]:
    """The Modelfile's stops: the eos, and Gemma's end of turn (GemmaModel.set_vocab's eot)."""
    return [tok.eos_token, *(["<end_of_turn>"] if model_type == "gemma" else [])]


@pytest.mark.parametrize("model_type", list(ARCHS))
def test_each_family_round_trips_its_tensors_hyper_parameters_and_tokenizer(tmp_path, model_type):
    from transformers import AutoTokenizer

    state, tokenizer_dir = _exported(tmp_path, model_type)
    reader = gguf.GGUFReader(tmp_path / "out" / "model.gguf")
    config = {**SHAPE, **ARCHS[model_type][0]}
    _check_tensors(reader, state, model_type, config, q8_rows=False)

    arch = ARCHS[model_type][2]
    fields = _fields(reader)
    head_dim = config.get("head_dim", 16)
    assert fields["general.architecture"] == arch
    assert fields["general.file_type"] == gguf.LlamaFileType.MOSTLY_F16
    assert {k.removeprefix(f"{arch}."): fields[k] for k in fields if k.startswith(f"{arch}.")
            and "rope.dimension" not in k and "vocab_size" not in k} == pytest.approx({
        "context_length": 128, "embedding_length": 64, "block_count": 2, "feed_forward_length": 96,
        "attention.head_count": 4, "attention.head_count_kv": 2, "attention.layer_norm_rms_epsilon": 1e-5,
        "attention.key_length": head_dim, "attention.value_length": head_dim,
        "rope.freq_base": config.get("rope_theta", 10000.0)})
    if arch == "llama":  # LlamaModel.set_gguf_parameters' two
        assert (fields["llama.vocab_size"], fields["llama.rope.dimension_count"]) == (416, 16)

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    vocab = {i: t for t, i in tok.get_vocab().items()}
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == "gpt-2"
    assert fields["tokenizer.ggml.tokens"] == [vocab.get(i, f"[PAD{i}]") for i in range(416)]
    assert fields["tokenizer.ggml.eos_token_id"] == tok.eos_token_id
    assert fields.get("tokenizer.ggml.bos_token_id") == tok.bos_token_id
    assert fields["tokenizer.ggml.add_bos_token"] is (tok.bos_token_id is not None)
    assert fields["tokenizer.ggml.add_eos_token"] is False
    assert fields.get("tokenizer.ggml.eot_token_id") == (tok.convert_tokens_to_ids("<end_of_turn>")
                                                         if model_type == "gemma" else None)
    assert len(fields["tokenizer.ggml.merges"]) == len(
        json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["merges"])
    assert fields["tokenizer.chat_template"] == tok.chat_template
    assert (tmp_path / "out" / "Modelfile").read_text() == "FROM ./model.gguf\n" + "".join(
        f'PARAMETER stop "{stop}"\n' for stop in _stops(tok, model_type))


def _llama_cpp_spm(fields: dict, text: str) -> list[int]:
    """llama.cpp's tokenization of plain `text` with a GGUF's "llama" (SPM) vocabulary, transcribed from
    llama-vocab.cpp: a space before the text when add_space_prefix, spaces as "▁" (llama_escape_whitespace),
    then llm_tokenizer_spm_session::tokenize: UTF-8 characters as symbols, the adjacent pair whose joined
    text is a token of the highest score merged first (the leftmost among equals), until none is; a
    symbol that is no token is written as its bytes' <0xNN> tokens. A bos first when add_bos_token."""
    ids = {token: i for i, token in enumerate(fields["tokenizer.ggml.tokens"])}
    scores = fields["tokenizer.ggml.scores"]
    symbols = list((" " + text if fields["tokenizer.ggml.add_space_prefix"] else text).replace(" ", "\u2581"))
    after, before = [*range(1, len(symbols)), -1], list(range(-1, len(symbols) - 1))
    queue: list[tuple[float, int, int, int]] = []

    def try_pair(left: int, right: int) -> None:
        if left >= 0 and right >= 0 and symbols[left] + symbols[right] in ids:
            size = len(symbols[left]) + len(symbols[right])
            heapq.heappush(queue, (-scores[ids[symbols[left] + symbols[right]]], left, right, size))

    for i in range(1, len(symbols)):
        try_pair(i - 1, i)
    while queue:
        _, left, right, size = heapq.heappop(queue)
        if not symbols[left] or not symbols[right] or len(symbols[left]) + len(symbols[right]) != size:
            continue  # one of the two has merged since
        symbols[left], symbols[right] = symbols[left] + symbols[right], ""
        after[left] = after[right]
        if after[right] >= 0:
            before[after[right]] = left
        try_pair(before[left], left)
        try_pair(left, after[left])
    out = [fields["tokenizer.ggml.bos_token_id"]] if fields["tokenizer.ggml.add_bos_token"] else []
    i = 0
    while i != -1:
        out += [ids[symbols[i]]] if symbols[i] in ids else [ids[f"<0x{b:02X}>"] for b in symbols[i].encode()]
        i = after[i]
    return out


SENTENCEPIECE_RUNS = [
    # (model_type, family of sentencepiece_tokenizer, its form): Llama-2 and Mistral share a layout
    ("llama", "mistral", "transformers"),
    ("mistral", "mistral", "hub"),
    ("gemma", "gemma", "transformers"),
]


@pytest.mark.parametrize(("model_type", "family", "form"), SENTENCEPIECE_RUNS)
def test_a_sentencepiece_tokenizer_is_written_as_the_llama_vocabulary_llama_cpp_tokenizes_as_hf(
        tmp_path, model_type, family, form):
    from transformers import AutoTokenizer

    tokenizer = sentencepiece_tokenizer(tmp_path / "tokenizer", family, form)
    state, _ = _exported(tmp_path, model_type, tokenizer)
    reader = gguf.GGUFReader(tmp_path / "out" / "model.gguf")
    _check_tensors(reader, state, model_type, {**SHAPE, **ARCHS[model_type][0]}, q8_rows=False)
    fields = _fields(reader)
    tok = AutoTokenizer.from_pretrained(tokenizer)
    vocab = {i: t for t, i in tok.get_vocab().items()}
    assert fields["tokenizer.ggml.model"] == "llama" and fields["tokenizer.ggml.pre"] == "default"
    assert "tokenizer.ggml.merges" not in fields
    assert fields["tokenizer.ggml.tokens"] == [vocab.get(i, f"[PAD{i}]") for i in range(416)]
    assert len(fields["tokenizer.ggml.scores"]) == 416
    types = dict(enumerate(fields["tokenizer.ggml.token_type"]))
    byte_ids = {tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in range(256)}
    assert {i for i, t in types.items() if t == gguf.TokenType.BYTE} == byte_ids
    assert {i for i, t in types.items() if t == gguf.TokenType.CONTROL} == set(tok.all_special_ids)
    assert {i for i, t in types.items() if t == gguf.TokenType.UNUSED} == set(range(416)) - set(vocab)
    assert (fields["tokenizer.ggml.bos_token_id"], fields["tokenizer.ggml.eos_token_id"],
            fields["tokenizer.ggml.unknown_token_id"]) == (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id)
    assert fields["tokenizer.ggml.add_bos_token"] is True and fields["tokenizer.ggml.add_eos_token"] is False
    first_piece = tok.convert_ids_to_tokens(tok("a", add_special_tokens=False)["input_ids"])[0]
    assert fields["tokenizer.ggml.add_space_prefix"] is first_piece.startswith("\u2581")
    assert fields.get("tokenizer.ggml.eot_token_id") == (tok.convert_tokens_to_ids("<end_of_turn>")
                                                         if model_type == "gemma" else None)
    assert fields["tokenizer.chat_template"] == tok.chat_template
    assert (tmp_path / "out" / "Modelfile").read_text() == "FROM ./model.gguf\n" + "".join(
        f'PARAMETER stop "{stop}"\n' for stop in _stops(tok, model_type))

    # Every string of up to three of the corpus's letters, the corpus, and text outside the vocabulary
    # (bytes), as llama.cpp would tokenize them: the scores make its merges the BPE's.
    letters = sorted(set("".join(CORPUS)) - {" "})
    texts = ["".join(p) for n in (1, 2, 3) for p in itertools.product(letters, repeat=n)]
    texts += [*sorted(set(CORPUS)), "the dog sees  the élan", "naïve café ☕"]
    hf = tok(texts)["input_ids"]
    assert [text for text, ids in zip(texts, hf, strict=True) if _llama_cpp_spm(fields, text) != ids] == []


def test_a_sentencepiece_tokenizer_llama_cpp_cannot_read_as_hf_does_is_refused(tmp_path):
    """Without all 256 byte tokens llama.cpp's byte fallback has no token to look up; a Metaspace that
    splits the text into words is a split llama.cpp's SPM tokenizer does not make."""
    from transformers import AutoConfig

    config = AutoConfig.for_model("llama", **SHAPE)
    for change, message in (("drop a byte token", "byte tokens"), ("split on spaces", "does not cover this tokenizer")):
        tokenizer = sentencepiece_tokenizer(tmp_path / change, "mistral", "hub")
        data = json.loads((tokenizer / "tokenizer.json").read_text())
        if change == "drop a byte token":
            del data["model"]["vocab"]["<0x00>"]
        else:
            data["normalizer"] = None
            data["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first",
                                     "split": True}
        (tokenizer / "tokenizer.json").write_text(json.dumps(data))
        (tmp_path / "out").mkdir(exist_ok=True)
        with pytest.raises(UserError, match=message) as err:
            write_gguf({}, config, tokenizer, tmp_path / "out", "f16", print)
        assert "convert_hf_to_gguf.py" in str(err.value)
        assert not (tmp_path / "out" / "model.gguf").exists()


def test_q8_0_keeps_its_block_error_and_falls_back_to_f16_where_rows_do_not_divide(tmp_path):
    """intermediate_size 80: ffn_down's rows (80 values) are no whole number of q8_0's blocks of 32."""
    run, _ = _family_run(tmp_path, "llama", intermediate_size=80)
    said: list[str] = []
    ckpt = export_checkpoint(run, tmp_path / "out", fmt="gguf", quant="q8_0", say=said.append)
    reader = gguf.GGUFReader(tmp_path / "out" / "model.gguf")
    _check_tensors(reader, read_model_state(ckpt), "llama", {**SHAPE, "intermediate_size": 80}, q8_rows=True)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert {n for n, t in types.items() if t == "F16"} == {"blk.0.ffn_down.weight", "blk.1.ffn_down.weight"}
    assert types["blk.0.attn_q.weight"] == types["token_embd.weight"] == "Q8_0"
    assert _fields(reader)["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q8_0
    assert len(said) == 1 and "blk.0.ffn_down.weight [64, 80]" in said[0] and "f16, not q8_0" in said[0]


def test_llama3_rope_scaling_is_written_as_rope_freqs_that_give_the_hf_frequencies(tmp_path):
    """Llama 3.1's scaled frequencies are base frequencies / rope_freqs in llama.cpp: equal to the
    inv_freq transformers computes for the same config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    run, _ = _family_run(tmp_path, "llama", rope_parameters=rope)
    export_checkpoint(run, tmp_path / "out", fmt="gguf", say=print)
    factors = next(t for t in gguf.GGUFReader(tmp_path / "out" / "model.gguf").tensors if t.name == "rope_freqs.weight")
    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path / "init")).model.rotary_emb.inv_freq
    base = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    assert torch.allclose(base / torch.from_numpy(np.array(factors.data)), hf, rtol=1e-6)


def test_the_byte_tokenizer_is_carried_as_its_256_bytes_and_end_of_document(tmp_path):
    run = _run(tmp_path, {"model_type": "llama", **SHAPE, "vocab_size": 257}, None)
    result = CliRunner().invoke(cli, ["export", str(run), "--out", str(tmp_path / "out"), "--format", "gguf"])
    assert result.exit_code == 0, result.output
    fields = _fields(gguf.GGUFReader(tmp_path / "out" / "model.gguf"))
    byte_chars = gguf.vocab.bytes_to_unicode()  # GPT-2's printable character of each byte
    assert fields["tokenizer.ggml.tokens"] == [byte_chars[b] for b in range(256)] + ["<|endoftext|>"]
    assert fields["tokenizer.ggml.eos_token_id"] == 256 and fields["tokenizer.ggml.add_bos_token"] is False


def test_a_family_gguf_does_not_cover_is_refused_before_anything_is_written(tmp_path):
    run = _run(tmp_path, dict(TINY_GPT2), None)
    with pytest.raises(UserError, match="does not cover the 'gpt2' family") as err:
        export_checkpoint(run, tmp_path / "out", fmt="gguf")
    assert "llama, mistral, qwen2, gemma" in str(err.value) and "--format hf" in str(err.value)
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_gguf_cannot_carry_is_refused(tmp_path):
    tokenizer = word_tokenizer(tmp_path / "words", ["the", "cat", "sat"])
    run = _run(tmp_path, {"model_type": "llama", **SHAPE}, tokenizer)
    with pytest.raises(UserError, match="does not cover this tokenizer") as err:
        export_checkpoint(run, tmp_path / "out", fmt="gguf")
    assert "WordLevel" in str(err.value) and "convert_hf_to_gguf.py" in str(err.value)


def test_files_gguf_export_did_not_write_are_never_replaced_and_quant_is_for_gguf(tmp_path):
    run, _ = _family_run(tmp_path, "qwen2")
    mine = tmp_path / "out" / "model.gguf"
    mine.parent.mkdir()
    mine.write_text("the user's")
    with pytest.raises(UserError, match="holds files orchestrate did not write") as err:
        export_checkpoint(run, tmp_path / "out", fmt="gguf")
    assert "model.gguf and Modelfile" in str(err.value) and mine.read_text() == "the user's"
    with pytest.raises(UserError, match="--quant is for GGUF"):
        export_checkpoint(run, tmp_path / "hf", quant="q8_0")
    again = [export_checkpoint(run, tmp_path / "twice", fmt="gguf", quant="q8_0", say=print) for _ in range(2)]
    assert again[0] == again[1] and (tmp_path / "twice" / "model.gguf").stat().st_size > 0
