"""How long planning takes: the analytical planner over every candidate, 125M to 70B parameters.

    .venv/bin/python bench/plan_speed.py

Shapes come from `orchestrate.model.meta.shape_for` on inline Llama configs (the meta-device build is
timed separately: it is not planning). Each model is planned on two profiles, one RTX 3070 with 64 GiB
RAM, and 2 nodes x 4 RTX 3070 with NVMe, and `make_plan` + `require_feasible` are timed (the
remedies of an infeasible plan re-plan variations, so they count). Target: a 70B plan in under 0.5 s.

Structure: `shapes()` builds the models once, `time_planning()` returns rows, `main()` prints; a later
section (e.g. analytical vs simulated memory) can reuse `shapes()` and add its own table to `main()`.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from orchestrate.config.load import config_from_dict  # noqa: E402
from orchestrate.errors import UserError  # noqa: E402
from orchestrate.hardware.presets import load_preset  # noqa: E402
from orchestrate.hardware.profile import HardwareProfile  # noqa: E402
from orchestrate.model.meta import shape_for  # noqa: E402
from orchestrate.model.shape import ModelShape  # noqa: E402
from orchestrate.planner.remedies import require_feasible
from orchestrate.planner.search import make_plan  # noqa: E402

TARGET_S = 0.5
TARGET_MODEL = "70B"
REPEATS = 5

# Public Llama-family configs: a GPT-2-small-sized Llama (GPT-2's vocabulary, tied), TinyLlama-1.1B, Llama-2-7B/13B/70B
# (meta-llama/Llama-2-*-hf config.json).
MODELS: dict[str, dict] = {
    "125M": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 12,
             "intermediate_size": 2048, "vocab_size": 50257, "tie_word_embeddings": True},
    "1.1B": {"hidden_size": 2048, "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4,
             "intermediate_size": 5632, "vocab_size": 32000, "tie_word_embeddings": False},
    "7B": {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
           "intermediate_size": 11008, "vocab_size": 32000, "tie_word_embeddings": False},
    "13B": {"hidden_size": 5120, "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 40,
            "intermediate_size": 13824, "vocab_size": 32000, "tie_word_embeddings": False},
    "70B": {"hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
            "intermediate_size": 28672, "vocab_size": 32000, "tie_word_embeddings": False},
}
TRAIN = {"seq_len": 2048, "global_batch_size": 64}


def run_config(architecture: dict):
    arch = {"model_type": "llama", "max_position_embeddings": 4096, **architecture}
    return config_from_dict({"model": {"architecture": arch}, "train": dict(TRAIN)}, None)


def profiles() -> dict[str, HardwareProfile]:
    one = load_preset("rtx3070")
    cluster = one.model_copy(update={"nodes": 2, "gpus_per_node": 4, "nvme_path": "/mnt/nvme",
                                     "nvme_free_bytes": 2 * 2**40})
    return {"1x RTX 3070, 64 GiB": one, "2x4 RTX 3070 + NVMe": cluster}


def shapes() -> dict[str, tuple[ModelShape, float]]:
    """Each model's shape and the seconds its meta-device build took."""
    out = {}
    for name, arch in MODELS.items():
        start = time.perf_counter()
        shape = shape_for(run_config(arch))
        out[name] = (shape, time.perf_counter() - start)
    return out


def plan_once(config, hw: HardwareProfile, shape: ModelShape) -> tuple[str, int]:
    """(chosen name or "infeasible", number of candidates)."""
    plan = make_plan(config, hw, shape)
    try:
        return require_feasible(plan).name, len(plan.candidates)
    except UserError:
        return "infeasible", len(plan.candidates)


def time_planning(built: dict[str, tuple[ModelShape, float]]) -> list[dict]:
    rows = []
    for hw_name, hw in profiles().items():
        for name, (shape, build_s) in built.items():
            config = run_config(MODELS[name])
            best = float("inf")
            for _ in range(REPEATS):
                start = time.perf_counter()
                chosen, count = plan_once(config, hw, shape)
                best = min(best, time.perf_counter() - start)
            rows.append({"hardware": hw_name, "model": name, "parameters": shape.parameters, "build_s": build_s,
                         "plan_s": best, "candidates": count, "chosen": chosen})
    return rows


def planning_table(rows: list[dict]) -> Table:
    table = Table(title=f"Planning time (best of {REPEATS}; seq_len {TRAIN['seq_len']}, "
                        f"global batch {TRAIN['global_batch_size']})")
    for header in ("hardware", "model", "parameters", "shape build s", "plan s", "candidates", "chosen", "target"):
        table.add_column(header, justify="right" if header in ("parameters", "shape build s", "plan s") else "left")
    for r in rows:
        target = ""
        if r["model"] == TARGET_MODEL:
            target = f"< {TARGET_S} s: " + ("PASS" if r["plan_s"] < TARGET_S else "FAIL")
        table.add_row(r["hardware"], r["model"], f"{r['parameters'] / 1e9:.2f}B", f"{r['build_s']:.3f}",
                      f"{r['plan_s']:.4f}", str(r["candidates"]), r["chosen"], target)
    return table


def main() -> int:
    console = Console(width=200)
    rows = time_planning(shapes())
    console.print(planning_table(rows))
    failed = [r for r in rows if r["model"] == TARGET_MODEL and r["plan_s"] >= TARGET_S]
    console.print("PASS" if not failed else f"FAIL: {TARGET_MODEL} planning took >= {TARGET_S} s")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
