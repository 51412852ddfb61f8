"""The run-directory contract: what a run directory holds, the exit codes, plan.json and checkpoint
metadata. Both sides of a run import it, the launcher (`orchestrate.launch`) that writes the
directory and the workers (`orchestrate.worker`) that train in it; they never import each other.

    RUN_DIR/
      config.yaml        the validated config, paths made absolute
      plan.json          the plan, with its `run` section (Plan.run: worker environment and why)
      <backend files>    what the backend's `render(plan)` returned, e.g. deepspeed.json
      accelerate.yaml    the equivalent `accelerate launch` config
      data/              the generated demo corpus, when the config asks for it
      logs/              torchrun's per-rank stdout/stderr/error files
      launch.sh          the exact command the launcher ran
      job.sbatch         the SLURM batch script (`orchestrate slurm`)
      metrics.jsonl      one JSON object per step (written by rank 0)
      init_model/        the seeded initial weights (written by the workers when training from scratch;
                         only config.json when the backend builds the model itself: DDP)
      checkpoints/       resumable checkpoints (`orchestrate.run.checkpoints`)
      model/             the trained Hugging Face model
      .orchestrate-run   the marker: this directory is an orchestrate run (`orchestrate.run.layout`)
      .lock              held by the running launcher, names it (`orchestrate.run.lock`)
      REQUEUE            left by workers that checkpointed on a stop signal (`orchestrate.run.layout`)
"""
