"""A local model directory's safetensors files, checked before any worker reads them: a truncated,
extended or overwritten file is one UserError naming it, not a traceback in every rank.

safetensors' own header parse is the check (`safe_open` with numpy, so the launcher imports no
torch): it reads the JSON header only and refuses a header that does not parse or whose tensors do
not cover the file exactly ("incomplete metadata, file not fully covered"). Weights overwritten in
place at the same size pass it; nothing short of a checksum of the original would catch those.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import SafetensorError, safe_open

from orchestrate.errors import Problem, UserError

if TYPE_CHECKING:
    from orchestrate.config.schema import RunConfig


def damaged_weights(path: Path, error: Exception) -> Problem:
    return Problem(str(path), f"damaged: {str(error).splitlines()[0] if str(error) else type(error).__name__}",
                   "copy or download the model again (or re-save it with save_pretrained)")


def check_weight_files(model_dir: Path) -> None:
    """UserError naming every *.safetensors file of `model_dir` whose header safetensors refuses."""
    problems = []
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="numpy"):
                pass
        except (SafetensorError, OSError) as exc:
            problems.append(damaged_weights(path, exc))
    if problems:
        raise UserError(f"the model weights in {model_dir} cannot be read", problems)


def check_model_weights(config: RunConfig) -> None:
    """`check_weight_files` of a local `model.name_or_path` directory (the launcher's check)."""
    if config.model.name_or_path is not None and (path := config.resolve_path(config.model.name_or_path)).is_dir():
        check_weight_files(path)
