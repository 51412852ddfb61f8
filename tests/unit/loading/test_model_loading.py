"""Loading weights without N full copies: replicated (meta -> device -> tensor by tensor) and
sharded (each rank reads its own rows), checked against transformers and the files; the node's
peak memory while loading, against N ranks x from_pretrained."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from orchestrate.errors import UserError
from tests.helpers import loading
from tests.helpers.dist import run_on_ranks
from tests.helpers.memory import NodePeak, write_random_model
from tests.helpers.plans import TINY_GPT2

# Odd sizes on purpose: 2 ranks shard 301 vocab rows and 100 MLP rows unevenly.
ODD_LLAMA = {"model_type": "llama", "hidden_size": 48, "intermediate_size": 100, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 301, "max_position_embeddings": 64,
             "tie_word_embeddings": False}
# ~168M parameters (672 MB in fp32): large enough that two full copies clearly exceed one.
SPIKE_LLAMA = {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
               "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 32000,
               "max_position_embeddings": 256, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    dirs = {"llama": root / "llama", "gpt2": root / "gpt2"}
    write_random_model(dirs["llama"], ODD_LLAMA, shard_bytes=20_000)  # several shards
    write_random_model(dirs["gpt2"], TINY_GPT2)
    return dirs


def _file_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_replicated_load_matches_from_pretrained(model_dirs, name: str):
    from transformers import AutoModelForCausalLM

    from orchestrate.loading.weights import load_replicated

    ref = AutoModelForCausalLM.from_pretrained(model_dirs[name], dtype=torch.float32)
    mine = load_replicated(model_dirs[name], torch.device("cpu"), torch.float32)
    ref_state, mine_state = ref.state_dict(), mine.state_dict()
    assert ref_state.keys() == mine_state.keys()
    assert all(torch.equal(ref_state[k], mine_state[k]) for k in ref_state)
    ids = torch.randint(0, 257, (2, 16))
    with torch.no_grad():
        assert torch.equal(ref(input_ids=ids).logits, mine(input_ids=ids).logits)  # rotary buffers included
    if name == "gpt2":
        assert mine.lm_head.weight is mine.transformer.wte.weight  # ties survive to_empty


def test_replicated_load_casts_parameters_but_keeps_buffers(model_dirs):
    from orchestrate.loading.weights import load_replicated

    model = load_replicated(model_dirs["llama"], torch.device("cpu"), torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32  # as DeepSpeed's own cast leaves it
    files = _file_tensors(model_dirs["llama"])
    assert torch.equal(model.lm_head.weight, files["lm_head.weight"].to(torch.bfloat16))


def test_mismatched_weights_are_one_user_error_before_any_read(model_dirs, tmp_path: Path):
    from safetensors.torch import load_file, save_file

    from orchestrate.loading.weights import load_replicated

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((model_dirs["gpt2"] / "config.json").read_text())
    state = {}
    for f in model_dirs["gpt2"].glob("*.safetensors"):
        state.update(load_file(str(f)))
    state.pop("transformer.ln_f.weight")
    state["transformer.wpe.weight"] = torch.zeros(3, 3)
    state["extra.weight"] = torch.zeros(1)
    save_file(state, str(broken / "model.safetensors"))
    with pytest.raises(UserError) as err:
        load_replicated(broken, torch.device("cpu"), torch.float32)
    text = str(err.value)
    assert "missing: transformer.ln_f.weight" in text and "unexpected: extra.weight" in text
    assert "transformer.wpe.weight: file (3, 3)" in text and str(broken) in text


def _sharded_rank(model_dir: str) -> dict[str, bool]:
    """FSDP2-shard the model on 2 gloo ranks, fill it with load_sharded, compare with the files."""
    from orchestrate.loading.weights import load_sharded

    model, layout = loading.sharded_meta_model(model_dir)
    load_sharded(model, Path(model_dir), layout)
    files = _file_tensors(Path(model_dir))
    out = {}
    for name, param in model.named_parameters():  # full_tensor is collective: same order on every rank
        local_rows = param.to_local().shape[0]
        out[name] = bool(torch.equal(param.full_tensor(), files[name])) and local_rows < files[name].shape[0]
    return out


@pytest.mark.slow
def test_sharded_load_gives_every_rank_its_rows_of_the_files(model_dirs):
    results = run_on_ranks(_sharded_rank, 2, str(model_dirs["llama"]))
    for rank in (0, 1):
        assert results[rank] and all(results[rank].values()), {k: v for k, v in results[rank].items() if not v}


@pytest.mark.slow
def test_sharded_loading_holds_one_model_per_node_not_one_per_rank(tmp_path: Path):
    # bf16 on disk, as Hub checkpoints are, loaded as fp32 (the training master weights).
    params = write_random_model(tmp_path / "model", SPIKE_LLAMA, shard_bytes=256 * 2**20, dtype="bfloat16")
    model_bytes = 4 * params
    peaks = {}
    for name, fn in (("naive", loading.naive), ("sharded", loading.sharded)):
        with NodePeak() as node:
            run_on_ranks(fn, 2, str(tmp_path / "model"))
        peaks[name] = node.pss
    # Both include 2 x the Python/torch/transformers runtime (~0.3 GB each); the weights are
    # 2 x model_bytes for the naive load and 1 x (two halves) for the sharded one. (With fp32 files
    # and fp32 weights transformers 5 maps the files instead of copying: its pages are shared until
    # written; bench/model_loading.py measures that case too.)
    saved = peaks["naive"] - peaks["sharded"]
    report = {k: round(v / 2**20) for k, v in peaks.items()} | {"model_MiB": model_bytes // 2**20}
    print("node peak PSS MiB:", json.dumps(report))
    assert saved > 0.7 * model_bytes, report
