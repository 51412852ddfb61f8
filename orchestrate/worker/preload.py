"""Import the model's code in a background thread while the process group forms.

The rendezvous waits for the slowest rank; importing transformers' modeling code (a large share of a
worker's start: docs/measurements.md#workerpreloadpy) and DeepSpeed meanwhile takes that time off the path to step 1. The worker joins the thread before its
next stage touches transformers: two threads in transformers' lazy modules at once can see a
half-initialised module ("module 'transformers' has no attribute 'PreTrainedTokenizerBase'", when
the data stage runs alongside). A failure is left for the stage that needs the module: it
imports again and reports the error there.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from orchestrate.backends.deepspeed_import import import_deepspeed_lean
from orchestrate.backends.registry import get_backend
from orchestrate.methods.registry import active_methods
from orchestrate.model.meta import load_model_config
from orchestrate.model.tasks import model_class

if TYPE_CHECKING:
    from orchestrate.config.schema import RunConfig
    from orchestrate.planner.plan import RunPlan


def start_preload(plan: RunPlan) -> threading.Thread:
    thread = threading.Thread(target=_preload, args=(plan,), name="orchestrate-preload", daemon=True)
    thread.start()
    return thread


def _preload(plan: RunPlan) -> None:
    try:
        backend = get_backend(plan.strategy.backend)
        # DeepSpeed: its engine, the initial model's save_pretrained (backends/deepspeed_import.py), or
        # its Ulysses attention (backends/sequence_parallel.py).
        if backend.name == "deepspeed" or reads_weight_files(plan) or plan.strategy.sequence_parallel > 1:
            import_deepspeed_lean(keep_mlflow="mlflow" in plan.config.train.report_to)
        import_model_code(plan.config)
    except Exception:  # noqa: BLE001 - reported by the stage that needs it (see the docstring)
        pass


def reads_weight_files(plan: RunPlan) -> bool:
    """Whether the worker writes the initial weights as files before the model is built: where the
    backend reads them (`Backend.reads_weights`), or where a method needs the file whatever the backend
    (`Method.trains_adapters`: QLoRA quantizes while loading it, `export --merge` re-reads the base)."""
    return get_backend(plan.strategy.backend).reads_weights(plan) or any(
        method.trains_adapters for method in active_methods(plan.config))


def import_model_code(config: RunConfig) -> None:
    """Import transformers' code for the model of `config` (also run by torchrun's agent before it
    forks the workers: orchestrate.agent.process). Only a config that is read without the network: a
    Hub name is resolved by the model stage."""
    model = config.model
    if model.module is None and (model.architecture is not None
                                 or config.resolve_path(model.name_or_path or "").is_dir()):
        model_class(load_model_config(config), model.task)
