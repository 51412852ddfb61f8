"""The library versions a plan is made for: what each version keeps on the GPU differs (the
planner's version-dependent terms are in `orchestrate/planner/software_terms.py`).

Read from the installed distributions' metadata (`importlib.metadata`, nothing is imported) when the
hardware profile is resolved; a profile file or a published measurement can pin its own. None means
"not known": the terms then assume the releases this project pins (constraints-ci.txt).
"""

from __future__ import annotations

import importlib.metadata

from pydantic import BaseModel, ConfigDict

_DISTRIBUTIONS = {"torch": "torch", "transformers": "transformers", "peft": "peft",
                  "bitsandbytes": "bitsandbytes", "deepspeed": "deepspeed", "liger_kernel": "liger-kernel"}


class SoftwareStack(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)

    torch: str | None = None
    """torch version, e.g. "2.13.0+cu130"."""
    cuda: str | None = None
    """CUDA runtime torch was built for, e.g. "13.0" (torch's local version tag `+cuXYZ`); None for a CPU
    build or when unknown."""
    transformers: str | None = None
    peft: str | None = None
    bitsandbytes: str | None = None
    deepspeed: str | None = None
    liger_kernel: str | None = None
    """liger-kernel's version where it is installed (the fused kernels the planner may choose)."""


def cuda_of_torch(version: str | None) -> str | None:
    """"2.13.0+cu130" -> "13.0", "1.10.1+cu113" -> "11.3"; None for +cpu, +rocm or no tag."""
    tag = version.partition("+")[2] if version else ""
    digits = tag[2:] if tag.startswith("cu") else ""
    return f"{digits[:-1]}.{digits[-1]}" if len(digits) >= 2 and digits.isdigit() else None


def installed_software() -> SoftwareStack:
    """This interpreter's versions (metadata only: no import, so no CUDA initialisation)."""
    found: dict[str, str | None] = {}
    for field, dist in _DISTRIBUTIONS.items():
        try:
            found[field] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[field] = None
    return SoftwareStack(**found, cuda=cuda_of_torch(found["torch"]))
