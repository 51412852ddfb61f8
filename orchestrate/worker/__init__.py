"""The training worker: `python -m orchestrate.worker RUN_DIR/plan.json`, one process per rank,
started by `orchestrate launch` (torchrun underneath), a plain `torchrun` or `srun`."""
