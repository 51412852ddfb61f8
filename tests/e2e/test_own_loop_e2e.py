"""The seed-style script of examples/own_loop trains under FSDP2, DeepSpeed ZeRO-2 and DDP on 2 gloo
ranks through the real launcher (`orchestrate launch CONFIG -- python train.py`), its loss falls,
and a run resumed from `orchestrate.save` ends bit-identical to the uninterrupted one."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from orchestrate import api
from orchestrate.backends.registry import get_backend
from orchestrate.cli import cli
from orchestrate.config.load import load_config
from orchestrate.errors import UserError
from orchestrate.run.checkpoints import LATEST_FILE, checkpoint_root, read_meta, step_dir_name
from tests.helpers.plans import cpu_hardware

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "own_loop"
ARGS = ("--epochs", "2", "--samples", "256")  # 256 samples / 32 per step: 8 optimizer steps an epoch


def _epoch_losses(run_dir: Path) -> dict[int, str]:
    """Rank 0's `epoch N loss L` lines, from its log file(s) under RUN_DIR/logs."""
    lines = [line.split() for log in run_dir.glob("logs/*/attempt_*/0/stdout.log")
             for line in log.read_text().splitlines() if line.startswith("epoch ")]
    return {int(words[1]): words[3] for words in lines}


def _final_state(run_dir: Path, step: int) -> tuple[dict, dict[str, torch.Tensor]]:
    ckpt = checkpoint_root(run_dir) / step_dir_name(step)
    meta = read_meta(ckpt)
    # An own-loop DDP checkpoint is DCP, laid out as FSDP2's (loop_api/torch_state.py).
    return meta.sampler, get_backend("fsdp" if meta.backend == "ddp" else meta.backend).full_state_dict(ckpt, meta)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["fsdp", "deepspeed", "ddp"])
def test_seed_loop_trains_and_resumes_bit_exact(tmp_path: Path, backend: str):
    sets = [f"train.output_dir={tmp_path}", f"strategy.backend={backend}", *(["strategy.zero_stage=0"] if backend == "ddp" else [])]
    program = ("python", str(EXAMPLE / "train.py"), *ARGS)
    whole = tmp_path / "whole"
    config = load_config(EXAMPLE / "model.yaml", sets)
    result = api.launch(api.launch_request(config, cpu_hardware(2), run_dir=whole, program=program),
                        api.choose_transport(program=program))
    assert result.exit_code == 0, result.messages
    assert result.plan.strategy.backend == backend and result.plan.chosen.gradient_accumulation == 2
    assert result.plan.shape.parameters == 19_204  # planned from train.py's Net (model.module), prepare agreed
    losses = _epoch_losses(whole)
    assert float(losses[2]) < float(losses[1]) < 1.386, losses  # below chance (ln 4), and falling

    # The interrupted run: the same run directory as it was after epoch 1 (step 8), resumed.
    cut = tmp_path / "cut"
    shutil.copytree(whole, cut, ignore=shutil.ignore_patterns("logs", step_dir_name(16)))
    (checkpoint_root(cut) / LATEST_FILE).write_text(step_dir_name(8) + "\n")
    res = CliRunner().invoke(cli, ["launch", str(EXAMPLE / "model.yaml"), "--gpus", "2", "--resume",
                                   "--run-dir", str(cut), *[a for s in sets for a in ("--set", s)], "--", *program])
    assert res.exit_code == 0, res.output
    resumed = _epoch_losses(cut)
    assert list(resumed) == [2] and resumed[2] == losses[2]  # it continued at epoch 2, not from scratch

    saved_whole, weights_whole = _final_state(whole, 16)
    saved_cut, weights_cut = _final_state(cut, 16)
    assert saved_cut == saved_whole and saved_cut["user"]["epoch"] == 2 and saved_cut["loader"] == {"epoch": 2}
    assert weights_cut.keys() == weights_whole.keys() and len(weights_cut) == 6
    assert all(torch.equal(weights_cut[k], weights_whole[k]) for k in weights_whole)
    with pytest.raises(UserError, match="not a Hugging Face model"):  # an nn.Module of the script's own
        api.export(whole, tmp_path / "export")


@pytest.mark.slow
def test_seed_loop_trains_in_bf16_under_deepspeed(tmp_path: Path):
    """DeepSpeed's bf16 mode runs the module in bf16 without autocast: the loader casts the
    script's float inputs (else: "mat1 and mat2 must have the same dtype")."""
    program = ("python", str(EXAMPLE / "train.py"), "--epochs", "1", "--samples", "256")
    config = load_config(EXAMPLE / "model.yaml", [f"train.output_dir={tmp_path}", "strategy.backend=deepspeed",
                                                  "train.precision=bf16"])
    result = api.launch(api.launch_request(config, cpu_hardware(2), run_dir=tmp_path / "run", program=program))
    assert result.exit_code == 0, result.messages
    assert result.plan.chosen.name == "deepspeed-z2-bf16-mb8"
    assert float(_epoch_losses(tmp_path / "run")[1]) < 1.386  # below chance (ln 4) after one epoch
