"""`orchestrate report`, the memory verdict and MFU, on synthetic metrics records."""

from __future__ import annotations

import dataclasses
import json

import pytest

from orchestrate.errors import UserError
from orchestrate.hardware.profile import GPUSpec, HardwareProfile
from orchestrate.planner.estimate import MemoryEstimate
from orchestrate.planner.strategy import Strategy
from orchestrate.report.memory_verdict import NO_TENSOR_PEAK, RESERVED_NOTE, TOLERANCE, memory_verdict
from orchestrate.report.mfu import utilisation
from orchestrate.report.plots import GIB, loss_figure, memory_figure, optimizer_figure, throughput_figure
from orchestrate.report.runs import load_run
from orchestrate.report.summary import write_report
from tests.helpers.plans import TINY_GPT2, make_plan

DDP = Strategy("ddp", 0, "none", "none", "fp32", False, 2)


def _plan(gpu_pred: int = 400 * 2**20, cpu_pred: int = 3 * GIB, strategy: Strategy = DDP):
    plan = make_plan(strategy, ranks=2)
    chosen = dataclasses.replace(plan.chosen, memory=MemoryEstimate({"weights": gpu_pred}, {"runtime": cpu_pred}))
    return plan.model_copy(update={"chosen": chosen, "candidates": [chosen]})


def _records(n: int = 6, loss0: float = 5.0, gpu: bool = False, tensors: int | None = 390 * 2**20) -> list[dict]:
    """CPU records carry the tensor peak `tensors` (None: records from before it was measured)."""
    out = []
    for step in range(1, n + 1):
        r = {"step": step, "loss": loss0 / step, "lr": 1e-3 * step / n, "grad_norm": 2.0 / step,
             "tokens": 512, "tokens_per_s": 1000.0 + 10 * step, "step_time_s": 0.5, "time": 1e9 + step,
             "rss_peak_bytes_max_rank": 900 * 2**20 + step * 2**20, "node_rss_peak_bytes": 2 * GIB,
             "predicted_gpu_bytes_per_rank": 400 * 2**20, "predicted_cpu_bytes_per_node": 3 * GIB}
        if gpu:
            r["gpu_max_allocated_bytes"] = 300 * 2**20 + step
            r["gpu_max_reserved_bytes"] = 350 * 2**20 + step
        elif tensors is not None:
            r["cpu_tensor_peak_bytes"] = tensors
        if step % 3 == 0:
            r["eval_loss"] = 4.5 / step
        out.append(r)
    return out


def _write_run(path, records, plan=None):
    path.mkdir(parents=True)
    (plan or _plan()).write(path / "plan.json")
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# --- memory verdict -------------------------------------------------------------------------------

def test_cpu_verdict_compares_the_tensor_peak_and_only_shows_the_rss():
    # The RSS (906 MiB: interpreter and libraries too) is far above the 400 MiB tensor prediction;
    # the tensors (390 MiB) are not: no warning, the ratio of like with like.
    v = memory_verdict(_records(), _plan())
    per_rank, node = v.checks
    assert "tensor" in per_rank.what and (per_rank.predicted, per_rank.measured) == (400 * 2**20, 390 * 2**20)
    assert (node.predicted, node.measured) == (3 * GIB, 2 * GIB)
    assert v.warnings == [] and "(0.97x, within)" in v.text() and RESERVED_NOTE not in v.notes
    (shown,) = v.shown
    assert "RSS" in shown and "906.00 MiB" in shown and "not compared" in shown


@pytest.mark.parametrize(("over", "warns"), [(0.04, False), (0.06, True)])
def test_a_tensor_peak_warns_only_past_the_tolerance(over, warns):
    assert TOLERANCE == 0.05
    v = memory_verdict(_records(tensors=int(400 * 2**20 * (1 + over))), _plan())
    assert len(v.warnings) == warns
    if warns:
        assert "exceeds the predicted 400.00 MiB by more than 5%" in v.warnings[0] and "(1.06x)" in v.warnings[0]


def test_cpu_records_without_a_tensor_peak_compare_nothing_per_rank():
    v = memory_verdict(_records(tensors=None), _plan())
    assert [c.what for c in v.checks] == ["host RSS of node 0 (sum of its ranks' peaks)"]
    assert NO_TENSOR_PEAK in v.notes and v.warnings == []


def _gpu_breakdown_plan():
    """A GPU plan of 300 MiB tensors, 50 MiB allocator reserve and 600 MiB outside the allocator."""
    plan = _plan()
    memory = MemoryEstimate({"weights": 300 * 2**20, "allocator_reserve": 50 * 2**20, "cuda_context": 500 * 2**20,
                             "nccl_buffers": 100 * 2**20}, {"runtime": 3 * GIB})
    chosen = dataclasses.replace(plan.chosen, memory=memory)
    return plan.model_copy(update={"chosen": chosen, "candidates": [chosen]})


def test_gpu_verdict_compares_torch_peaks_with_the_allocator_parts_of_the_plan():
    # allocated with the tensors, reserved with tensors + reserve: torch's peaks count neither the
    # CUDA context nor NCCL's buffers, so the plan's total would hide a 600 MiB under-prediction.
    v = memory_verdict(_records(gpu=True), _gpu_breakdown_plan())
    allocated, reserved = (c for c in v.checks if "GPU" in c.what)
    assert "allocated" in allocated.what and allocated.predicted == 300 * 2**20 and allocated.measured == 300 * 2**20 + 6
    assert "reserved" in reserved.what and reserved.predicted == 350 * 2**20 and reserved.measured == 350 * 2**20 + 6
    assert not any("RSS peak per rank" in c.what for c in v.checks) and v.warnings == []
    assert NO_TENSOR_PEAK not in v.notes and RESERVED_NOTE in v.notes
    assert v.shown == ["planned device memory per rank 950.00 MiB: tensors and reserve plus 600.00 MiB outside "
                       "the allocator (CUDA context, NCCL's buffers)"]


def test_a_reserved_peak_above_the_plan_is_cache_unless_the_tensors_are_over_too():
    records = _records(gpu=True)
    for r in records:
        r["gpu_max_reserved_bytes"] = 500 * 2**20  # 1.43x the 350 MiB allocator part
    v = memory_verdict(records, _gpu_breakdown_plan())
    assert v.warnings == [] and "(1.43x, the allocator's cache)" in v.text()
    for r in records:
        r["gpu_max_allocated_bytes"] = 330 * 2**20  # 1.10x the tensors: both warned
    v = memory_verdict(records, _gpu_breakdown_plan())
    assert len(v.warnings) == 2 and "(1.10x)" in v.warnings[0] and "(1.43x)" in v.warnings[1]


# --- MFU ------------------------------------------------------------------------------------------

def _gpu_plan(ac: bool):
    plan = make_plan(Strategy("ddp", 0, "none", "none", "bf16", ac, 2), ranks=2)
    gpu = GPUSpec(name="test", memory_bytes=8 * GIB, peak_tflops_fp16=100.0, peak_tflops_bf16=80.0,
                  peak_tflops_fp32=20.0)
    return plan.model_copy(update={"hardware": HardwareProfile(gpus_per_node=2, gpu=gpu, cpu_memory_bytes=64 * GIB)})


def test_mfu_is_palm_appendix_b():
    plan = _gpu_plan(ac=False)
    h, layers, s = TINY_GPT2["n_embd"], TINY_GPT2["n_layer"], plan.config.train.seq_len
    # N: every parameter but the position embedding (the tied token embedding is the LM head's matmul).
    n = plan.shape.parameters - TINY_GPT2["n_positions"] * h
    expected = 1e5 * (6 * n + 12 * layers * s * h) / (2 * 80e12)
    u = utilisation(1e5, plan)
    assert u["mfu"] == pytest.approx(expected, rel=1e-12)
    assert u["hfu"] == u["mfu"]
    with_ac = utilisation(1e5, _gpu_plan(ac=True))
    assert with_ac["mfu"] == pytest.approx(expected, rel=1e-12)
    assert with_ac["hfu"] == pytest.approx(expected * 4 / 3, rel=1e-12)  # + one forward: 2N + 4Lsh


def test_mfu_left_out_on_cpu():
    assert utilisation(1e5, _plan()) == {}


# --- figures and the report -----------------------------------------------------------------------

def _by_label(ax):
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.lines}


def test_figures_draw_the_metrics_as_they_are(tmp_path):
    records = _records()
    run = load_run(_write_run(tmp_path / "run-a", records))
    by_step, by_tokens = loss_figure([run]).axes
    steps = [r["step"] for r in records]
    assert _by_label(by_step)["run-a"] == (steps, [r["loss"] for r in records])
    evals = [r for r in records if "eval_loss" in r]
    assert _by_label(by_step)["run-a (eval)"] == ([r["step"] for r in evals], [r["eval_loss"] for r in evals])
    assert _by_label(by_tokens)["run-a"] == ([512 * s for s in steps], [r["loss"] for r in records])
    lr, norm = optimizer_figure([run]).axes
    assert _by_label(lr)["run-a"] == (steps, [r["lr"] for r in records])
    assert _by_label(norm)["run-a"] == (steps, [r["grad_norm"] for r in records])
    tps, mfu = throughput_figure([run]).axes
    assert _by_label(tps)["run-a"] == (steps, [r["tokens_per_s"] for r in records])
    assert len(mfu.lines) == 0  # CPU: no peak FLOP/s, no MFU line
    (mem,) = memory_figure([run]).axes
    lines = _by_label(mem)
    assert lines["run-a measured (cpu_tensor_peak_bytes)"][1] == [r["cpu_tensor_peak_bytes"] / GIB for r in records]
    assert lines["run-a predicted"][1] == [400 / 1024] * len(records)


def test_a_gpu_runs_memory_figure_sets_torchs_peaks_beside_the_plans_allocator_parts(tmp_path):
    records = _records(gpu=True)
    run = load_run(_write_run(tmp_path / "gpu-run", records, _gpu_breakdown_plan()))
    lines = _by_label(memory_figure([run]).axes[0])
    n = len(records)
    assert lines["gpu-run measured (gpu_max_reserved_bytes)"][1] == [r["gpu_max_reserved_bytes"] / GIB for r in records]
    assert lines["gpu-run predicted (tensors + allocator reserve)"][1] == [350 / 1024] * n  # no context, no NCCL
    assert lines["gpu-run measured (gpu_max_allocated_bytes)"][1] == [r["gpu_max_allocated_bytes"] / GIB for r in records]
    assert lines["gpu-run predicted (tensors)"][1] == [300 / 1024] * n


def test_gpu_run_has_an_mfu_line(tmp_path):
    plan = _gpu_plan(ac=False)
    records = _records(gpu=True)
    run = load_run(_write_run(tmp_path / "gpu-run", records, plan))
    mfu = throughput_figure([run]).axes[1]
    steps, values = _by_label(mfu)["gpu-run"]
    assert steps == [r["step"] for r in records]
    assert values == [utilisation(r["tokens_per_s"], plan)["mfu"] for r in records]


def test_two_runs_overlay_on_the_same_axes(tmp_path):
    a = load_run(_write_run(tmp_path / "run-a", _records()))
    b = load_run(_write_run(tmp_path / "run-b", _records(n=4, loss0=7.0)))
    by_step = loss_figure([a, b]).axes[0]
    lines = _by_label(by_step)
    assert {"run-a", "run-b", "run-a (eval)", "run-b (eval)"} == set(lines)
    assert lines["run-b"][1] == [7.0 / s for s in range(1, 5)]
    assert {t.get_text() for t in by_step.get_legend().get_texts()} == set(lines)


def test_write_report_files(tmp_path):
    a = _write_run(tmp_path / "run-a", _records())
    b = _write_run(tmp_path / "run-b", _records(gpu=True))
    report = write_report([a, b], tmp_path / "out")
    assert sorted(p.name for p in report.images) == ["loss.png", "memory.png", "optimizer.png", "throughput.png"]
    for image in report.images:
        assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = report.summary.read_text()
    assert "## run-a" in text and "## run-b" in text
    assert _plan().chosen.name in text
    assert "memory verdict" in text and "![loss.png](loss.png)" in text
    assert "loss 5.0000 -> 0.8333" in text


def test_missing_or_empty_metrics_is_a_user_error(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    _plan().write(run / "plan.json")
    with pytest.raises(UserError, match="no metrics"):
        write_report([run], tmp_path / "out")
    (run / "metrics.jsonl").write_text('{"step": 1, "loss"')  # a torn line only
    with pytest.raises(UserError, match="no metrics"):
        write_report([run], tmp_path / "out")
    with pytest.raises(UserError, match="not a run directory"):
        write_report([tmp_path / "nowhere"], tmp_path / "out")


def test_cli_report(tmp_path):
    from click.testing import CliRunner

    from orchestrate.cli import cli

    a = _write_run(tmp_path / "run-a", _records())
    result = CliRunner().invoke(cli, ["report", str(a), "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out" / "summary.md").is_file() and "loss.png" in result.output
    empty = tmp_path / "empty"
    empty.mkdir()
    _plan().write(empty / "plan.json")
    result = CliRunner().invoke(cli, ["report", str(empty)])
    assert result.exit_code == 2 and "metrics.jsonl" in result.output


def test_progress_lines_show_memory_against_the_plan_and_mfu_where_known():
    from orchestrate.report.progress_text import memory_and_mfu

    plan = _plan_for_progress(gpu=False)
    record = {"tokens_per_s": 1000.0, "rss_peak_bytes_max_rank": 3 * 2**30, "cpu_tensor_peak_bytes": 2**29,
              "predicted_gpu_bytes_per_rank": 2**30}
    assert memory_and_mfu(record, plan) == "mem 512.00 MiB/1.00 GiB"  # CPU: the tensors; no peak FLOP/s, no MFU
    gpu = _plan_for_progress(gpu=True)
    # a GPU's allocated peak against the planned tensors, not the whole plan (context, NCCL, reserve)
    memory = MemoryEstimate({"weights": 5 * 2**30, "allocator_reserve": 2**29, "cuda_context": 2**29}, {})
    gpu.chosen = dataclasses.replace(gpu.chosen, memory=memory)
    record = {"tokens_per_s": 1000.0, "gpu_max_allocated_bytes": 4 * 2**30, "predicted_gpu_bytes_per_rank": 6 * 2**30}
    text = memory_and_mfu(record, gpu)
    from orchestrate.report.mfu import utilisation

    assert text == f"mem 4.00 GiB/5.00 GiB  MFU {100 * utilisation(1000.0, gpu)['mfu']:.1f}%"


def _plan_for_progress(gpu: bool):
    from orchestrate.hardware.profile import GPUSpec, HardwareProfile
    from orchestrate.planner.strategy import Strategy
    from tests.helpers.plans import make_plan

    plan = make_plan(Strategy("ddp", 0, "none", "none", "bf16" if gpu else "fp32", False, 2))
    if gpu:
        spec = GPUSpec(name="RTX 3070", memory_bytes=8 * 2**30, peak_tflops_fp16=81, peak_tflops_bf16=81,
                       peak_tflops_fp32=20, compute_capability=(8, 6))
        plan.hardware = HardwareProfile(gpus_per_node=2, gpu=spec, cpu_memory_bytes=64 * 2**30)
    return plan
