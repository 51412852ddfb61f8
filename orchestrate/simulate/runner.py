"""Run one simulation in this process: fake process group, FakeTensorMode, storage counter.

Process-global state (the default process group, DeepSpeed's communication backend, patched
functions) makes a second simulation in the same process unsafe, so `orchestrate.simulate.simulate`
runs each one in a fresh interpreter: `python -m orchestrate.simulate.runner SPEC.json RESULT.json`.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

from orchestrate.simulate.result import SimulationResult, summarize
from orchestrate.simulate.run_spec import RunSpec


def simulate_in_process(spec: RunSpec) -> SimulationResult:
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from orchestrate.simulate import harness, patches
    from orchestrate.simulate.counter import LiveStorageCounter

    start = time.perf_counter()
    # DeepSpeed reads these (accelerator device names, its comm layer); torchrun would set them.
    for key, value in (("RANK", spec.rank), ("LOCAL_RANK", spec.rank), ("WORLD_SIZE", spec.world_size),
                       ("LOCAL_WORLD_SIZE", spec.world_size), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "0")):
        os.environ.setdefault(key, str(value))
    dist.init_process_group("fake", store=FakeStore(), rank=spec.rank, world_size=spec.world_size)
    try:
        mesh = harness.make_mesh(spec)
        counter = LiveStorageCounter()
        with patches.fake_tensor_patches(spec), FakeTensorMode(), counter:
            harness.run(spec, counter, mesh)
    finally:
        dist.destroy_process_group()
    result = summarize(counter, spec.strategy_obj.name, world_size=spec.world_size, rank=spec.rank,
                       seq_len=spec.seq_len, micro_batch_size=spec.strategy["micro_batch_size"],
                       notes=list(spec.notes))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return SimulationResult.from_dict({**result.to_dict(), "wall_s": time.perf_counter() - start,
                                       "max_rss_bytes": rss})


def main(argv: list[str]) -> int:
    spec_path, result_path = Path(argv[0]), Path(argv[1])
    spec = RunSpec.from_dict(json.loads(spec_path.read_text()))
    result = simulate_in_process(spec)
    result_path.write_text(json.dumps(result.to_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
