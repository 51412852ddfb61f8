"""The QLoRA entries of bench/gpu_check.py: their Llama-shaped bases and the optional Llama-3-8B run.

LoRA is planned for the families whose block linears orchestrate knows (orchestrate/model/linears.py:
llama, mistral, qwen2, gemma, phi3; not GPT-2's Conv1D), so these entries use a Llama shape, with the
byte tokenizer's ids (< 257) inside a larger vocabulary: no tokenizer download, and LM-head logits big
enough for the chunked loss to matter. Each base is a random bf16 directory (bench/random_base.py)
read through `model.name_or_path`, as a user's QLoRA run reads its base.

`--qlora-8b` adds the Llama-3-8B shape of examples/llama3-8b.yaml (issue 11: "QLoRA on that 8B shape on
one GPU capped at 8 GiB, measured peak vs predicted"). Its cost on a fresh machine, estimated, not yet
measured: 16 GB of bf16 shards drawn on the GPU and written (~1-2 min at 0.2-0.5 GB/s of disk), the
quantizing load (16 GB read, ~1 min), a few steps of 2 x 3072 tokens (seconds each on an H100-class
GPU), then the end of the run: RUN_DIR/model merged in fp32, a 32 GB write (~1-2 min). About 4-6
minutes and 48 GB of disk in all, which is why it is off by default and runs with its own timeout.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]

# 886,114,304 parameters: TinyLlama's widths (hidden 2048, intermediate 5632, vocab 32000) over 16
# layers, 16 heads with 8 KV heads (GQA). In bf16 it would fit 8 GiB anyway; the entries check the QLoRA terms
# (NF4 block linears, fp32 adapters, frozen bf16 embedding and head) against a real allocator.
LLAMA_09B = {"model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 16,
             "num_key_value_heads": 8, "intermediate_size": 5632, "vocab_size": 32000,
             "max_position_embeddings": 2048, "rms_norm_eps": 1.0e-5, "tie_word_embeddings": False}
ENTRIES: dict[str, dict] = {  # zoo entry -> its base and train settings (the strategy pins are in ZOO)
    "qlora-ddp-chunked-loss": {"base": "llama-0.9b", "train": {"method": "qlora", "seq_len": 1024, "loss_chunks": 8}},
    "qlora-fsdp2-full-shard": {"base": "llama-0.9b", "train": {"method": "qlora", "seq_len": 1024}},
}
LLAMA3_8B = "qlora-llama3-8b"
# Longest first: the run takes the first the planner says fits. The default headroom (0.9): with the input
# embedding in host memory (train.embedding_offload) and 8-bit AdamW states seq 3072 fits it (7.18 of 7.2 GiB
# usable on an rtx3070 profile; 4096 did before the CUDA context was measured on a GPU, 2026-12-04). The
# cap stays the card's 8 GiB either way (bench/gpu_worker.py).
SEQ_LENS_8B = (4096, 3072, 2048, 1024)
HEADROOM_8B = 0.9


def architecture(base: str) -> dict:
    if base == "llama3-8b":
        return yaml.safe_load((ROOT / "examples" / "llama3-8b.yaml").read_text())["model"]["architecture"]
    return {"llama-0.9b": LLAMA_09B}[base]


def base_dir(work: Path, base: str) -> Path:
    return work / f"base-{base}"


def prepare(base: str, work: Path) -> Path:
    """The base's config.json (planning reads it; weights come with `write_base`)."""
    from bench.random_base import write_config

    out = base_dir(work, base)
    if not (out / "config.json").is_file():
        write_config(architecture(base), out)
    return out


def write_weights_for(base: Path) -> Path:
    """A prepared base's random weights, drawn on the GPU when there is one (the CPU is the slow part)."""
    import torch

    from bench.random_base import write_weights

    cuda = torch.cuda.is_available()
    index = write_weights(base, seed=0, device="cuda" if cuda else "cpu")
    if cuda:
        torch.cuda.empty_cache()  # this process's cached blocks, not the workers' (each has its own cap)
    return index


def apply(cfg: dict, name: str, work: Path) -> dict:
    """`cfg` (a copy of gpu_check.BASE) made into QLoRA entry `name`: its base, its train settings."""
    entry = ENTRIES[name]
    cfg["model"] = {"name_or_path": str(prepare(entry["base"], work))}
    cfg["train"].update(entry["train"])
    return cfg


def llama3_8b_config(base_cfg: dict, steps: int, work: Path, hw) -> tuple[dict, list[dict]]:
    """The 8B entry's config at the longest of SEQ_LENS_8B that the planner says fits (else the
    shortest), and what each seq_len tried was planned at."""
    from orchestrate.api import plan_for
    from orchestrate.config.load import config_from_dict

    example = yaml.safe_load((ROOT / "examples" / "llama3-8b.yaml").read_text())
    tried = []
    for seq in SEQ_LENS_8B:
        cfg = json.loads(json.dumps(base_cfg))
        cfg["model"] = {"name_or_path": str(prepare("llama3-8b", work))}
        # Global batch 2 as torchtune's 8B QLoRA mark (2 x 2048): the peak is one micro-batch's; more
        # accumulation would only lengthen the steps. adamw8bit where fp32 Adam states do not fit.
        cfg["train"].update({**example["train"], "seq_len": seq, "global_batch_size": 2, "method": "qlora",
                             "optimizer": {"name": "auto"}, "max_steps": steps})
        cfg["strategy"] = {"gpu_memory_headroom": HEADROOM_8B}
        plan = plan_for(config_from_dict(cfg, ROOT), hw)
        chosen = getattr(plan, "chosen", None)  # a Refusal has none
        tried.append({"seq_len": seq, "fits": chosen is not None,
                      "gpu_bytes": chosen.memory.gpu_total if chosen else None})
        if chosen is not None:
            break
    return cfg, tried
