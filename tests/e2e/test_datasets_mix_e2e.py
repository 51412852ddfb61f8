"""A run on several datasets trains through the real launcher on 2 gloo ranks: a chat JSONL, an Alpaca
JSONL and a ShareGPT JSONL (with a system column) listed under `data.datasets` with weights, a tiny
GPT-2 from its architecture and a word-level ChatML tokenizer. The launcher's data summary names what
each source gave, and every step trains on answer tokens with a finite loss that falls."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from orchestrate import api
from orchestrate.config.load import config_from_dict
from orchestrate.data.chat_templates import CHATML
from tests.helpers.chat_tokenizers import word_chat_tokenizer
from tests.helpers.plans import TINY_GPT2, cpu_hardware

pytestmark = pytest.mark.slow
WORDS = ["system", "user", "assistant", "be", "brief", "hello", "there", "paris", "capital", "of", "france", "italy",
         "rome", "say", "hi", "bonjour"]


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_weighted_mix_of_chat_alpaca_and_sharegpt_trains_on_two_ranks(tmp_path):
    _jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "capital of france"},
                                                   {"role": "assistant", "content": "paris"}]}] * 120)
    _jsonl(tmp_path / "alpaca.jsonl", [{"instruction": "say hi", "input": "", "output": "bonjour"}] * 40)
    _jsonl(tmp_path / "sharegpt.jsonl", [{"system": "be brief", "conversations": [
        {"from": "human", "value": "capital of italy"}, {"from": "gpt", "value": "rome"}]}] * 80)
    word_chat_tokenizer(tmp_path / "tok", WORDS, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], eos="<|im_end|>",
                        template=CHATML.source)
    config = config_from_dict({
        "model": {"architecture": {**TINY_GPT2, "vocab_size": 64}},
        "train": {"seq_len": 64, "global_batch_size": 8, "max_steps": 8, "seed": 0,
                  "optimizer": {"lr": 3e-3}, "output_dir": str(tmp_path / "runs")},
        "strategy": {"backend": "ddp"},
        "data": {"tokenizer": "tok", "num_proc": 1, "validation_ratio": 0.0, "datasets": [
            {"path": "chat.jsonl", "weight": 2.0}, {"path": "alpaca.jsonl", "weight": 1.0},
            {"path": "sharegpt.jsonl", "weight": 1.0}]}}, tmp_path)
    result = api.launch(api.launch_request(config, cpu_hardware(2), run_dir=tmp_path / "run"))
    assert result.exit_code == 0, result.messages[-5:]
    summary = next(m for m in result.messages if "mix:" in m)
    assert ("chat.jsonl: 80 of 120 chat records (weight 2.0); alpaca.jsonl: 40 of 40 alpaca records (weight 1.0); "
            "sharegpt.jsonl: 40 of 80 chat records (weight 1.0)") in summary
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 8 and all(math.isfinite(r["loss"]) and r["loss_tokens"] > 0 for r in steps)
    assert steps[-1]["loss"] < steps[0]["loss"]
