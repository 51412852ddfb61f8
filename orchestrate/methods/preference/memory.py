"""What a preference method adds to a step's memory (docs/preference.md). Pure. Where the reference
lives (its weights, gathered blocks, first pass, forward seconds) is an auxiliary model's placement,
priced in orchestrate/planner/auxiliary.py; what is the preference method's own is here:

- Two sequences per record (samples.py): the trained model's forward sees 2 x micro_batch_size
  sequences of seq_len, padded, or the micro_batch_size records packed into at most micro_batch_size
  rows of 2 x seq_len, priced at that worst case (`MethodTerms.sample_rows`, method.py); its answer
  log-probabilities cost what the task's cross-entropy costs (losses.token_logps computes them the
  same way; the storage counter sees them equal), so the planner's logits term covers them.
- The reference forward (adapter, replicated, sharded, offload) runs before the model's, under
  no_grad: its logits and their log-softmax, REFERENCE_FORWARD_BYTES_PER_TOKEN_VOCAB beyond the
  logits, are freed before the model's forward holds any activation, so it adds only what exceeds the
  training step's activations and logits (`chunked_reference_forward_bytes`, the excess the memory
  model's: a step's peak with a live reference is the peak with a precomputed one). Chunked
  (train.loss_chunks): one chunk's logits and log-probabilities at a time, plus the final hidden
  states the chunks read (b x s x h in the compute dtype; the unchunked forward frees them early,
  left out there as h / V of the logits).
- precomputed: a first pass before training holds the reference alone and one padded micro-batch's
  logits and temporaries; training reads 2 fp32 log-probabilities per record.
"""

from __future__ import annotations

import math

from orchestrate.methods.preference.config import SEQUENCES_PER_RECORD
from orchestrate.model.shape import ModelShape
from orchestrate.planner.auxiliary import AuxiliaryModel

REFERENCE = "reference"
REFERENCE_FORWARD_BYTES_PER_TOKEN_VOCAB = 8
"""A no_grad forward's log-probabilities beyond its logits (the compute dtype's bytes): the fp32
log-softmax of cross-entropy plus its fp32 up-cast (bf16) or its output (fp32), as the storage counter
counts them on fp32 and bf16 logits (docs/measurements.md#methodspreferencememorypy)."""
CACHED_BYTES_PER_RECORD = SEQUENCES_PER_RECORD * 4
"""precomputed: the two fp32 reference log-probabilities a micro-batch reads per record."""


def reference_forward_bytes(tokens: int, vocab: int, compute_bytes: int) -> float:
    """The reference's outputs while its forward runs over `tokens` (logits and log-probabilities)."""
    return tokens * vocab * (compute_bytes + REFERENCE_FORWARD_BYTES_PER_TOKEN_VOCAB)


def chunked_reference_forward_bytes(shape: ModelShape, rows: int, seq_len: int, chunks: int,
                                    compute_bytes: int) -> float:
    """The reference's outputs while its forward runs over `rows` of `seq_len`, its log-probabilities
    in `chunks` chunks of positions (0: whole): one chunk's, plus the hidden states when chunked."""
    if not chunks:
        return reference_forward_bytes(rows * seq_len, shape.vocab_size, compute_bytes)
    chunk = reference_forward_bytes(rows * math.ceil(seq_len / chunks), shape.vocab_size, compute_bytes)
    return chunk + rows * seq_len * shape.hidden_size * compute_bytes


def reference_model(shape: ModelShape, placement: str, adapter: bool) -> AuxiliaryModel:
    """The reference as an auxiliary model; `adapter`: the run trains LoRA adapters, so the reference
    can be their base with the adapters disabled (auto takes it: no weights at all)."""
    vocab = shape.vocab_size

    def output_bytes(placement: str, tokens: int, c: int) -> float:
        # precomputed: priced per position, a bound on the micro_batch_size records a micro-batch reads
        # packed or padded (samples.py); live: its forward is the method's own term (method.py)
        return CACHED_BYTES_PER_RECORD * tokens if placement == "precomputed" else 0.0

    def first_pass_output_bytes(tokens: int, c: int) -> float:
        return reference_forward_bytes(SEQUENCES_PER_RECORD * tokens, vocab, c)  # both padded rows of a record

    return AuxiliaryModel(REFERENCE, shape, placement, output_bytes, first_pass_output_bytes, adapter=adapter)
