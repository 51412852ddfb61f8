"""What a preference method adds to a step's memory and time (docs/preference.md). Pure.

- Two sequences per record (samples.py): the trained model's activations and logits are those of
  2 x micro_batch_size sequences of seq_len; its answer log-probabilities cost what the task's
  cross-entropy costs (losses.token_logps computes them the same way: measured equal with the storage
  counter, tests/test_preference_memory.py), so the planner's logits term covers them.
- The reference forward (adapter, replicated, sharded, offload) runs before the model's, under
  no_grad: its logits and their log-softmax, REFERENCE_FORWARD_BYTES_PER_TOKEN_VOCAB beyond the
  logits, are freed before the model's forward holds any activation, so at the training peak only
  its weights remain (measured: a step's peak with a live reference is the peak with a precomputed
  one, tests/test_preference_memory.py). Its time is a forward of the same tokens.
- precomputed: a first pass before training holds the reference alone and one micro-batch's logits
  and temporaries; training reads 2 fp32 log-probabilities per record.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from orchestrate.hardware.profile import HardwareProfile
from orchestrate.methods.distill.memory import Teacher, add_teacher_memory, auto_placements, first_pass_bytes
from orchestrate.model.shape import ModelShape
from orchestrate.planner.strategy import Strategy

SEQUENCES_PER_RECORD = 2
"""A pair's chosen and rejected sequence; an unpaired answer and its mismatched one (KTO's KL term)."""
REFERENCE_FORWARD_BYTES_PER_TOKEN_VOCAB = 8
"""A no_grad forward's log-probabilities beyond its logits (the compute dtype's bytes): the fp32
log-softmax of cross-entropy plus its fp32 up-cast (bf16) or its output (fp32). Measured with the
storage counter: 8.0 for fp32 and bf16 logits (tests/test_preference_memory.py)."""
CACHED_BYTES_PER_RECORD = SEQUENCES_PER_RECORD * 4
"""precomputed: the two fp32 reference log-probabilities a micro-batch reads per record."""


def reference_forward_bytes(tokens: int, vocab: int, compute_bytes: int) -> float:
    """The reference's outputs while its forward runs over `tokens` (logits and log-probabilities)."""
    return tokens * vocab * (compute_bytes + REFERENCE_FORWARD_BYTES_PER_TOKEN_VOCAB)


@dataclass(frozen=True)
class Reference:
    """The reference model as the planner sees it (config.py `placement`)."""

    shape: ModelShape
    placement: str
    """The configured placement ("auto" included: `placements` tries them) or the one a candidate took."""


@dataclass(frozen=True)
class PreferenceTerms:
    """What a `preference:` section changes in a candidate's memory and speed."""

    reference: Reference | None
    """None: a loss without a reference (orpo)."""
    packed: bool
    """data.packing: whole records in blocks of 2 x seq_len (samples.py), else 2 padded rows per record."""

    def rows(self, strategy: Strategy, seq_len: int) -> tuple[Strategy, int]:
        """(strategy, seq_len) whose micro-batch the trained model's forward sees: 2 x micro_batch_size
        rows of seq_len, or micro_batch_size packed blocks of 2 x seq_len (their attention, eager or the
        block mask, is quadratic in the block)."""
        if self.packed:
            return strategy, SEQUENCES_PER_RECORD * seq_len
        return replace(strategy, micro_batch_size=SEQUENCES_PER_RECORD * strategy.micro_batch_size), seq_len

    def with_placement(self, placement: str) -> PreferenceTerms:
        return replace(self, reference=replace(self.reference, placement=placement))


def placements(terms: PreferenceTerms, adapters: bool, hw: HardwareProfile) -> list[str]:
    """What the search tries for the reference, in order; `auto`: the first that fits wins. adapter
    first (LoRA / QLoRA: no weights at all, one forward of the base), then the live copies cheapest per
    step first (replicated; sharded: gathers; offload: gathers over PCIe), precomputed last (a first pass
    over the data before step 1, and it cannot follow a reference that changes: none here)."""
    if terms.reference is None:
        return []
    if terms.reference.placement != "auto":
        return [terms.reference.placement]
    return ["adapter"] if adapters else auto_placements(hw)


def add_reference_memory(gpu: dict, cpu: dict, terms: PreferenceTerms, strategy: Strategy, hw: HardwareProfile,
                         seq_len: int, c: int) -> None:
    """Adds the reference's terms to a candidate's per-rank device and per-node host dicts, after the
    trained model's activations and logits are in `gpu`: reference_weights, reference_gathered (a sharded
    or offloaded copy's gathered root and blocks), reference_forward (its forward's logits and
    log-probabilities beyond the training step's activations and logits, which do not exist yet while
    it runs: module doc), reference_cache (precomputed: the micro-batch's cached log-probabilities) and
    offloaded_reference on the host. The precomputed first pass is `reference_first_pass_bytes`."""
    reference = terms.reference
    if reference is None:
        return
    rows, rows_seq = terms.rows(strategy, seq_len)
    tokens = rows.micro_batch_size * rows_seq
    weights = gathered = offloaded = forward = cache = 0.0
    if reference.placement == "precomputed":
        cache = CACHED_BYTES_PER_RECORD * tokens / 2  # at most a record per two tokens (packed: short records)
    else:
        forward = max(0.0, reference_forward_bytes(tokens, reference.shape.vocab_size, c)
                      - gpu["activations"] - gpu["logits"])
        if reference.placement != "adapter":
            state = Teacher(reference.shape, _live(reference.placement, hw), top_k=0)
            scratch_gpu, scratch_cpu = {}, {}
            add_teacher_memory(scratch_gpu, scratch_cpu, state, strategy, hw, seq_len, c)
            weights, gathered = scratch_gpu["teacher_weights"], scratch_gpu["teacher_gathered"]
            offloaded = scratch_cpu["offloaded_teacher"]
    gpu.update(reference_weights=weights, reference_gathered=gathered, reference_forward=forward, reference_cache=cache)
    cpu["offloaded_reference"] = offloaded


def reference_first_pass_bytes(terms: PreferenceTerms, strategy: Strategy, hw: HardwareProfile, seq_len: int,
                               c: int) -> float:
    """precomputed: device bytes of the first pass (cache.py), which runs before the trained model is
    built: the reference held as lean as the ranks allow (stages.py: offloaded on GPUs, sharded over CPU
    ranks: distillation's first pass, methods/distill/memory.py) and one padded micro-batch's forward
    (2 x micro_batch_size rows of seq_len). 0 for the other placements."""
    reference = terms.reference
    if reference is None or reference.placement != "precomputed":
        return 0.0
    state = Teacher(reference.shape, "precomputed", top_k=0)
    held = first_pass_bytes(state, strategy, hw, seq_len, c) - strategy.micro_batch_size * seq_len * \
        reference.shape.vocab_size * (c + 4)  # distillation's own outputs, replaced by ours
    tokens = SEQUENCES_PER_RECORD * strategy.micro_batch_size * seq_len
    return held + reference_forward_bytes(tokens, reference.shape.vocab_size, c)


def reference_speed_stand_in(terms: PreferenceTerms, hw: HardwareProfile) -> Teacher | None:
    """The reference's per-step forward, gathers and copies priced as a distillation teacher's at the
    same placement (methods/distill/memory.py `teacher_seconds`): adapter is a forward of the base with no
    copy to gather (replicated's price); precomputed costs nothing per step."""
    reference = terms.reference
    if reference is None:
        return None
    placement = "replicated" if reference.placement == "adapter" else _live(reference.placement, hw)
    return Teacher(reference.shape, placement, top_k=0)


def _live(placement: str, hw: HardwareProfile) -> str:
    """A worker builds offload on a CPU device and sharded over one rank as replicated (stages.py)."""
    if (placement == "offload" and not hw.has_gpu) or (placement == "sharded" and hw.world_size == 1):
        return "replicated"
    return placement


def preference_terms(config, reference_shape: ModelShape) -> PreferenceTerms | None:
    """The terms of `config`'s preference section (None without one); `reference_shape`: the reference
    model's (the model's own when preference.reference is null)."""
    from orchestrate.methods.preference.config import REFERENCE_FREE

    section = config.preference
    if section is None:
        return None
    reference = None if section.loss in REFERENCE_FREE else Reference(reference_shape, section.placement)
    return PreferenceTerms(reference, packed=config.data.packing)
