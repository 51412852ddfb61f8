"""Compile DeepSpeed's JIT extensions once, up front (`make install` runs this).

DeepSpeed JIT-compiles its CPU Adam on first use, and on a CPU-only machine also its shared-memory
collectives (`deepspeed_shm_comm`, built when deepspeed.comm starts), into ~/.cache/torch_extensions:
about a minute and 40 s on a fresh machine (or after switching virtual environments: the build
hash includes the interpreter's paths), which must not land inside a test or a worker's first step.
"""

import sys


def main() -> int:
    try:
        import deepspeed.ops
        from deepspeed.accelerator import get_accelerator
        from deepspeed.ops.op_builder import CPUAdamBuilder
    except ImportError:
        print("deepspeed not installed; skipping the prebuild of its extensions", file=sys.stderr)
        return 0
    CPUAdamBuilder().load(verbose=False)
    print("DeepSpeed CPU Adam extension ready")
    # What deepspeed.comm.torch.build_shm_op loads: only the CPU accelerator has this builder.
    shm = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if shm is not None and deepspeed.ops.__compatible_ops__.get(shm.NAME, False):
        shm.load(verbose=False)
        print("DeepSpeed shared-memory collectives extension ready")
    return 0


if __name__ == "__main__":
    sys.exit(main())
