"""The report's figures. Each function takes the runs and returns a matplotlib Figure (Agg, no
display), one line per run and quantity on shared axes, labelled with the run directory's name, so
several runs overlay. The lines' data are the metrics.jsonl values as they are (memory in GiB),
which the tests read back from the Line2D objects."""

from __future__ import annotations

import itertools

import matplotlib

matplotlib.use("Agg")  # before pyplot: no display on training machines
from matplotlib.figure import Figure  # noqa: E402

from orchestrate.report.mfu import utilisation  # noqa: E402
from orchestrate.report.runs import Run  # noqa: E402

GIB = 2**30


def _series(run: Run, key: str) -> tuple[list[int], list[float]]:
    pairs = [(r["step"], float(r[key])) for r in run.records if r.get(key) is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def cumulative_tokens(run: Run) -> dict[int, int]:
    """Step -> tokens trained up to and including it."""
    return dict(zip([r["step"] for r in run.records],
                    itertools.accumulate(int(r.get("tokens", 0)) for r in run.records), strict=True))


def _figure(ncols: int) -> tuple[Figure, list]:
    fig = Figure(figsize=(5.2 * ncols, 3.6), dpi=80, layout="constrained")
    return fig, [fig.add_subplot(1, ncols, i + 1) for i in range(ncols)]


def _finish(ax, title: str, xlabel: str, ylabel: str) -> None:
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize="small")


def loss_figure(runs: list[Run]) -> Figure:
    fig, (by_step, by_tokens) = _figure(2)
    for run in runs:
        tokens = cumulative_tokens(run)
        for key, suffix, style in (("loss", "", "-"), ("eval_loss", " (eval)", "o--")):
            steps, values = _series(run, key)
            if steps:
                by_step.plot(steps, values, style, label=run.name + suffix)
                by_tokens.plot([tokens[s] for s in steps], values, style, label=run.name + suffix)
    _finish(by_step, "loss", "step", "loss")
    _finish(by_tokens, "loss", "tokens", "loss")
    return fig


def throughput_figure(runs: list[Run]) -> Figure:
    fig, (tps, mfu) = _figure(2)
    for run in runs:
        steps, values = _series(run, "tokens_per_s")
        tps.plot(steps, values, label=run.name)
        mfus = [utilisation(v, run.plan).get("mfu") for v in values]
        if steps and mfus[0] is not None:  # left out where the peak FLOP/s is unknown (CPU)
            mfu.plot(steps, mfus, label=run.name)
    _finish(tps, "throughput", "step", "tokens/s (all ranks)")
    _finish(mfu, "MFU (PaLM app. B)" if mfu.lines else "MFU: peak FLOP/s unknown (CPU run)", "step", "MFU")
    return fig


def optimizer_figure(runs: list[Run]) -> Figure:
    fig, (lr, norm) = _figure(2)
    for run in runs:
        lr.plot(*_series(run, "lr"), label=run.name)
        steps, values = _series(run, "grad_norm")
        if steps:
            norm.plot(steps, values, label=run.name)
    _finish(lr, "learning rate", "step", "lr")
    _finish(norm, "gradient norm (before clipping)", "step", "grad norm")
    return fig


def measured_key(run: Run) -> str:
    """The per-rank measurement that corresponds to the per-rank prediction (see memory_verdict.py)."""
    keys = {k for r in run.records for k in r}
    for key in ("gpu_max_reserved_bytes", "cpu_tensor_peak_bytes"):
        if key in keys:
            return key
    return "rss_peak_bytes_max_rank"  # a CPU run from before the tensor peak was measured


def memory_figure(runs: list[Run]) -> Figure:
    fig, (ax,) = _figure(1)
    for run in runs:
        key = measured_key(run)
        if key == "gpu_max_reserved_bytes":
            # Like with like (memory_verdict.py): torch's peaks see neither the CUDA context nor NCCL's buffers.
            memory = run.plan.chosen.memory
            for peak, predicted, what in (("gpu_max_reserved_bytes", memory.gpu_allocator, "tensors + allocator reserve"),
                                          ("gpu_max_allocated_bytes", memory.gpu_tensors, "tensors")):
                steps, values = _series(run, peak)
                ax.plot(steps, [v / GIB for v in values], label=f"{run.name} measured ({peak})")
                ax.plot(steps, [predicted / GIB] * len(steps), "--", label=f"{run.name} predicted ({what})")
            continue
        steps, values = _series(run, key)
        ax.plot(steps, [v / GIB for v in values], label=f"{run.name} measured ({key})")
        steps, values = _series(run, "predicted_gpu_bytes_per_rank")
        ax.plot(steps, [v / GIB for v in values], "--", label=f"{run.name} predicted")
    _finish(ax, "peak memory per rank: measured vs predicted", "step", "GiB")
    return fig


FIGURES = {
    "loss.png": loss_figure,
    "throughput.png": throughput_figure,
    "optimizer.png": optimizer_figure,
    "memory.png": memory_figure,
}
