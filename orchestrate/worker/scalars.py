"""The scalars every tracker logs for one step, named once so TensorBoard, wandb and MLflow agree.

Input: a metrics.jsonl record (see `orchestrate/worker/metrics.py` and the step loop); output: tag ->
float, absent values (no eval this step, no grad norm from the backend, no MFU on CPU) left out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from orchestrate.methods.registry import active_methods
from orchestrate.report.mfu import utilisation

if TYPE_CHECKING:
    from orchestrate.planner.plan import RunPlan

# record key -> tracker tag
_DIRECT = {
    "loss": "train/loss",
    "eval_loss": "eval/loss",
    "eval_exact_match": "eval/exact_match",
    "loss_tokens": "train/loss_tokens",
    "loss_tokens_per_s": "perf/loss_tokens_per_s",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "sparsity": "train/sparsity",
    "tokens_per_s": "perf/tokens_per_s",
    "step_time_s": "perf/step_time_s",
    "gpu_max_allocated_bytes": "memory/gpu_max_allocated_bytes",
    "gpu_max_reserved_bytes": "memory/gpu_max_reserved_bytes",
    "rss_peak_bytes_max_rank": "memory/rss_peak_bytes_max_rank",
    "node_rss_peak_bytes": "memory/node_rss_peak_bytes",
    "predicted_gpu_bytes_per_rank": "memory/predicted_gpu_bytes_per_rank",
    "predicted_cpu_bytes_per_node": "memory/predicted_cpu_bytes_per_node",
}


def step_scalars(record: dict[str, Any], plan: RunPlan) -> dict[str, float]:
    out = {tag: float(record[key]) for key, tag in _DIRECT.items() if record.get(key) is not None}
    # The training methods' own metrics (a preference method's rewards): train/<key>, eval/<key> of eval_<key>.
    prefixes = tuple(prefix for method in active_methods(plan.config) for prefix in method.metric_keys)
    for key, value in record.items():
        name = key.removeprefix("eval_")
        if prefixes and name.startswith(prefixes) and isinstance(value, int | float):
            out[f"{'eval' if key.startswith('eval_') else 'train'}/{name}"] = float(value)
    if record.get("tokens_per_s") is not None:
        out.update({f"perf/{k}": v for k, v in utilisation(float(record["tokens_per_s"]), plan).items()})
    return out
