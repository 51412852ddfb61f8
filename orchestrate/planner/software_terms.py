"""What a library version keeps on the GPU: the memory model's version-dependent terms. Pure: the
versions come with the hardware profile (`HardwareProfile.software`, read from the installed
distributions' metadata when the profile is resolved, or pinned by a published measurement's case).
A version that is not known is taken to be a current release (what constraints-ci.txt pins).
"""

from __future__ import annotations

from orchestrate.hardware.software import SoftwareStack
from orchestrate.hardware.units import MiB


def _release(version: str | None) -> tuple[int, ...] | None:
    """(major, minor, patch) of "2.13.0+cu130", "0.19.2.dev0", "4.16.0.dev0"; None when unknown."""
    if not version:
        return None
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts) if parts else None


def older_than(version: str | None, release: tuple[int, ...]) -> bool:
    """Known and before `release` (an unknown version counts as current)."""
    known = _release(version)
    return known is not None and known < release


CUDA_CONTEXT_LAZY_BYTES = 500 * MiB
"""CUDA context with lazy module loading: torch >= 1.13 sets CUDA_MODULE_LOADING=LAZY before it
initialises CUDA unless the user set it (torch/cuda/__init__.py `_lazy_init`; CUDA C Programming Guide,
"Lazy Loading": kernels are loaded on first use, available since CUDA 11.7). A margin, not measured
here: no published figure for a lazily loaded torch context was found (README, Known gaps)."""

CUDA_CONTEXT_EAGER_BYTES = 1343 * MiB
"""CUDA context with every torch kernel loaded at initialisation (CUDA before 11.7, or torch before
1.13): 1,343 MiB measured by nvidia-smi after `torch.ones((1, 1)).to("cuda")` on a V100 with CUDA 11.2,
driver 460.91 (transformers docs, perf_train_gpu_one.mdx / model_memory_anatomy.md, January 2022)."""


def lazy_module_loading(sw: SoftwareStack) -> bool:
    return not (older_than(sw.torch, (1, 13)) or older_than(sw.cuda, (11, 7)))


def cuda_context_bytes(sw: SoftwareStack) -> int:
    return CUDA_CONTEXT_LAZY_BYTES if lazy_module_loading(sw) else CUDA_CONTEXT_EAGER_BYTES


def gradients_persist(sw: SoftwareStack) -> bool:
    """torch before 2.0 zeroed gradients in place (`zero_grad(set_to_none=False)` was the default; 2.0
    made set_to_none=True the default, torch 2.0 release notes): every .grad lives through the next
    forward, so the backward-start peak holds them as with gradient accumulation."""
    return older_than(sw.torch, (2, 0))


def bnb_saves_4bit_input(sw: SoftwareStack) -> bool:
    """bitsandbytes' MatMul4Bit.forward kept its input for backward (`ctx.tensors = (A, B)`) up to
    0.43.1 and keeps `(None, B)` from 0.43.2 on (bitsandbytes/autograd/_functions.py at the tags
    0.43.1 and 0.43.2): a 4-bit linear's input stays alive until its backward in older releases."""
    return older_than(sw.bitsandbytes, (0, 43, 2))


def logits_upcast_kept(sw: SoftwareStack) -> bool:
    """transformers before 4.46 up-cast the LM head's output in the model (`logits = logits.float()`,
    modeling_llama.py; removed by transformers PR #33902 for 4.46) and its loss took a contiguous fp32
    copy of the shifted logits (`shift_logits = logits[..., :-1, :].contiguous()`)."""
    return older_than(sw.transformers, (4, 46))


LOGITS_BYTES_PER_TOKEN_VOCAB_UPCAST_KEPT = 16
"""Bytes per (token x vocabulary entry) at the loss with `logits_upcast_kept`: the model's fp32 logits
(4), the loss's contiguous fp32 shifted copy (4), the fp32 log-softmax it saves (4) and that output's
fp32 gradient (4), where the current releases hold 12 (constants.LOGITS_BYTES_PER_TOKEN_VOCAB_16BIT: bf16
logits, one fp32 up-cast, fp32 log-softmax, bf16 gradient). Counted from the code, not measured."""

_SDPA_SINCE = {"llama": (4, 36), "mistral": (4, 36), "qwen2": (4, 36), "phi3": (4, 36), "gemma": (4, 36),
               "gpt2": (4, 36), "bert": (4, 41)}
"""The transformers release from which each family's default attention is torch's SDPA (a fused kernel
that keeps no s x s matrix): 4.36 made SDPA the default where a model supports it (release notes,
December 2023; Llama, Mistral among the first); BERT gained an SDPA class in 4.41 (BertSdpaSelfAttention).
Before, the eager attention materialised the scores."""


def eager_attention(sw: SoftwareStack, model_type: str) -> bool:
    since = _SDPA_SINCE.get(model_type)
    return since is not None and older_than(sw.transformers, since)
