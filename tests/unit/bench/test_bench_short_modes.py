"""Every runnable bench runs here in its short mode, in-process (`main([...])`), so a refactor cannot break
one unseen: the benchmarks themselves run rarely. Each test checks what the bench is for (its table's
rows, the ratio it reports, its figures' relations), not only that it ran. bench/README.md lists which
test runs which bench; the multi-process ones are slow (each starts ranks or launches the demo)."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_overhead_short_compares_orchestrates_start_up_with_accelerate_launch(tmp_path, capsys):
    """bench/overhead.py --short --only ddp: both rows measured, the start-up ratio reported (its
    hand-written arm reads the files orchestrate wrote through the plan's typed `files`)."""
    from bench.overhead import SHORT_STEPS, main

    out = tmp_path / "overhead.json"
    assert main(["--short", "--only", "ddp", "--out", str(tmp_path / "work"), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = ["orchestrate ddp", "accelerate launch (ddp)"]
    assert list(result["tokens_per_s"]) == rows and list(result["first_step_s"]) == rows
    assert all(len(v) == 1 and v[0] > 0 for v in [*result["tokens_per_s"].values(), *result["first_step_s"].values()])
    (ratio,) = result["ratios"].values()
    assert ratio["median"] > 0
    assert "start-up vs accelerate" in capsys.readouterr().out
    metrics = (tmp_path / "work" / "orchestrate-ddp-0" / "metrics.jsonl").read_text().splitlines()
    assert sum("loss" in json.loads(line) for line in metrics) >= SHORT_STEPS


def _lines(capsys) -> list[str]:
    return capsys.readouterr().out.splitlines()


def test_allocator_speed_short_replays_one_step_under_both_settings(capsys):
    """bench/allocator_speed.py --short: a row per expandable_segments setting, allocated <= needed <= reserved."""
    import re

    from bench.allocator_speed import main
    from orchestrate.simulate.replay import SETTINGS

    assert main(["--short"]) == 0
    rows = {line.split()[0]: line for line in _lines(capsys)[1:]}
    assert list(rows) == list(SETTINGS)
    for row in rows.values():
        allocated, reserved, needed = (int(m) for m in re.search(
            r"allocated (\d+) MiB, reserved (\d+), needed (\d+)", row).groups())
        assert 0 < allocated <= needed <= reserved


def test_manifest_cost_short_writes_and_verifies_both_algorithms(capsys):
    """bench/manifest_cost.py --short: 3 x 2^20 fp32 tensors, a manifest written and verified per algorithm."""
    from bench.manifest_cost import main

    main(["--short"])
    lines = _lines(capsys)
    assert lines[0] == "checkpoint: 0.01 GB in 3 files"
    assert [line.split(":")[0] for line in lines[1:]] == ["xxh3_128", "sha256"]
    assert all("write manifest" in line and "verify checksums" in line for line in lines[1:])


def test_allocator_reserve_fit_short_fits_no_more_than_the_planned_reserve(capsys):
    """bench/allocator_reserve_fit.py --short: a row per backend and setting; fitted to a subset of the
    points the planned reserve covers, the fit's reserve for the typical plan is at most the planned one."""
    from bench.allocator_reserve_fit import main
    from orchestrate.planner.allocator_reserve import RESERVE

    assert main(["--short"]) == 0
    lines = _lines(capsys)
    assert lines[0].startswith("10 points")
    rows = [line.split() for line in lines[1:]]
    assert sorted((r[0], r[1]) for r in rows) == sorted((b, str(on)) for b in RESERVE for on in (False, True))
    for row in rows:
        fitted, planned = row[row.index("MiB;") - 3], row[row.index("MiB;") - 1]
        assert int(fitted) <= int(planned), row


def test_plan_speed_short_plans_and_calls_the_cli(capsys):
    """bench/plan_speed.py --short: both models on both profiles, 125M feasible on one card, the CLI
    call exits 0 with formula and meta build agreeing (timings are printed, not judged)."""
    from bench.plan_speed import SHORT_CLI_MODELS, SHORT_MODELS, main, profiles

    assert main(["--short"]) == 0
    out = capsys.readouterr().out
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in out.splitlines() if line.startswith("│")]
    planned = [(r[0], r[1]) for r in rows if len(r) == 9]
    assert planned == [(hw, model) for hw in profiles() for model in SHORT_MODELS]
    assert all(r[7] != "infeasible" for r in rows if len(r) == 9 and r[1] == "125M")
    (cli,) = [r for r in rows if len(r) == 8]
    assert cli[0] == SHORT_CLI_MODELS[0] and cli[1] == cli[2] and cli[6] == "0"
    assert out.rstrip().endswith("PASS")


def test_gpu_results_short_replans_the_first_stored_run(capsys):
    """bench/gpu_results.py bench/results/h200-2026-12-04 --short: the first GPU-check run re-planned, its
    calibration ratios and its history replayed, the allocator model within 1 % of the real peaks."""
    from pathlib import Path

    from bench.gpu_results import main

    results = Path(__file__).resolve().parents[3] / "bench" / "results" / "h200-2026-12-04"
    assert main([str(results), "--short"]) == 0
    lines = _lines(capsys)
    assert lines[0].startswith("NVIDIA H200")
    assert lines[2].split()[0] == "fsdp2-full-shard-cpu-offload"
    (replay,) = [line.split() for line in lines if line.strip().startswith("zoo-")]
    assert replay[0] == "zoo-fsdp2-full-shard-cpu-offload.json.gz"
    assert abs(float(replay[replay.index("allocated") + 1]) - 1) <= 0.01
    assert abs(float(replay[replay.index("reserved") + 1]) - 1) <= 0.01


def test_cuda_constants_without_a_gpu_records_why_each_process_failed(tmp_path, capsys):
    """bench/cuda_constants.py is GPU-only (no CPU mode): without a GPU its driver still runs the asked
    process, records its error and exits 1, and writes cuda_constants.json."""
    import torch

    from bench.cuda_constants import main

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: this checks the CPU path")
    assert main(["--out", str(tmp_path), "--only", "lazy-segments-plain"]) == 1
    row = json.loads((tmp_path / "cuda_constants.json").read_text())["lazy-segments-plain"]
    assert "no CUDA device" in row["error"] and "readings" not in row
    assert _lines(capsys)[0].startswith("lazy-segments-plain")


@pytest.mark.slow
def test_qlora_pieces_short_matches_the_planners_nf4_bytes(capsys):
    """bench/qlora_pieces.py --short: llama's NF4 bytes and its DDP QLoRA estimate within 2 % of what was measured."""
    from bench.qlora_pieces import main

    assert main(["--short"]) == 0
    lines = _lines(capsys)
    assert lines[1].split()[0] == "llama"
    assert sum("ratio" in line for line in lines) == 3  # (a) llama, (b) DDP with and without checkpointing
    assert float(lines[-1].split("=")[1]) <= 0.02


def test_verify_knob_combos_reports_every_combination(monkeypatch, capsys):
    """bench/verify_knob_combos.py runs whole (a few seconds): one line per combination, each what
    happened (a result or FAILED with the error), and no process group left behind."""
    import torch.distributed as dist

    from bench.verify_knob_combos import CHECKS, main
    from orchestrate.ports import free_port

    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port())), ("RANK", "0"),
                        ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)  # the bench sets them with setdefault: these are undone after
    main()
    lines = [line for line in _lines(capsys) if ": " in line and not line.startswith("[")]
    assert [line.split(":")[0] for line in lines] == [check.__name__ for check in CHECKS]
    assert all(line.split(": ", 1)[1] for line in lines)
    assert not dist.is_initialized()


@pytest.mark.slow
def test_data_short_reports_the_loader_far_ahead_of_the_step(capsys):
    """bench/data.py --short: every section printed; the loader outruns the training step (target >= 10x)
    and a cached start-up beats a cold one."""
    import re

    from bench.data import main

    main(["--short"])
    out = capsys.readouterr().out
    assert out.count("\n") >= 4 and "corpus: 500 documents" in out and "2 workers" in out
    cold_over_cached = float(re.search(r"cold/cached ([\d,.]+) ", out).group(1).replace(",", ""))
    loader_over_step = float(re.search(r"loader/step ([\d,.]+) ", out).group(1).replace(",", ""))
    assert cold_over_cached > 1 and loader_over_step >= 10


@pytest.mark.slow
def test_deepspeed_settings_short_times_two_variants_and_the_per_step_work(tmp_path, capsys):
    """bench/deepspeed_settings.py --short: the rendered and default configs timed on 2 gloo ranks, each
    with its ratio to the rendered one, and every per-step call of the worker timed."""
    from bench.deepspeed_settings import SHORT_VARIANTS, main

    out = tmp_path / "settings.json"
    assert main(["--short", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert tuple(summary["tokens_per_s"]) == SHORT_VARIANTS
    assert all(v["median"] > 0 for v in summary["tokens_per_s"].values())
    assert summary["vs_rendered"]["rendered"]["median"] == 1.0 and summary["vs_rendered"]["defaults"]["median"] > 0
    assert len(summary["per_step_work_us"]) == 5
    assert "vs rendered, paired" in capsys.readouterr().out


@pytest.mark.slow
def test_model_loading_short_measures_orchestrates_loaders(capsys):
    """bench/model_loading.py --short: a row per loading mode kept (orchestrate's two) with a node peak above zero."""
    from bench.model_loading import main

    main(["--short"])
    lines = capsys.readouterr().out.splitlines()
    rows = lines[lines.index(next(line for line in lines if line.startswith("mode "))) + 1:]
    assert [row.split()[0] for row in rows] == ["sharded", "replicated"]
    assert all(float(row.split()[1]) > 0 for row in rows)


@pytest.mark.slow
def test_tensor_peak_short_times_a_counted_step_and_reports_the_peak_beside_the_plan(capsys):
    """bench/tensor_peak.py --short: the counted/uncounted ratio, and both ranks' tensor peaks beside the
    plan's prediction."""
    import re

    from bench.tensor_peak import main

    main(["--short"])
    out = capsys.readouterr().out
    assert float(re.search(r"counted/uncounted ([\d.]+)", out).group(1)) > 0
    peaks = re.search(r"rank 0 ([\d.]+) MiB, rank 1 ([\d.]+) MiB; predicted ([\d.]+) MiB", out).groups()
    assert all(float(p) > 0 for p in peaks)


@pytest.mark.slow
def test_startup_stages_short_timestamps_every_stage_in_order(capsys):
    """bench/startup_stages.py --short: one demo launch, the launcher's phases, the agent's imports and
    rank 0's worker stages each timestamped, in the order they ran, then the end of step 1."""
    from bench.startup_stages import STAGES, main

    assert main(["--short"]) == 0
    events = [line.split("│")[1].strip() for line in capsys.readouterr().out.splitlines()
              if line.startswith("│") and line.split("│")[1].strip()]  # rows in time order
    order = ["launcher: prepare_run_dir starts", "launcher: prepare_run_dir ends",
             *(f"rank 0: {stage} {edge}" for stage in STAGES for edge in ("starts", "ends")), "step 1 ends (metrics.jsonl)"]
    assert [e for e in events if e in order] == order
    assert "agent: imports start" in events  # the warm agent imports while the launcher plans: no fixed order


@pytest.mark.slow
def test_checkpoint_short_compares_an_fsdp_checkpoint_with_torch_save(tmp_path, capsys):
    """bench/checkpoint.py --short --backends fsdp: the tiny model's row, both sides written and loaded,
    the write and load ratios reported."""
    from bench.checkpoint import main

    out = tmp_path / "rows.json"
    main(["--short", "--backends", "fsdp", "--out", str(out)])
    (row,) = json.loads(out.read_text())
    assert (row["model"], row["backend"], row["ranks"]) == ("tiny", "fsdp", 2)
    assert row["ckpt_bytes"] > 0 and row["torch_save_bytes"] > 0
    assert all(len(row[k]) == 1 and row[k][0] > 0 for k in ("ckpt_write_s", "ckpt_load_s", "torch_save_s", "torch_load_s"))
    table = capsys.readouterr().out.splitlines()
    assert "write ratio" in table[-3] and table[-1].startswith("| tiny |")


@pytest.mark.slow
def test_preference_learning_short_prints_a_dpo_row(tmp_path, capsys):
    """bench/preference_learning.py --short: one DPO run's row, every column filled (reward accuracy at
    step 1 is 0: the model is its own reference)."""
    from bench.preference_learning import main

    main(["--short", "--work", str(tmp_path)])
    (row,) = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("dpo")]
    assert row[:3] == ["dpo", "full", "0"] and len(row) == 8
    assert float(row[3]) == 0.0


@pytest.mark.slow
def test_sft_learning_short_prints_the_three_arms(tmp_path, capsys):
    """bench/sft_learning.py --short: the workspace built, and each arm's count of the 60 held-out prompts
    in the table (built-in answers only, own loop, built-in every token)."""
    import re

    from bench.sft_learning import main

    main(["--short", "--work", str(tmp_path)])
    out = capsys.readouterr().out
    (row,) = [line for line in out.splitlines() if line.startswith("| full |")]
    assert len(re.findall(r"\d+\.\d/60 \(\d+\)", row)) == 3


@pytest.mark.slow
def test_fuzz_short_tries_every_input_surface_and_finds_nothing_broken(capsys):
    """bench/fuzz.py --short: a row per input surface (tests/helpers/input_fuzz.py), each with inputs
    tried, every one of them holding the surface's invariants, and the peak memory within its bound."""
    from bench.fuzz import SHORT_EXAMPLES, main
    from tests.helpers.input_fuzz import all_surfaces

    status = main(["--short"])
    lines = _lines(capsys)
    assert status == 0, "\n".join(lines)
    names = [name for name, _ in all_surfaces(None)]
    rows = {line[:len(name)]: line[len(name):].split() for line in lines[1:] for name in names
            if line.startswith(name + " ")}
    assert list(rows) == names
    for tried, held, broke, _seconds in rows.values():
        assert 0 < int(tried) <= SHORT_EXAMPLES and held == tried and broke == "0"
    assert any(line.startswith("peak RSS") for line in lines)
