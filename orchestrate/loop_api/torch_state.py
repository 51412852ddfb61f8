"""The engine half of a checkpoint for the user's FSDP2- or DDP-wrapped model and optimizer: what
`orchestrate.worker.checkpointing.Checkpointer` calls `save_checkpoint` / `load_checkpoint` on
(the write protocol, RNG and manifest are the Checkpointer's). torch's distributed checkpoint
(DCP) with `get_state_dict`: each FSDP2 rank writes its own shards, DDP's replicated state once,
and DCP reshards on load. The layout is FSDPEngine's ({"model", "optim"} + client_state.json), so
`orchestrate export` reads an FSDP2 one as it reads the worker's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrate.backends.safe_load import weights_only_loads
from orchestrate.backends.torch_engine import read_client_state, write_client_state

if TYPE_CHECKING:
    import torch

SCALER_FILE = "scaler_state.json"


class TorchLoopState:
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: Any, rank: int) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler
        self.rank = rank

    def save_checkpoint(self, ckpt_dir: Path, client_state: dict[str, Any]) -> None:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(ckpt_dir))
        if self.rank == 0:
            write_client_state(Path(ckpt_dir), client_state)
            if self.scaler is not None:
                (Path(ckpt_dir) / SCALER_FILE).write_text(json.dumps(self.scaler.state_dict()))
        dist.barrier()

    def load_checkpoint(self, ckpt_dir: Path) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        with weights_only_loads():  # DCP unpickles non-tensor entries (param_groups) itself
            dcp.load(state, checkpoint_id=str(ckpt_dir))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if self.scaler is not None:
            self.scaler.load_state_dict(json.loads((Path(ckpt_dir) / SCALER_FILE).read_text()))
        return read_client_state(Path(ckpt_dir))
