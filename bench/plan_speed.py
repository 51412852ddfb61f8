"""How long planning takes: the analytical planner over every candidate, 125M to 70B parameters.

    .venv/bin/python bench/plan_speed.py
    .venv/bin/python bench/plan_speed.py --short    # 125M and 70B planned once, one CLI call (CI)

Shapes come from `orchestrate.model.meta.shape_for` on inline Llama configs (the family formulas;
shape time and the meta-device build's are shown separately: they are not planning). Each model is planned on two profiles, one RTX 3070 with 64 GiB
RAM, and 2 nodes x 4 RTX 3070 with NVMe, and `weigh` + `require_feasible` are timed (the
remedies of an infeasible plan re-plan variations, so they count). Target: a 70B plan in under 0.5 s.

The second table times whole `orchestrate plan` calls, each in a fresh interpreter (what a user
waits for: imports, config, hardware, shape, plan, report), for a small and a large public shape of
every family with formulas, and prints the formula's parameter count beside the meta build's.
Target: under 1 s per call (`--repeats N`, default 5).

`--short` is a smoke run (CI: tests/unit/bench/test_bench_short_modes.py): SHORT_MODELS planned once
each, SHORT_CLI_MODELS called once; it prints the targets but fails only when formula and meta build
disagree, since one timing on a loaded machine says nothing.

Structure: `shapes()` builds the models once, `time_planning()` returns rows, `time_cli()` the
whole-call rows, `main()` prints; a later section can reuse `shapes()` and add its own table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from orchestrate.config.load import config_from_dict  # noqa: E402
from orchestrate.errors import UserError  # noqa: E402
from orchestrate.hardware.presets import load_preset  # noqa: E402
from orchestrate.hardware.profile import HardwareProfile  # noqa: E402
from orchestrate.model.meta import load_model_config, shape_for, shape_from_config  # noqa: E402
from orchestrate.model.shape import ModelShape  # noqa: E402
from orchestrate.planning import require_feasible, weigh  # noqa: E402

TARGET_S = 0.5
TARGET_MODEL = "70B"
REPEATS = 5
CLI_TARGET_S = 1.0
ROOT = Path(__file__).resolve().parents[1]

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
SHORT_MODELS = ("125M", TARGET_MODEL)


def run_config(architecture: dict):
    arch = {"model_type": "llama", "max_position_embeddings": 4096, **architecture}
    return config_from_dict({"model": {"architecture": arch}, "train": dict(TRAIN)}, None)


def profiles() -> dict[str, HardwareProfile]:
    one = load_preset("rtx3070")
    cluster = one.model_copy(update={"nodes": 2, "gpus_per_node": 4, "nvme_path": "/mnt/nvme",
                                     "nvme_free_bytes": 2 * 2**40})
    return {"1x RTX 3070, 64 GiB": one, "2x4 RTX 3070 + NVMe": cluster}


def _timed(fn, *args):
    start = time.perf_counter()
    return fn(*args), time.perf_counter() - start


def shapes(names=tuple(MODELS)) -> dict[str, tuple[ModelShape, float, float]]:
    """Each model's shape, the seconds `shape_for` took (formulas) and the meta-device build's."""
    out = {}
    for name in names:
        config = run_config(MODELS[name])
        shape, shape_s = _timed(shape_for, config)
        meta, meta_s = _timed(lambda c: shape_from_config(load_model_config(c)), config)
        assert meta == shape, f"{name}: formula {shape} != meta build {meta}"
        out[name] = (shape, shape_s, meta_s)
    return out


def plan_once(config, hw: HardwareProfile, shape: ModelShape) -> tuple[str, int]:
    """(chosen name or "infeasible", number of candidates)."""
    plan = weigh(config, hw, shape)
    try:
        return require_feasible(plan).chosen.name, len(plan.candidates)
    except UserError:
        return "infeasible", len(plan.candidates)


def time_planning(built: dict[str, tuple[ModelShape, float, float]], repeats: int = REPEATS) -> list[dict]:
    rows = []
    for hw_name, hw in profiles().items():
        for name, (shape, shape_s, meta_s) in built.items():
            config = run_config(MODELS[name])
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                chosen, count = plan_once(config, hw, shape)
                best = min(best, time.perf_counter() - start)
            rows.append({"hardware": hw_name, "model": name, "parameters": shape.parameters,
                         "shape_s": shape_s, "meta_s": meta_s,
                         "plan_s": best, "candidates": count, "chosen": chosen})
    return rows


def planning_table(rows: list[dict], repeats: int = REPEATS) -> Table:
    table = Table(title=f"Planning time (best of {repeats}; seq_len {TRAIN['seq_len']}, "
                        f"global batch {TRAIN['global_batch_size']})")
    numeric = ("parameters", "shape ms", "meta build s", "plan s")
    for header in ("hardware", "model", "parameters", "shape ms", "meta build s", "plan s", "candidates", "chosen",
                   "target"):
        table.add_column(header, justify="right" if header in numeric else "left")
    for r in rows:
        target = ""
        if r["model"] == TARGET_MODEL:
            target = f"< {TARGET_S} s: " + ("PASS" if r["plan_s"] < TARGET_S else "FAIL")
        table.add_row(r["hardware"], r["model"], f"{r['parameters'] / 1e9:.2f}B", f"{r['shape_s'] * 1e3:.3f}",
                      f"{r['meta_s']:.3f}",
                      f"{r['plan_s']:.4f}", str(r["candidates"]), r["chosen"], target)
    return table


# A small and a large public shape per family (config.json of the Hub repo named in each comment).
CLI_MODELS: dict[str, dict] = {
    "gpt2 124M": {"model_type": "gpt2"},  # openai-community/gpt2: the GPT2Config defaults
    "gpt2 1.5B": {"model_type": "gpt2", "n_embd": 1600, "n_layer": 48, "n_head": 25},  # openai-community/gpt2-xl
    "llama 1.1B": {"model_type": "llama", **MODELS["1.1B"]},  # TinyLlama/TinyLlama-1.1B
    "llama 70B": {"model_type": "llama", **MODELS["70B"]},  # meta-llama/Llama-2-70b-hf
    "mistral 7B": {"model_type": "mistral", "max_position_embeddings": 32768},  # mistralai/Mistral-7B-v0.1
    "mistral 12B": {"model_type": "mistral", "hidden_size": 5120, "num_hidden_layers": 40, "num_attention_heads": 32,
                    "head_dim": 128, "intermediate_size": 14336, "vocab_size": 131072,
                    "max_position_embeddings": 131072},  # mistralai/Mistral-Nemo-Base-2407
    "qwen2 0.5B": {"model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
                   "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936,
                   "tie_word_embeddings": True},  # Qwen/Qwen2-0.5B
    "qwen2 72B": {"model_type": "qwen2", "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
                  "num_key_value_heads": 8, "intermediate_size": 29568, "vocab_size": 152064},  # Qwen/Qwen2-72B
    "phi3 3.8B": {"model_type": "phi3"},  # microsoft/Phi-3-mini-4k-instruct: the Phi3Config defaults
    "phi3 14B": {"model_type": "phi3", "hidden_size": 5120, "num_hidden_layers": 40, "num_attention_heads": 40,
                 "num_key_value_heads": 10, "intermediate_size": 17920},  # microsoft/Phi-3-medium-4k-instruct
    "gemma 2B": {"model_type": "gemma", "hidden_size": 2048, "num_hidden_layers": 18, "num_attention_heads": 8,
                 "num_key_value_heads": 1, "intermediate_size": 16384},  # google/gemma-2b
    "gemma 7B": {"model_type": "gemma"},  # google/gemma-7b: the GemmaConfig defaults
    "bert 110M": {"model_type": "bert"},  # google-bert/bert-base-uncased
    "bert 335M": {"model_type": "bert", "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
                  "intermediate_size": 4096},  # google-bert/bert-large-uncased
}
CLI_TRAIN = {"seq_len": 512, "global_batch_size": 64}
CLI_ARGS = ("--gpus", "2", "--gpu-mem", "80GiB", "--cpu-mem", "512GiB")
SHORT_CLI_MODELS = ("gpt2 124M",)


def time_cli(repeats: int, names=tuple(CLI_MODELS)) -> list[dict]:
    """Wall time of `python -m orchestrate.cli plan` per model, each call a fresh interpreter."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            arch = CLI_MODELS[name]
            path = Path(tmp) / f"{name.replace(' ', '-')}.yaml"
            path.write_text(yaml.safe_dump({"model": {"architecture": arch}, "train": CLI_TRAIN}))
            config = config_from_dict({"model": {"architecture": arch}, "train": dict(CLI_TRAIN)}, None)
            walls, codes = [], set()
            for _ in range(repeats):
                start = time.perf_counter()
                done = subprocess.run([sys.executable, "-m", "orchestrate.cli", "plan", *CLI_ARGS, str(path)],
                                      cwd=ROOT, capture_output=True, text=True,
                                      env={**os.environ, "PYTHONPATH": str(ROOT)})
                walls.append(time.perf_counter() - start)
                codes.add(done.returncode)
            rows.append({"model": name, "formula": shape_for(config).parameters,
                         "meta": shape_from_config(load_model_config(config)).parameters,
                         "median": statistics.median(walls), "min": min(walls), "max": max(walls),
                         "exit": ",".join(map(str, sorted(codes)))})
    return rows


def cli_table(rows: list[dict], repeats: int) -> Table:
    table = Table(title=f"`orchestrate plan {' '.join(CLI_ARGS)}` wall time, fresh interpreter, {repeats} calls each")
    for header in ("model", "parameters (formula)", "parameters (meta build)", "median s", "min s", "max s", "exit",
                   "target"):
        table.add_column(header, justify="left" if header in ("model", "target") else "right")
    for r in rows:
        same = "" if r["formula"] == r["meta"] else " DIFFERENT"
        table.add_row(r["model"], f"{r['formula']:,}", f"{r['meta']:,}{same}", f"{r['median']:.3f}",
                      f"{r['min']:.3f}", f"{r['max']:.3f}", r["exit"],
                      f"< {CLI_TARGET_S} s: " + ("PASS" if r["median"] < CLI_TARGET_S else "FAIL"))
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=REPEATS, help="whole-CLI calls per model")
    parser.add_argument("--short", action="store_true",
                        help="smoke run: SHORT_MODELS planned once, SHORT_CLI_MODELS called once, timings not judged")
    args = parser.parse_args(argv)
    repeats = 1 if args.short else args.repeats
    console = Console(width=200)
    rows = time_planning(shapes(SHORT_MODELS if args.short else tuple(MODELS)), 1 if args.short else REPEATS)
    console.print(planning_table(rows, 1 if args.short else REPEATS))
    slow = [f"{TARGET_MODEL} planning took >= {TARGET_S} s"
            for r in rows if r["model"] == TARGET_MODEL and r["plan_s"] >= TARGET_S]
    cli_rows = time_cli(repeats, SHORT_CLI_MODELS if args.short else tuple(CLI_MODELS))
    console.print(cli_table(cli_rows, repeats))
    slow += [f"{r['model']}: a plan call took {r['median']:.2f} s (median)" for r in cli_rows
             if r["median"] >= CLI_TARGET_S]
    wrong = [f"{r['model']}: formula and meta build disagree" for r in cli_rows if r["formula"] != r["meta"]]
    wrong += [f"{r['model']}: `orchestrate plan` exited {r['exit']}" for r in cli_rows if r["exit"] != "0"]
    failed = wrong + ([] if args.short else slow)
    console.print("PASS" if not failed else "FAIL: " + "; ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
