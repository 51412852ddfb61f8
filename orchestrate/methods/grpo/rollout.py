"""Sampling completions from the current policy: `generate` is the one function that does it (HF
`generate` today; a vLLM engine can replace it behind the same signature), and `completion_logps`
scores the completions under a model (the policy, the policy that sampled them, the reference).

Each prompt is repeated num_generations times, consecutively (a group stays on its rank and in its
micro-batch), left-padded, and sampled with temperature and top_p (top_k off) for at most
max_completion_length tokens, each completion ending at its first EOS / end-of-turn token (kept and
trained on, as TRL keeps it); what follows it is masked. Sampling runs on the module gather.py's
`gathered` yields (DDP's and DeepSpeed's inner module, weights whole under FSDP2 and ZeRO-3) under
no_grad, dropout off, so no gradient hook or collective fires while the ranks generate completions of
different lengths (TRL's `unwrap_model_for_generation`).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from orchestrate.methods.grpo.config import GrpoSection
from orchestrate.methods.preference.losses import IGNORE_INDEX, next_labels, target_logps
from orchestrate.methods.preference.objective import final_hidden_states, over_chunks
from orchestrate.methods.preference.reference import without_dropout


@dataclass
class Rollout:
    """A micro-batch's completions: rows are prompts × num_generations, groups consecutive."""

    input_ids: torch.Tensor
    """(rows, prompt + completion positions): left-padded prompt, then the completion."""
    attention_mask: torch.Tensor
    prompt_positions: int
    completion_mask: torch.Tensor
    """(rows, completion positions): 1 up to and including the first EOS."""
    truncated: torch.Tensor
    """(rows,) bool: no EOS within max_completion_length (TRL's completions/clipped_ratio)."""

    @property
    def completion_ids(self) -> torch.Tensor:
        return self.input_ids[:, self.prompt_positions:]

    @property
    def position_ids(self) -> torch.Tensor:
        return (self.attention_mask.cumsum(dim=1) - 1).clamp(min=0)


@contextmanager
def _sampling(model: torch.nn.Module):
    with without_dropout(model), torch.no_grad():
        yield


def generate(inner: torch.nn.Module, prompts: list[list[int]], settings: GrpoSection, eos_ids: list[int],
             pad_id: int) -> Rollout:
    """num_generations sampled completions of every prompt (module docstring); `inner`: the module to
    sample with (gather.py `gathered`)."""
    device = next(inner.parameters()).device
    rows = [p for p in prompts for _ in range(settings.num_generations)]
    width = max(len(p) for p in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, p in enumerate(rows):
        ids[r, width - len(p):] = torch.as_tensor(p)
        mask[r, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    with _sampling(inner):
        out = inner.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=settings.temperature,
                             top_p=settings.top_p, top_k=0, max_new_tokens=settings.max_completion_length,
                             eos_token_id=eos_ids, pad_token_id=pad_id)
    completion = out[:, width:]
    is_eos = torch.isin(completion, torch.as_tensor(eos_ids, device=device))
    ended = is_eos.any(dim=1)
    first = torch.where(ended, is_eos.int().argmax(dim=1), completion.shape[1])
    steps = torch.arange(completion.shape[1], device=device).unsqueeze(0)
    completion_mask = (steps <= first.unsqueeze(1)).long()
    completion = torch.where(completion_mask.bool(), completion, pad_id)
    return Rollout(torch.cat([ids, completion], dim=1), torch.cat([mask, completion_mask], dim=1), width,
                   completion_mask, ~ended)


def completion_logps(model: torch.nn.Module, rollout: Rollout, chunks: int = 0) -> torch.Tensor:
    """(rows, completion positions): log π(token | what precedes it) of every completion token under
    `model` (0 where masked), fp32; `chunks` > 0 (train.loss_chunks): the LM head one chunk of positions
    at a time, the full logits never held (worker/chunked_loss.py, through the preference objective)."""
    labels = torch.full_like(rollout.input_ids, IGNORE_INDEX)
    labels[:, rollout.prompt_positions:] = torch.where(rollout.completion_mask.bool(), rollout.completion_ids,
                                                      IGNORE_INDEX)
    targets = next_labels(labels)
    inputs = {"input_ids": rollout.input_ids, "attention_mask": rollout.attention_mask,
              "position_ids": rollout.position_ids}
    if not chunks:
        per_token = target_logps(model(**inputs, use_cache=False).logits, targets)
    else:
        with final_hidden_states(model, inputs) as (hidden, head):
            per_token = torch.cat(over_chunks(target_logps, hidden, head, targets, chunks), dim=1)
    return per_token[:, rollout.prompt_positions - 1: -1]
