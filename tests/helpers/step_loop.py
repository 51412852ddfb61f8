"""The step loop's inputs without a backend or data pipeline: batches of a causal LM and a
checkpointer that has not saved, for tests of `run_loop` with a fake engine."""

from __future__ import annotations

import torch


class CausalBatches:
    def micro_batch(self, size: int) -> dict[str, torch.Tensor]:
        ids = torch.zeros(size, 4, dtype=torch.long)
        return {"input_ids": ids, "labels": ids}  # a causal-LM batch: the loop counts its loss tokens


class UnsavedCheckpointer:
    last_save_s = None
