"""Run directories without training: as `orchestrate report` reads them (plan.json and metrics.jsonl),
and as `orchestrate chat` reads them (plan.json, a tiny GPT-2 and its tokenizer in RUN_DIR/model)."""

from __future__ import annotations

import json
from pathlib import Path

from orchestrate.planner.strategy import Strategy
from tests.helpers.chat_tokenizers import family_tokenizer
from tests.helpers.plans import TINY_GPT2, make_plan

DDP = Strategy("ddp", 0, "none", "none", "fp32", False, 2)


def fake_run(path: Path, marked: bool = True) -> Path:
    """`path` with the run marker (unless `marked` is False), a DDP plan and two steps of metrics."""
    from orchestrate.run.layout import write_marker

    path.mkdir(parents=True)
    if marked:
        write_marker(path)
    make_plan(DDP).write(path / "plan.json")
    records = [{"step": s, "loss": 5.0 / s, "lr": 1e-3, "grad_norm": 1.0, "tokens": 64, "tokens_per_s": 100.0,
                "rss_peak_bytes_max_rank": 2**28, "predicted_gpu_bytes_per_rank": 2**27} for s in (1, 2)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def chat_run(root: Path, train_file: str, record: dict, config: dict) -> tuple[Path, object]:
    """(root/run, its plan): a finished 1-rank run trained on one `record` in root/`train_file`, whose
    RUN_DIR/model holds an untrained tiny GPT-2 and a qwen2-family tokenizer that has a chat template
    (root/tok). `config`: the plan's config beside the model, its `data` merged over the file's."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    family_tokenizer(root / "tok", "qwen2")
    (root / train_file).write_text(json.dumps(record) + "\n")
    data = {"tokenizer": "tok", "train_files": [train_file], **config.get("data", {})}
    plan = make_plan(Strategy("ddp", 0, "none", "none", "fp32", False, 1), ranks=1, source_dir=root, config={
        **config, "model": {"architecture": {**TINY_GPT2, "vocab_size": 400}}, "data": data})
    run = root / "run"
    run.mkdir()
    plan.write(run / "plan.json")
    model = GPT2LMHeadModel(GPT2Config(**{k: v for k, v in TINY_GPT2.items() if k not in ("model_type", "vocab_size")},
                                       vocab_size=400))
    model.save_pretrained(run / "model")
    AutoTokenizer.from_pretrained(root / "tok").save_pretrained(run / "model")
    return run, plan
