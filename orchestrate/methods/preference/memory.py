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
