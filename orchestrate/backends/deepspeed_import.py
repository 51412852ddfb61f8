"""Import DeepSpeed without the mlflow import its autotuner makes at module load.

`import deepspeed` loads deepspeed.autotuning.autotuner, whose `try: import mlflow` takes most of
the DeepSpeed import when mlflow is installed (docs/measurements.md#backendsdeepspeed_importpy).
orchestrate never runs the autotuner. Even a DDP worker imports DeepSpeed: transformers'
`save_pretrained` unwraps the model with accelerate's `extract_model_from_parallel`, which imports
it to look for a DeepSpeedEngine.
"""

from __future__ import annotations

import sys


def import_deepspeed_lean(keep_mlflow: bool) -> None:
    """Import DeepSpeed now (when installed) with `import mlflow` failing meanwhile, unless mlflow is
    wanted (`keep_mlflow`: the run reports to it) or already imported. Later imports of mlflow work."""
    if keep_mlflow or "deepspeed" in sys.modules or "mlflow" in sys.modules:
        return
    sys.modules["mlflow"] = None  # type: ignore[assignment]  # `import mlflow` raises ImportError
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        pass  # not installed: a DDP or FSDP2 run does not need it
    finally:
        del sys.modules["mlflow"]
