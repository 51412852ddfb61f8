"""Auxiliary models as the planner sees them: frozen models a method runs beside the one it trains
(distillation's teacher, a preference method's reference model), and what one costs. Pure: a method
reads an auxiliary model's shape on the launcher (orchestrate/methods/auxiliary.py) and hands the
planner an `AuxiliaryModel` in its terms (planner/terms.py).

An auxiliary model is frozen: no gradients, no optimizer state, no master copy; it runs forward
only, under `torch.no_grad`, so its activations are freed block by block and only its outputs stay
for the loss. What it costs depends on where it lives (its placement), the same for every method:
- replicated: every rank holds the whole model in the compute dtype;
- sharded: FSDP2 `fully_shard(reshard_after_forward=True)` per block: 1/n of it per rank plus the
  gathered root and two blocks (the one running and the prefetched next; as the student's FSDP term);
- offload: the same shards in CPU RAM (CPUOffloadPolicy), copied to the device before each gather;
- precomputed: nothing of it in memory while training, only its cached outputs for the micro-batch;
  a first pass before training holds the model alone (`first_pass_bytes`: the rank's peak is the
  larger of the two).
- adapter: the trained model itself with its LoRA adapters disabled (a preference reference that is
  the frozen base, as TRL computes it for a peft model): no weights of its own, a forward of the base.
What its outputs take (logits, log-probabilities) is the method's: `AuxiliaryModel.output_bytes`.

The breakdown names its terms after the model: `<name>_weights`, `<name>_gathered`, `<name>_logits`,
`<name>_first_pass` per rank, `offloaded_<name>` per node; `<name>_forward`, `<name>_communication`,
`<name>_transfer` seconds per step. The worker builds it at its placement
(orchestrate/loading/auxiliary.py) before the trained model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from orchestrate.hardware.profile import HardwareProfile
from orchestrate.model.shape import ModelShape
from orchestrate.planner.strategy import Strategy


@dataclass(frozen=True)
class AuxiliaryModel:
    name: str
    """What the breakdown calls it ("teacher")."""
    shape: ModelShape
    placement: str
    """The configured placement, "auto" included (`choices` tries them; `resolve_placement` for a
    strategy pinned by hand)."""
    output_bytes: Callable[[str, int, int], float]
    """(placement, tokens of one micro-batch, compute-dtype bytes) -> bytes of its outputs and the
    loss temporaries they bring while training."""
    first_pass_output_bytes: Callable[[int, int], float]
    """(tokens of one micro-batch, compute-dtype bytes) -> the outputs one micro-batch of the
    precomputing pass holds."""
    adapter: bool = False
    """It can be the trained model with its adapters disabled (the trained model's own base, under a
    LoRA / QLoRA base method): auto takes that placement, which costs no weights."""

    @property
    def gpu_keys(self) -> tuple[str, ...]:
        return tuple(f"{self.name}_{part}" for part in ("weights", "gathered", "logits", "first_pass"))

    @property
    def cpu_keys(self) -> tuple[str, ...]:
        return (f"offloaded_{self.name}",)

    def choices(self, hw: HardwareProfile) -> list[AuxiliaryModel]:
        """The placements the search tries per strategy: the configured one, or for auto the first
        that fits of `auto_placements`."""
        if self.placement != "auto":
            return [self]
        return [replace(self, placement=p) for p in (["adapter"] if self.adapter else auto_placements(hw))]


def auto_placements(hw: HardwareProfile) -> list[str]:
    """What `placement: auto` tries, in the planner's order (the first that fits wins): cheapest
    per step first; offload only with an accelerator to offload from; precomputed last (it costs a
    first pass over the data and disk for the cached outputs)."""
    return ["replicated", *(["sharded"] if hw.world_size > 1 else []), *(["offload"] if hw.has_gpu else []),
            "precomputed"]


def resolve_placement(placement: str, strategy: Strategy, world_size: int) -> str:
    """For a plan whose candidate names no placement (a strategy pinned by hand, not searched),
    auto: sharded when the student's parameters are sharded over several ranks (ZeRO-3, FSDP full
    shard: the run already trades gathers for memory), else replicated."""
    if placement != "auto":
        return placement
    return "sharded" if world_size > 1 and strategy.zero_stage == 3 else "replicated"


def _resolved(model: AuxiliaryModel, strategy: Strategy, world_size: int) -> str:
    return "adapter" if model.adapter and model.placement == "auto" else resolve_placement(
        model.placement, strategy, world_size)


def _blocks_gathered(shape: ModelShape) -> int:
    return shape.root_parameters + 2 * shape.block_parameters


def state_bytes(model: AuxiliaryModel, strategy: Strategy, hw: HardwareProfile, seq_len: int,
                c: int) -> tuple[dict[str, float], dict[str, float]]:
    """(device terms per rank, host terms per rank) while training: weights, gathered blocks and
    outputs; `c`: bytes of the compute dtype the model runs in."""
    shape, n = model.shape, hw.world_size
    placement = _resolved(model, strategy, n)
    if placement == "offload" and not hw.has_gpu:
        placement = "replicated"  # a CPU-only rank's memory is host memory already
    p = shape.parameters
    weights = gathered = offloaded = 0.0
    if placement == "replicated":
        weights = c * p
    elif placement in ("sharded", "offload"):
        gathered = c * min(p, _blocks_gathered(shape))
        if placement == "sharded":
            weights = c * p / n
        else:
            offloaded = c * p / n
    outputs = model.output_bytes(placement, strategy.micro_batch_size * seq_len, c)
    name = model.name
    return ({f"{name}_weights": weights, f"{name}_gathered": gathered, f"{name}_logits": outputs},
            {f"offloaded_{name}": offloaded})


def first_pass_bytes(model: AuxiliaryModel, strategy: Strategy, hw: HardwareProfile, seq_len: int, c: int) -> float:
    """Device bytes of the precomputed placement's first pass (0 for the others), which runs alone
    before the trained model is built, so the rank's peak is max(pass, training): memory.py adds the
    excess. The pass (orchestrate/loading/auxiliary.py `lean_placement`) runs the model offloaded on
    GPUs (the gathered blocks), sharded over CPU ranks (its shard + the gathered blocks), and holds one
    micro-batch's outputs."""
    if _resolved(model, strategy, hw.world_size) != "precomputed":
        return 0.0
    shape, n = model.shape, hw.world_size
    weights = 0.0 if hw.has_gpu or n == 1 else c * shape.parameters / n
    gathered = c * (min(shape.parameters, _blocks_gathered(shape)) if hw.has_gpu or n > 1 else shape.parameters)
    return weights + gathered + model.first_pass_output_bytes(strategy.micro_batch_size * seq_len, c)


def forward_flops_per_token(shape: ModelShape, seq_len: int) -> float:
    """Forward only: 2 FLOPs per matmul parameter (Kaplan et al. 2020, 2.1) + the attention
    score/context matmuls, 4·layers·seq·hidden (Narayanan et al. 2021, eq. 3 without backward)."""
    return 2 * shape.matmul_parameters + 4 * shape.num_layers * seq_len * shape.hidden_size


def seconds(model: AuxiliaryModel, hw: HardwareProfile, strategy: Strategy, seq_len: int, accumulation: int,
            seconds_per_flop_token: float, c: int, bandwidth: float) -> dict[str, float]:
    """Seconds per step: its forward on every micro-batch (at the trained model's achieved rate), the
    all-gather of its shards (ring: (n-1)/n of it per rank per micro-batch) and, offloaded, the
    host-to-device copy of each rank's shard per micro-batch. Adapter: the forward only. Precomputed:
    none per step (the first pass is paid once, before step 1). Keys: <name>_forward (compute), <name>_communication,
    <name>_transfer (offload transfer)."""
    n, name = hw.world_size, model.name
    placement = _resolved(model, strategy, n)
    if placement == "precomputed":
        return {f"{name}_forward": 0.0, f"{name}_communication": 0.0, f"{name}_transfer": 0.0}
    tokens = accumulation * strategy.micro_batch_size * seq_len
    forward = tokens * forward_flops_per_token(model.shape, seq_len) * seconds_per_flop_token
    p = model.shape.parameters
    comm = accumulation * (n - 1) / n * c * p / bandwidth if placement in ("sharded", "offload") and n > 1 else 0.0
    transfer = accumulation * c * p / n / hw.gpu.pcie_bandwidth if placement == "offload" and hw.has_gpu else 0.0
    return {f"{name}_forward": forward, f"{name}_communication": comm, f"{name}_transfer": transfer}
