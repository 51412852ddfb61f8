"""`orchestrate plan` for every task: the memory table has each term, the logits follow the head
(num_labels wide and one row per sequence for a classifier, the vocabulary per token for LM heads),
and the FSDP root unit the planner counts is what the backend leaves outside the blocks it wraps."""

from __future__ import annotations

import io

import pytest
import yaml
from rich.console import Console

from orchestrate.api import plan_from_file
from orchestrate.backends.hf_io import find_blocks, model_block_class_names
from orchestrate.hardware.presets import load_preset
from orchestrate.model.meta import build_meta_model, load_model_config, shape_from_config
from orchestrate.planner import constants as k
from orchestrate.planner.plan import RunPlan
from orchestrate.planner.report import memory_table
from tests.helpers.plans import TINY_GPT2
from tests.methods.tasks.test_task_config import BERT

MODELS = {"causal-lm": TINY_GPT2, "masked-lm": BERT, "sequence-classification": BERT}
SEQ = 64


def _plan(tmp_path, task: str):
    model = {"architecture": MODELS[task], "task": task}
    if task == "sequence-classification":
        model["num_labels"] = 5
    path = tmp_path / f"{task}.yaml"
    path.write_text(yaml.safe_dump({"model": model, "train": {"seq_len": SEQ, "global_batch_size": 8}}))
    return plan_from_file(path, (), load_preset("rtx3070"))


@pytest.mark.parametrize("task", sorted(MODELS))
def test_plan_shows_memory_for_every_task(tmp_path, task):
    plan = _plan(tmp_path, task)
    assert isinstance(plan, RunPlan) and plan.chosen.fits
    chosen = plan.chosen
    gpu = chosen.memory.gpu
    mb = chosen.strategy.micro_batch_size
    per = k.LOGITS_BYTES_PER_TOKEN_VOCAB_FP32 if chosen.strategy.precision == "fp32" else k.LOGITS_BYTES_PER_TOKEN_VOCAB_16BIT
    if task == "sequence-classification":
        assert gpu["logits"] == per * mb * 5  # micro-batch x num_labels: no sequence, no vocabulary
    else:
        assert gpu["logits"] == per * mb * SEQ * MODELS[task]["vocab_size"]
    assert gpu["activations"] > 0 and gpu["weights"] > 0
    out = io.StringIO()
    Console(file=out, width=120).print(memory_table(chosen, plan.hardware))
    table = out.getvalue()
    assert all(term in table for term in ("weights", "activations", "logits", "total")), table
    # A BERT config trains an encoder in either BERT task; the shape counts the head each task builds.
    if task != "causal-lm":
        assert plan.shape.model_type == "bert" and plan.shape.task == task


@pytest.mark.parametrize("task", sorted(MODELS))
def test_the_fsdp_root_unit_is_what_the_backend_wraps_around(tmp_path, task):
    """planner/memory.py's FSDP term gathers the root (everything outside the blocks) plus blocks of
    `block_parameters`; FSDP2's setup wraps the block classes of `model_block_class_names`."""
    plan = _plan(tmp_path, task)
    hf = load_model_config(plan.config)
    hf.num_labels = plan.shape.num_labels or hf.num_labels
    shape = shape_from_config(hf, task=task)
    model = build_meta_model(hf, task=task)
    blocks = find_blocks(model, model_block_class_names(model, shape.model_type))
    inside = {id(p) for _, b in blocks for p in b.parameters()}
    outside = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values() if id(p) not in inside)
    assert len(blocks) == shape.num_layers
    assert {sum(p.numel() for p in b.parameters()) for _, b in blocks} == {shape.block_parameters}
    assert shape.root_parameters == outside
