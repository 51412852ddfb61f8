"""Minimal data path: local text/JSON-lines files (or a generated demo corpus) -> packed token blocks
-> a resumable distributed sampler. Small on purpose; a datasets-based pipeline replaces it later,
behind the same `build_data(plan, plan_dir, rank, world_size) -> TrainData` entry point."""

from orchestrate.data.pipeline import TrainData, build_data

__all__ = ["TrainData", "build_data"]
