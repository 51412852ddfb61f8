"""What a library version keeps on the GPU: the memory model's version-dependent terms. Pure: the
versions come with the hardware profile (`HardwareProfile.software`, read from the installed
distributions' metadata when the profile is resolved, or pinned by a published measurement's case).
A version that is not known is taken to be a current release (what constraints-ci.txt pins).
"""

from __future__ import annotations

from functools import lru_cache

from orchestrate.hardware.software import SoftwareStack
from orchestrate.hardware.units import MiB


@lru_cache(maxsize=64)  # the planner asks per candidate, thousands of times a plan, for a few versions
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


CUDA_CONTEXT_LAZY_BYTES = 950 * MiB
"""What a training process holds on its GPU outside the caching allocator with lazy module loading
(torch >= 1.13 sets CUDA_MODULE_LOADING=LAZY before it initialises CUDA unless the user set it:
torch/cuda/__init__.py `_lazy_init`; CUDA C Programming Guide, "Lazy Loading"): the CUDA context, the
kernels a step loads, cuBLAS handles, and a one-rank NCCL communicator (the worker forms a process group
on one GPU too): the largest seen on an H200 at the end of a training run, rounded up
(docs/measurements.md#plannersoftware_termspy). A card with fewer multiprocessors reserves less (CUDA
sizes the context's local memory per multiprocessor): over-predicted there."""

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


def logits_bytes_per_token_vocab(sw: SoftwareStack) -> int | None:
    """Bytes per (token x vocabulary entry) at the LM loss of a 16-bit run, by transformers release; None:
    the current releases' measured constant (constants.LOGITS_BYTES_PER_TOKEN_VOCAB_16BIT, 12).
    - before 4.46: the model up-casts its output (`logits = logits.float()`, modeling_llama.py) and the
      loss takes a contiguous fp32 copy of the shifted logits: 16, the fp32 logits (4) held by a caller
      that keeps the output through backward (Answer.AI's train.py does) beside the fp32 log-softmax (4)
      and its two fp32 gradients (4 + 4) at the start of backward;
    - 4.46 to 4.48: the model returns 16-bit logits and `ForCausalLMLoss` (loss/loss_utils.py) up-casts
      them and still slices a contiguous fp32 copy (`logits[..., :-1, :].contiguous()`): 14 at the end
      of forward, the 16-bit logits (2), their fp32 up-cast (4), the shifted copy (4) and the
      log-softmax (4);
    - from 4.49 the loss pads the labels instead (`nn.functional.pad(labels, (0, 1))`): no copy.
    Read in the wheels of 4.45.2, 4.46.0, 4.48.1 and 4.49.0; counted from the code, the 14 checked
    against fms-acceleration's A100 rows (docs/measurements.md#plannersoftware_termspy)."""
    if older_than(sw.transformers, (4, 46)):
        return 16
    if older_than(sw.transformers, (4, 49)):
        return 14
    return None


_SDPA_SINCE = {"llama": (4, 36), "mistral": (4, 37), "qwen2": (4, 37), "gemma": (4, 38), "bert": (4, 41),
               "gpt2": (4, 42), "phi3": (4, 45)}
"""The transformers release from which each family's model class sets `_supports_sdpa = True`, so
`_autoset_attn_implementation` picks torch's SDPA (a fused kernel that keeps no s x s matrix) unless
told otherwise; read in the wheels of 4.35.2 to 4.45.2 (Qwen2 and Gemma arrived with it; Phi-3 had an
SDPA class from 4.41 but `_supports_sdpa = False` until 4.45). Before, the eager attention
materialised the scores."""

SDPA_NEEDS_TORCH = (2, 1, 1)
"""transformers uses SDPA only on torch >= 2.1.1 (utils/import_utils.py `is_torch_sdpa_available`)."""

_EAGER_SOFTMAX_FP32 = frozenset({"llama", "mistral", "qwen2", "gemma", "phi3"})
"""Eager attentions that call `softmax(..., dtype=torch.float32)` and cast the probabilities back
(modeling_llama.py LlamaAttention and its copies); GPT-2's and BERT's softmax runs in the scores'
dtype (fp32 only under autocast, which runs softmax in fp32)."""

_EAGER_ATTENTION_DROPOUT = frozenset({"bert", "gpt2"})
"""Families whose attention dropout defaults to 0.1 (BERT attention_probs_dropout_prob, GPT-2
attn_pdrop); the Llama-style ones default attention_dropout to 0.0, which keeps no mask."""


def eager_attention(sw: SoftwareStack, model_type: str) -> bool:
    since = _SDPA_SINCE.get(model_type)
    return since is not None and (older_than(sw.transformers, since) or older_than(sw.torch, SDPA_NEEDS_TORCH))


def eager_softmax_bytes(model_type: str, c: int, autocast: bool) -> int:
    """Bytes per element of the softmax output the eager attention saves."""
    return 4 if model_type in _EAGER_SOFTMAX_FP32 or autocast else c


def eager_attention_dropout(model_type: str) -> bool:
    return model_type in _EAGER_ATTENTION_DROPOUT
