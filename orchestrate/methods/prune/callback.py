"""The pruning step callback (`prune:` in model.yaml, docs/pruning.md). Collective: every rank
masks its own shard and the thresholds are agreed by all-reduced counts (prune_masks.py).

After every optimizer step: re-apply the masks to every copy of the weights (the optimizer has just
moved the pruned ones), then, on a schedule step, grow the masks to that step's sparsity (Zhu &
Gupta 2017: re-masking first keeps the mask monotone, pruned weights rank lowest), and record the
measured sparsity. It runs before evaluation and checkpoints, so both see the pruned weights.

Resume: the checkpoint holds the masked weights, so the masks are recomputed as "weight != 0"
(a kept weight that is exactly 0.0 after training is a measure-zero event).
"""

from __future__ import annotations

import torch

from orchestrate.methods.prune import masks as prune_masks
from orchestrate.methods.prune.schedule import prunable_linears, scheduled_sparsity, sparsity_at, updates_mask
from orchestrate.worker.callbacks.base import Callback, Phase, StepEnd, Training


class Pruning(Callback):
    phase = Phase.WEIGHTS  # first: evaluation and checkpoints see the pruned weights

    def __init__(self) -> None:
        self.masks: list[torch.Tensor] | None = None
        self.rep = 1

    def views(self, training: Training) -> list[prune_masks.Pruned]:
        # Rebuilt every step: DeepSpeed re-points param.data after its step (stage_1_and_2.py).
        kinds = {name for name, _, _ in prunable_linears(training.plan.shape, training.plan.config.prune)}
        return prune_masks.prunable_views(training.engine.model, kinds)

    def on_train_start(self, training: Training) -> None:
        views = self.views(training)
        self.rep = prune_masks.replication(views)
        if scheduled_sparsity(training.start_step, training.plan.config.prune) > 0:  # a mask update happened
            self.masks = [v.local != 0 for v in views]

    def on_step_end(self, training: Training, end: StepEnd) -> None:
        prune = training.plan.config.prune
        views = self.views(training)
        if self.masks is not None:
            prune_masks.apply_masks(views, self.masks)
        if updates_mask(end.step, prune):
            sparsity = sparsity_at(end.step, prune)
            if prune.method == "structured":
                shape = training.plan.shape
                self.masks = prune_masks.structured_masks(views, sparsity, shape.intermediate_size,
                                                          shape.num_heads if prune.heads else 0,
                                                          shape.num_kv_heads, shape.head_dim)
            else:
                self.masks = prune_masks.magnitude_masks(views, sparsity, prune.scope == "per-layer", self.rep)
            prune_masks.apply_masks(views, self.masks)
        end.add({"sparsity": prune_masks.measured_sparsity(views, self.rep),
                 "sparsity_target": scheduled_sparsity(end.step, prune)})
