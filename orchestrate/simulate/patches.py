"""Patches the simulation harness (`orchestrate.simulate.harness`) runs under, each keeping the
memory behaviour of a real CUDA run.

CUDA-like choices on CPU (why: docs/measurements.md#simulatepatchespy):
- attention dropout is set to 0: CPU SDPA with dropout falls back to the math kernel, which keeps
  the b*a*s^2 attention matrix; CUDA's flash / memory-efficient kernels regenerate the mask instead;
- other dropouts go through `torch.native_dropout`, which keeps a 1-byte bool mask as CUDA does;
  CPU `F.dropout` keeps the mask in the input's dtype (aten/src/ATen/native/Dropout.cpp).

Fake tensors: what the model code, DDP and DeepSpeed need to run on them (`fake_tensor_patches`);
FSDP2's collective buffers are attributed to a "comm" phase (`fsdp_comm_phase`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from orchestrate.simulate.counter import LiveStorageCounter
from orchestrate.simulate.run_spec import RunSpec

_ATTENTION_DROPOUT_KEYS = ("attn_pdrop", "attention_dropout", "attention_probs_dropout_prob")


def hf_config_for_simulation(model_config: dict[str, Any]):
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(**model_config)
    for key in _ATTENTION_DROPOUT_KEYS:
        if getattr(cfg, key, None):
            setattr(cfg, key, 0.0)
    cfg.use_cache = False
    return cfg


@contextlib.contextmanager
def cuda_like_dropout() -> Iterator[None]:
    orig = torch.nn.functional.dropout

    def dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
        if not training or p == 0.0:
            return orig(input, p, training, inplace)
        out = torch.native_dropout(input, p, True)[0]
        return input.copy_(out) if inplace else out

    torch.nn.functional.dropout = dropout
    try:
        yield
    finally:
        torch.nn.functional.dropout = orig


@contextlib.contextmanager
def fake_tensor_patches(spec: RunSpec) -> Iterator[None]:
    """What the model code needs to behave on fake tensors as it does on real ones.

    transformers treats a fake tensor as graph tracing (`is_tracing`) and then materialises the
    b*s*s causal mask instead of asking SDPA for `is_causal` (transformers/masking_utils.py,
    `find_packed_sequence_indices`); eager real runs skip it. The data-dependent check it makes
    instead is answered by the counter like real unpadded data answers it.
    """
    import transformers.masking_utils as masking
    from torch._subclasses.fake_tensor import FakeTensor
    from transformers.utils.import_utils import is_torch_fx_proxy

    orig = masking.is_tracing

    def is_tracing(tensor: Any = None) -> bool:
        return orig() or (tensor is not None and is_torch_fx_proxy(tensor))

    masking.is_tracing = is_tracing
    # torch picks its foreach kernels (clip_grad_norm_, optimizers) only for exact torch.Tensor
    # types (torch/utils/_foreach_utils.py); fake tensors take the same path as the real ones.
    foreach_types = torch.utils._foreach_utils._foreach_supported_types
    foreach_types.append(FakeTensor)
    backend = {"deepspeed": _deepspeed_fake_patches, "ddp": _ddp_fake_patches}.get(spec.strategy["backend"])
    swap = spec.adapters is not None and spec.strategy["backend"] != "deepspeed"  # (DeepSpeed's has it)
    decoding = _decoding_to_max_length() if spec.phases else contextlib.nullcontext()
    try:
        with backend() if backend else contextlib.nullcontext(), _swap_as_set_data() if swap else contextlib.nullcontext(), \
                decoding:
            yield
    finally:
        masking.is_tracing = orig
        foreach_types.remove(FakeTensor)


@contextlib.contextmanager
def _decoding_to_max_length() -> Iterator[None]:
    """HF generate stops when `unfinished_sequences.max() == 0`, a value fake tensors do not have (the
    counter answers "not yet"), so it would decode forever. Its deferred stop check is the one that
    knows the stopping criteria's max_length (transformers/generation/utils.py `DeferredStopCheck`, built
    by `_sample` where `is_supported`): in its place, one that stops there and nowhere else, the worst case
    a plan prices (no sequence ends early)."""
    import transformers.generation.utils as generation

    class RunToMaxLength(generation.StopCheck):
        def __init__(self, input_ids: torch.Tensor, max_length: int, cache: Any, cache_is_returned: bool,
                     streamer: Any = None) -> None:
            super().__init__(streamer)
            self.max_length = max_length

        @staticmethod
        def is_supported(*_args: Any, **_kwargs: Any) -> bool:
            return True

        def __call__(self, unfinished_sequences: torch.Tensor, tokens: torch.Tensor, length: int) -> bool:
            return length >= self.max_length

    orig = generation.DeferredStopCheck
    generation.DeferredStopCheck = RunToMaxLength
    try:
        yield
    finally:
        generation.DeferredStopCheck = orig


@contextlib.contextmanager
def _ddp_fake_patches() -> Iterator[None]:
    """DDP's constructor checks parameter shapes across ranks and broadcasts rank 0's weights, both
    in C++ reading tensor data (torch/nn/parallel/distributed.py, `__init__`): fake tensors have
    none, and a fake process group moves none. Both happen before training, at no training cost."""
    import torch.nn.parallel.distributed as ddp

    orig = ddp._verify_param_shape_across_processes, ddp._sync_module_states
    ddp._verify_param_shape_across_processes = lambda *a, **k: None
    ddp._sync_module_states = lambda *a, **k: None
    try:
        yield
    finally:
        ddp._verify_param_shape_across_processes, ddp._sync_module_states = orig


@contextlib.contextmanager
def _swap_as_set_data() -> Iterator[None]:
    """`nn.Module._apply` (DeepSpeed's moves, the LoRA transform's cast of the base to the compute
    dtype) swaps fake parameters with `torch.utils.swap_tensors`, which refuses tensors that
    FakeTensorMode's converter holds weakrefs to; `.data =` is the pre-swap behaviour and frees the
    old storage the same way."""
    orig_swap = torch.utils.swap_tensors

    def swap(t1: torch.Tensor, t2: torch.Tensor) -> None:
        try:
            orig_swap(t1, t2)
        except RuntimeError as exc:
            if "weakref" not in str(exc):
                raise
            t1.data = t2

    torch.utils.swap_tensors = swap
    try:
        yield
    finally:
        torch.utils.swap_tensors = orig_swap


@contextlib.contextmanager
def _deepspeed_fake_patches() -> Iterator[None]:
    """ZeRO-3's parameter coordinator checks that every rank traced the same module order by
    broadcasting it: a fake process group carries no data, so the check reads zeros."""
    import deepspeed.runtime.zero.partitioned_param_coordinator as coordinator

    orig_check = coordinator.assert_ints_same_as_other_ranks
    coordinator.assert_ints_same_as_other_ranks = lambda ints: None
    try:
        with _swap_as_set_data():
            yield
    finally:
        coordinator.assert_ints_same_as_other_ranks = orig_check


@contextlib.contextmanager
def fsdp_comm_phase(counter: LiveStorageCounter) -> Iterator[None]:
    """Storages FSDP2 allocates inside its collectives (all-gather and reduce-scatter buffers) are
    born in a "comm" phase, so they are not taken for activations or logits: the root's re-gather
    at the start of backward lands right at the activation peak. The unsharded parameters they fill
    are tagged through their resize (gathered_params). Wraps the names as
    torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py imports them."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group

    names = ("foreach_all_gather", "foreach_all_gather_copy_out", "foreach_reduce")
    originals = {name: getattr(group, name) for name in names}

    def in_comm_phase(fn):
        def wrapper(*args, **kwargs):
            before, counter.phase = counter.phase, "comm"
            try:
                return fn(*args, **kwargs)
            finally:
                counter.phase = before
        return wrapper

    for name, fn in originals.items():
        setattr(group, name, in_comm_phase(fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(group, name, fn)
