"""Check on CPU (1 gloo rank) the optimizer / quantized-base combinations the planner never picks
(each backend's `knobs`, backends/registry.py runs_knob; docs/memory-knobs.md): each prints what happened, not what is believed.

    python -m bench.verify_knob_combos       # a few seconds: CI runs it whole (tests/unit/bench/test_bench_short_modes.py)

1. bitsandbytes AdamW8bit stepping FSDP2 (`fully_shard`) parameters, which are DTensors.
2. a bitsandbytes int8 base (`Linear8bitLt`) under `fully_shard`.
3. torchao's low-bit AdamW (`torchao.optim.AdamW8bit`) as DeepSpeed ZeRO-2's client optimizer: are
   its states still 8-bit after DeepSpeed wraps it?
"""

from __future__ import annotations

import os
import traceback


def _gloo() -> bool:
    """One gloo rank (DeepSpeed reads the rank variables too); whether this call started it."""
    import torch.distributed as dist

    from orchestrate.ports import free_port

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    if dist.is_initialized():
        return False
    dist.init_process_group("gloo", rank=0, world_size=1)
    return True


def _step(model, optimizer) -> None:
    import torch

    model(torch.randn(4, 256)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def bnb_adamw8bit_under_fsdp2() -> str:
    import bitsandbytes as bnb
    import torch
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    fully_shard(model)
    optimizer = bnb.optim.AdamW8bit(model.parameters(), lr=1e-3)
    _step(model, optimizer)
    state = optimizer.state[next(model.parameters())]
    return "stepped; state " + ", ".join(f"{k}: {v.dtype} {type(v).__name__}" for k, v in state.items()
                                         if isinstance(v, torch.Tensor))


def bnb_int8_base_under_fsdp2() -> str:
    import bitsandbytes as bnb
    import torch
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Sequential(bnb.nn.Linear8bitLt(256, 256, has_fp16_weights=False), torch.nn.Linear(256, 256))
    model[0].weight.requires_grad_(False)
    model[0].to("cpu")  # Int8Params quantize when moved to a device
    fully_shard(model)
    out = model(torch.randn(4, 256))
    out.pow(2).mean().backward()
    return f"forward/backward ran; int8 weight is now {type(model[0].weight).__name__} {model[0].weight.dtype}"


def _torchao_under_zero(stage: int) -> str:
    import deepspeed
    import torch
    from torchao.optim import AdamW8bit

    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage},
              "zero_allow_untested_optimizer": True}
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=AdamW8bit(model.parameters(), lr=1e-3),
                                                   config=config)
    loss = engine(torch.randn(4, 256)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    inner = optimizer.optimizer  # DeepSpeed's ZeRO wrapper around the client optimizer
    states = [v for st in inner.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.numel() > 1]
    # a low-bit state is a tensor subclass reporting the apparent dtype; its storage is `codes`
    kinds = sorted({f"{type(v).__name__} (apparent {v.dtype}, stored {getattr(v, 'codes', v).dtype})"
                    for v in states})
    stored = sum(getattr(v, "codes", v).nbytes for v in states)
    params = sum(p.numel() for p in model.parameters())
    return f"stepped; {len(states)} state tensors: {', '.join(kinds)}; {stored / params:.2f} B/param stored"


def torchao_low_bit_under_zero2() -> str:
    return _torchao_under_zero(2)


def torchao_low_bit_under_zero3() -> str:
    return _torchao_under_zero(3)


CHECKS = (bnb_adamw8bit_under_fsdp2, bnb_int8_base_under_fsdp2, torchao_low_bit_under_zero2, torchao_low_bit_under_zero3)


def main() -> None:
    started = _gloo()
    try:
        for check in CHECKS:
            try:
                result = check()
            except Exception as exc:  # what each combination does is the result being recorded
                result = f"FAILED: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
                if os.environ.get("VERBOSE"):
                    traceback.print_exc()
            print(f"{check.__name__}: {result}", flush=True)
    finally:
        if started:  # leave the process (a test's) without a process group, as it came
            import torch.distributed as dist

            dist.destroy_process_group()


if __name__ == "__main__":
    main()
