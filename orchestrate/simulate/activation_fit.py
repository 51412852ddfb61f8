"""Activation constants for the analytical model, measured by simulating 1- and 2-layer versions of
a model (same widths, vocabulary, sequence, micro-batch and strategy).

Saved activations grow linearly with depth, so two depths give the per-layer bytes and the fixed
part. Coefficients are normalised the way `orchestrate/planner/constants.py` states them: per layer
per (tokens x hidden), and the non-layer part of the activation peak (LM head output, loss
temporaries and their gradients, embeddings) per (tokens x vocab).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from orchestrate.planner.plan import RunPlan
from orchestrate.planner.strategy import Strategy
from orchestrate.simulate.in_subprocess import make_spec, simulate_all


@dataclass(frozen=True)
class Calibration:
    model_type: str
    strategy: str
    seq_len: int
    micro_batch_size: int
    hidden_size: int
    vocab_size: int
    saved_bytes: dict[int, int]
    """Layers -> bytes autograd keeps from the forward (activations + logits), at its end."""
    activation_peak_bytes: dict[int, int]
    """Layers -> peak of those storages, the loss/LM-head backward included."""
    per_layer_bytes: int
    """Saved activation bytes one more layer adds."""
    per_layer_coefficient: float
    """per_layer_bytes / (seq_len x micro_batch x hidden): compare planner/activations.py layer_bytes_per_token / h
    (or the AC constant when the strategy checkpoints)."""
    fixed_peak_bytes: int
    """Activation peak minus the layers' share: LM head, cross-entropy and embedding part."""
    logits_coefficient: float
    """fixed_peak_bytes / (seq_len x micro_batch x vocab): compare LOGITS_BYTES_PER_TOKEN_VOCAB_*."""

    def predict_activation_peak(self, num_layers: int) -> int:
        return self.fixed_peak_bytes + num_layers * self.per_layer_bytes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def calibrate(target: RunPlan | Any, strategy: Strategy | None = None, seq_len: int | None = None,
              world_size: int | None = None, *, hardware: Any = None, layers: tuple[int, int] = (1, 2),
              parallel: int = 2) -> Calibration:
    """Simulate `layers` depths of the model `target` describes (see `simulate` for targets)."""
    spec = make_spec(target, strategy, seq_len, world_size, hardware=hardware)
    specs = [spec.with_layers(n) for n in layers]
    results = simulate_all(specs, parallel)
    saved = {n: sum(r.saved_activation_bytes.values()) for n, r in zip(layers, results, strict=True)}
    peaks = {n: r.activation_peak_bytes for n, r in zip(layers, results, strict=True)}
    lo, hi = layers
    per_layer = (saved[hi] - saved[lo]) // (hi - lo)
    fixed = peaks[lo] - lo * per_layer
    mb, s = spec.strategy["micro_batch_size"], spec.seq_len
    from orchestrate.simulate.patches import hf_config_for_simulation

    cfg = hf_config_for_simulation(spec.model_config)
    return Calibration(
        model_type=cfg.model_type, strategy=spec.strategy_obj.name, seq_len=s, micro_batch_size=mb,
        hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, saved_bytes=saved, activation_peak_bytes=peaks,
        per_layer_bytes=per_layer, per_layer_coefficient=per_layer / (s * mb * cfg.hidden_size),
        fixed_peak_bytes=fixed, logits_coefficient=fixed / (s * mb * cfg.vocab_size))
