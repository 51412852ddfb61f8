"""Refactors leave plans alone: for a fixed set of configs and machines, the plan's public JSON
(candidates with their memory and speed breakdowns, the choice, the notes, the limits) equals the
recording in tests/golden/plans/. A change that is meant to move a plan re-records them:

    ORCHESTRATE_RECORD_PLANS=1 .venv/bin/python -m pytest tests/unit/planner/test_plan_identity.py

and the diff of tests/golden/plans/ is reviewed with the change."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from orchestrate import api
from orchestrate.errors import UserError
from orchestrate.hardware.flags import HardwareFlags

ROOT = Path(__file__).resolve().parents[3]
GOLDEN = ROOT / "tests" / "golden" / "plans"
TEACHER = GOLDEN / "teacher"
"""A distillation teacher's config.json (a wider tiny GPT-2) and the byte tokenizer's files: plans read
its shape and compare the tokenizers, never weights."""
LONG_POSITIONS = "model.architecture.max_position_embeddings=131072"

CASES = {
    "llama3-8b-full-2x8": ("examples/llama3-8b.yaml", [], dict(gpus=2, gpu_mem="8GiB", cpu_mem="64GiB")),
    "llama3-8b-qlora-1x8": ("examples/llama3-8b.yaml", ["train.method=qlora"], dict(gpus=1, gpu_mem="8GiB", cpu_mem="64GiB")),
    "llama3-8b-lora-2x24": ("examples/llama3-8b.yaml", ["train.method=lora"], dict(gpus=2, gpu_mem="24GiB", cpu_mem="128GiB")),
    "llama3-8b-qlora-16k-1x8": ("examples/llama3-8b.yaml", ["train.method=qlora", "train.seq_len=16384", LONG_POSITIONS],
                                dict(gpus=1, gpu_mem="8GiB", cpu_mem="64GiB")),
    "llama3-8b-qlora-64k-2x8": ("examples/llama3-8b.yaml", ["train.method=qlora", "train.seq_len=65536", LONG_POSITIONS],
                                dict(gpus=2, gpu_mem="8GiB", cpu_mem="128GiB")),
    "llama3-8b-auto-1x8": ("examples/llama3-8b.yaml", ["train.method=auto"], dict(gpus=1, gpu_mem="8GiB", cpu_mem="64GiB")),
    "llama3-8b-full-2x2x8-nvme": ("examples/llama3-8b.yaml", [], dict(gpus=2, nodes=2, gpu_mem="8GiB", cpu_mem="32GiB", nvme=str(GOLDEN))),
    "llama2-70b-1x80-refused": ("examples/llama2-70b.yaml", [], dict(gpus=1, gpu_mem="80GiB", cpu_mem="64GiB")),
    "llama-1.1b-dpo-1x8": ("examples/llama-1.1b.yaml", ["preference.beta=0.1", "train.method=qlora"],
                           dict(gpus=1, gpu_mem="8GiB", cpu_mem="32GiB")),
    "llama-1.1b-kto-2x8": ("examples/llama-1.1b.yaml", ["preference.loss=kto"], dict(gpus=2, gpu_mem="8GiB", cpu_mem="32GiB")),
    "gpt2-xl-prune-2x8": ("examples/gpt2-xl.yaml", ["prune.target_sparsity=0.5", "prune.schedule.end_step=10"],
                          dict(gpus=2, gpu_mem="8GiB", cpu_mem="64GiB")),
    "tiny-gpt2-cpu": ("examples/tiny-gpt2.yaml", [], dict()),
    "tiny-gpt2-distill-2x8": ("examples/tiny-gpt2.yaml", [f"distill.teacher={TEACHER}"], dict(gpus=2, gpu_mem="8GiB", cpu_mem="32GiB")),
    "tiny-gpt2-distill-qlora-1x8": ("examples/tiny-gpt2.yaml", [f"distill.teacher={TEACHER}", "train.method=qlora"],
                                    dict(gpus=1, gpu_mem="8GiB", cpu_mem="32GiB")),
    "bert-classifier-2x8": ("examples/bert-classifier.yaml", [], dict(gpus=2, gpu_mem="8GiB", cpu_mem="32GiB")),
    "cnn-own-module-1x8": ("examples/cnn/cnn.yaml", [], dict(gpus=1, gpu_mem="8GiB", cpu_mem="32GiB")),
}

VARYING = ("config_source_dir",)
"""Where the config came from: the same plan on another clone (absolute paths read as <root>)."""


def _plan(case: str) -> dict:
    path, overrides, flags = CASES[case]
    hardware = HardwareFlags(calibration=False, **flags).resolve()
    if hardware.nvme_path:  # the disk's free space today: fixed, so that the plan is
        hardware = hardware.model_copy(update={"nvme_free_bytes": 1 << 40})
    plan = api.plan_from_file(ROOT / path, overrides, hardware)
    found = {k: v for k, v in api.render_plan(plan).items() if k not in VARYING}
    if not api.is_runnable(plan):  # the refusal's message: by how much, and the remedies that fit
        with pytest.raises(UserError) as refused:
            api.require_feasible(plan)
        found["refusal"] = str(refused.value)
    return found


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_plan_equals_its_recording(case):
    found = json.dumps(_plan(case), indent=1, sort_keys=True).replace(str(ROOT), "<root>") + "\n"
    recorded = GOLDEN / f"{case}.json"
    if os.environ.get("ORCHESTRATE_RECORD_PLANS"):
        recorded.write_text(found)
    assert recorded.is_file(), f"no recording: run with ORCHESTRATE_RECORD_PLANS=1 ({__doc__.splitlines()[-3]})"
    assert found == recorded.read_text()
