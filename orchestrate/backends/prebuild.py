"""Compile DeepSpeed's CPU Adam extension once, up front (`make install` runs this).

DeepSpeed JIT-compiles it on first use into ~/.cache/torch_extensions; on a fresh machine that
takes about a minute, which must not land inside a test or a worker's first step.
"""

import sys


def main() -> int:
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder
    except ImportError:
        print("deepspeed not installed; skipping CPU Adam prebuild", file=sys.stderr)
        return 0
    CPUAdamBuilder().load(verbose=False)
    print("DeepSpeed CPU Adam extension ready")
    return 0


if __name__ == "__main__":
    sys.exit(main())
