"""What a simulation reports, computed from the counter's storage lifetimes after the run."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from orchestrate.simulate.counter import Life, LiveStorageCounter
from orchestrate.simulate.replay import allocator_peaks

# An untagged storage is attributed by the phase it was born in.
PHASE_KIND = {"forward": "activations", "logits": "logits", "backward": "backward_temporaries",
              "optimizer": "optimizer_temporaries", "comm": "comm_buckets", "setup": "other", "idle": "other"}
MODEL_STATE_KINDS = ("parameters", "master_weights", "gradients", "optimizer_states", "buffers")
_ACTIVATION_PHASES = ("forward", "logits")


@dataclass(frozen=True)
class SimulationResult:
    strategy: str
    """Name of the strategy simulated (offload removed where `notes` say so)."""
    world_size: int
    rank: int
    seq_len: int
    micro_batch_size: int
    peak_bytes: int
    """Per-rank peak of live storage bytes over the training steps (what the simulation sees: no
    CUDA context, workspaces, NCCL buffers or allocator fragmentation)."""
    peak_bytes_cuda_rounded: int
    """The same with every storage rounded up to CUDA's 512-byte allocation granularity."""
    peak_phase: str
    """forward, logits, backward or optimizer: what was running at the peak."""
    peak_step: int
    breakdown: dict[str, int]
    """Live bytes at the peak by kind: parameters, master_weights, gradients, optimizer_states,
    buffers, gathered_params (FSDP2 unsharded parameters), comm_buckets (FSDP2 all-gather and
    reduce-scatter buffers, DDP buckets, DeepSpeed ipg buckets), activations, logits,
    backward_temporaries, optimizer_temporaries, other."""
    model_state_bytes: int
    """Live bytes between steps (after the last step): the steady-state model states."""
    model_state_breakdown: dict[str, int]
    step_peaks: list[int]
    saved_activation_bytes: dict[str, int]
    """Last step: storages born in forward and still live when it ends (what autograd keeps for
    backward), by kind (activations, logits); gathered parameters excluded."""
    activation_peak_bytes: int
    """Last step: peak of those activation and logits storages (incl. the loss/LM-head backward)."""
    allocator: dict[str, dict[str, int]] = field(default_factory=dict)
    """The training steps replayed through the CUDA caching-allocator model (replay.py), by setting
    ("segments": torch's default, "expandable": expandable_segments:True): peak allocated, reserved
    and requested bytes. Empty in results cached before the replay existed."""
    notes: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    max_rss_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SimulationResult:
        return cls(**data)


def kind_of(life: Life) -> str:
    """Its tag, else its phase's kind; a method's own phase (methods/spec.py SimulatedPhase) is its kind."""
    return life.tag or PHASE_KIND.get(life.phase, life.phase)


def live_by_kind(lives: list[Life], t: int) -> dict[str, int]:
    out: dict[str, int] = {}
    for life in lives:
        if life.live_at(t) and life.nbytes:
            k = kind_of(life)
            out[k] = out.get(k, 0) + life.nbytes
    return out


def _activation_lives(counter: LiveStorageCounter, start: int, end: int) -> list[Life]:
    return [lf for lf in counter.lives
            if start <= lf.birth <= end and lf.tag is None and lf.phase in _ACTIVATION_PHASES]


def _sweep_peak(lives: list[Life]) -> int:
    events = sorted([(lf.birth, lf.nbytes) for lf in lives]
                    + [(lf.death, -lf.nbytes) for lf in lives if lf.death is not None])
    cur = peak = 0
    for _, delta in events:  # deaths sort before births at equal times: they are distinct events
        cur += delta
        peak = max(peak, cur)
    return peak


def replay_peak(lives: list[Life], start: int, end: int, base: int, keep=None) -> int:
    """Peak live bytes over events (start, end], starting from `base` bytes live at `start`;
    `keep(life)` False leaves a storage born in that window out."""
    events = [(lf.birth, lf.nbytes) for lf in lives if start < lf.birth <= end and (keep is None or keep(lf))]
    events += [(lf.death, -lf.nbytes) for lf in lives if lf.death is not None and start < lf.death <= end
               and (lf.birth <= start or keep is None or keep(lf))]
    cur = peak = base
    for _, delta in sorted(events):
        cur += delta
        peak = max(peak, cur)
    return peak


def step_peaks(counter: LiveStorageCounter, keep=None) -> list[int]:
    """Peak live bytes within each training step, replayed from the lifetimes."""
    ends = [t for t, _ in counter.marks.get("step_end", [])]
    return [replay_peak(counter.lives, start, end, base, keep)
            for (start, base), end in zip(counter.marks.get("step_start", []), ends, strict=True)]


def summarize(counter: LiveStorageCounter, spec_strategy: str, *, world_size: int, rank: int, seq_len: int,
              micro_batch_size: int, notes: list[str]) -> SimulationResult:
    lives = counter.lives
    starts = [t for t, _ in counter.marks["step_start"]]
    peak_step = max(i for i, s in enumerate(starts) if s <= counter.peak_t) + 1 if starts else 0
    # The peak is reached by a birth: the storage born at peak_t says what was running.
    peak_life = next((lf for lf in lives if lf.birth == counter.peak_t), None)
    end_t = counter.marks["step_end"][-1][0]
    last_start = starts[-1]
    fwd_end = counter.marks["forward_end"][-1][0]
    bwd_end = counter.marks["backward_end"][-1][0]
    saved: dict[str, int] = {}
    for lf in _activation_lives(counter, last_start, fwd_end):
        if lf.live_at(fwd_end):
            saved[kind_of(lf)] = saved.get(kind_of(lf), 0) + lf.nbytes
    state = live_by_kind(lives, end_t)
    return SimulationResult(
        strategy=spec_strategy, world_size=world_size, rank=rank, seq_len=seq_len,
        micro_batch_size=micro_batch_size, peak_bytes=counter.peak,
        peak_bytes_cuda_rounded=counter.peak_cuda,
        peak_phase=peak_life.phase if peak_life is not None else "idle", peak_step=peak_step,
        breakdown=dict(sorted(live_by_kind(lives, counter.peak_t).items())),
        model_state_bytes=sum(state.values()), model_state_breakdown=dict(sorted(state.items())),
        step_peaks=step_peaks(counter), saved_activation_bytes=saved,
        activation_peak_bytes=_sweep_peak(_activation_lives(counter, last_start, bwd_end)),
        allocator=allocator_peaks(lives, starts[0]), notes=list(notes))
