"""The data path: local files or `datasets.load_dataset` sources -> tokenised once into a shared,
memory-mapped cache -> packed (or padded) samples -> a resumable, world-size independent sampler.

Entry points: `build_data(plan, plan_dir, rank, world_size, local_rank, sequence) -> TrainData` (workers) and
`prepare_data(config, ...)` (the launcher and `orchestrate prepare`). See docs/data.md.
"""

from orchestrate.data.pipeline import PreparedData, TrainData, build_data, prepare_data

__all__ = ["PreparedData", "TrainData", "build_data", "prepare_data"]
