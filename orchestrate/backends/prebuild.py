"""Compile DeepSpeed's JIT extensions once, up front (`make install` runs this).

DeepSpeed JIT-compiles its CPU Adam on first use, and on a CPU-only machine also its FusedAdam and
shared-memory collectives (`deepspeed_shm_comm`, built when deepspeed.comm starts), into
~/.cache/torch_extensions: about two and a half minutes on a fresh machine (or after switching
virtual environments: the build hash includes the interpreter's paths), which must not land inside a
test or a worker's first step.
"""

import os
import sys


def main() -> int:
    import torch

    if not torch.cuda.is_available():  # as the CPU workers' env says (launch/rundir.py worker_env): no
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # "Setting accelerator to CPU" warning at import
    try:
        from deepspeed.comm.torch import build_shm_op
        from deepspeed.ops.op_builder import CPUAdamBuilder
    except ImportError:
        print("deepspeed not installed; skipping the prebuild of its extensions", file=sys.stderr)
        return 0
    CPUAdamBuilder().load(verbose=False)
    print("DeepSpeed CPU Adam extension ready")
    if not torch.cuda.is_available():
        # A DeepSpeed config's "AdamW" (the one `orchestrate config --for hf-trainer` writes) is
        # DeepSpeed's FusedAdam, on the CPU accelerator a C++ build of its own (tens of seconds:
        # docs/measurements.md#backendsprebuildpy; on GPUs a CUDA one, left to the first run that wants it).
        from deepspeed.ops.op_builder.cpu import FusedAdamBuilder

        FusedAdamBuilder().load(verbose=False)
        print("DeepSpeed CPU FusedAdam extension ready")
    # The very call deepspeed.comm makes at start-up: None where the accelerator has no such op (GPUs).
    if build_shm_op() is not None:
        print("DeepSpeed shared-memory collectives extension ready")
    return 0


if __name__ == "__main__":
    sys.exit(main())
