"""A LoRA run end to end through the real launcher (torchrun, 2 gloo ranks): the run writes
RUN_DIR/adapter and RUN_DIR/model through the worker's save stage, both load, and `orchestrate export
--merge` rebuilds the merged model from the run's checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from orchestrate import api
from orchestrate.cli import cli
from orchestrate.config.load import config_from_dict
from tests.helpers.plans import cpu_hardware
from tests.methods.lora.test_lora_backends import FAMILIES, VOCAB

MERGE_TOLERANCE = 1e-4
"""Max |logit difference| between fp32 models that hold the same weights summed in another order."""


def _logits(model, probe: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=probe).logits


@pytest.mark.slow
def test_a_lora_run_writes_adapter_and_merged_model_and_export_merges_its_checkpoint(tmp_path: Path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    config = config_from_dict({
        "model": {"architecture": {**FAMILIES["llama"], "bos_token_id": 256, "eos_token_id": 256}},
        "train": {"method": "lora", "lora": {"r": 8, "alpha": 16}, "seq_len": 32, "global_batch_size": 4,
                  "max_steps": 4, "checkpoint_every": 2, "eval_every": 0, "optimizer": {"lr": 2e-2},
                  "schedule": {"warmup_steps": 1}, "output_dir": str(tmp_path)},
        "data": {"generate_demo_corpus": True}})
    run = tmp_path / "run"
    result = api.launch(api.launch_request(config, cpu_hardware(2), name="lora", run_dir=run))
    assert result.exit_code == 0, result.messages
    print(f"planned: {result.plan.chosen.name}")

    probe = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(3))
    base = AutoModelForCausalLM.from_pretrained(run / "init_model", dtype=torch.float32)
    peft_logits = _logits(PeftModel.from_pretrained(base, run / "adapter"), probe)
    merged_logits = _logits(AutoModelForCausalLM.from_pretrained(run / "model", dtype=torch.float32), probe)
    initial = _logits(AutoModelForCausalLM.from_pretrained(run / "init_model", dtype=torch.float32), probe)
    assert (merged_logits - peft_logits).abs().max().item() < MERGE_TOLERANCE
    assert (merged_logits - initial).abs().max().item() > 1e-3  # the adapters trained: not the base model

    runner = CliRunner()
    refused = runner.invoke(cli, ["export", str(run), "--out", str(tmp_path / "plain")])
    assert refused.exit_code == 2 and "--merge" in refused.output, refused.output
    done = runner.invoke(cli, ["export", str(run), "--out", str(tmp_path / "merged"), "--merge"])
    assert done.exit_code == 0, done.output
    exported = _logits(AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32), probe)
    # The newest checkpoint is the last step's: the same adapters the run merged at its end.
    assert (exported - merged_logits).abs().max().item() < MERGE_TOLERANCE
    step2 = runner.invoke(cli, ["export", str(run), "--out", str(tmp_path / "step2"), "--merge", "--step", "2"])
    assert step2.exit_code == 0, step2.output
    earlier = _logits(AutoModelForCausalLM.from_pretrained(tmp_path / "step2", dtype=torch.float32), probe)
    assert (earlier - merged_logits).abs().max().item() > 1e-4  # two more steps of training in between
