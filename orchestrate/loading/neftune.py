"""NEFTune (`train.neftune_noise_alpha`; Jain et al. 2023, "NEFTune: Noisy Embeddings Improve
Instruction Finetuning"): uniform noise on the input embeddings of training forwards.

As transformers' `neftune_post_forward_hook` (integrations/neftune.py, which the Trainer and TRL's
SFTTrainer register on `get_input_embeddings()`): in training mode only, the embedding output plus
noise drawn uniformly from [-m, m] with m = alpha / sqrt(L x d), d the hidden size. transformers takes
L from the tensor (`output.size(1)`); here L is `train.seq_len`, which is that size for the batches
the data pipeline builds (packed blocks and padded rows are seq_len long), and stays so where the
tensor is longer or shorter than a sample row: a packed micro-batch flattened into one row for
flash-attention's varlen path, a rank's slice of the sequence under sequence parallelism. So the
noise per position is that of a seq_len row whatever path the plan takes, padding positions included
(as in transformers; the loss never reads them).

The noise comes from the device's default generator, which every rank seeds from `train.seed` and
its rank (worker/stages.py) and each checkpoint saves and restores (worker/checkpointing.py
`rng_state`): a resumed run draws the noise the uninterrupted one would. Evaluation and generation
put the model in eval mode (the engines' `eval_sums`, worker/callbacks/generate.py): no noise. It
adds one temporary of the embedding output's size per forward, not in the memory plan (a sliver of
one block's activations).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle


def noise_bound(alpha: float, seq_len: int, hidden_size: int) -> float:
    """m of the module docstring: the noise is uniform in [-m, m]."""
    return alpha / math.sqrt(seq_len * hidden_size)


def input_embeddings(model: nn.Module) -> nn.Module:
    """The input embedding of the Hugging Face model inside `model`: DDP, DeepSpeed and the single-rank
    wrapper keep it in `.module` (a PeftModel answers `get_input_embeddings` itself)."""
    while not hasattr(model, "get_input_embeddings") and hasattr(model, "module"):
        model = model.module
    return model.get_input_embeddings()


def add_neftune(model: nn.Module, alpha: float, seq_len: int) -> RemovableHandle:
    """Noise the input embeddings of `model`'s training forwards (module docstring); the hook's handle.
    Registered after the engine is built, so it runs after the hooks a host-kept embedding routes its
    rows to the device with (loading/host_embedding.py): the noise is drawn where the blocks run."""

    def noised(module: nn.Module, _args: tuple, output: torch.Tensor) -> torch.Tensor:
        if not module.training:
            return output
        bound = noise_bound(alpha, seq_len, output.size(-1))
        return output + uniform_noise_like(output, bound)

    return input_embeddings(model).register_forward_hook(noised)


def uniform_noise_like(tensor: torch.Tensor, bound: float) -> torch.Tensor:
    """Uniform noise in [-bound, bound] of `tensor`'s shape, dtype and device (transformers'
    `torch.zeros_like(output).uniform_(-mag_norm, mag_norm)`: the device's default generator)."""
    return torch.zeros_like(tensor).uniform_(-bound, bound)
