"""QLoRA's memory terms checked piece by piece, since the fake-tensor simulation cannot run a 4-bit base.

    .venv/bin/python bench/qlora_pieces.py            # llama, qwen2, mistral (bench/memory_accuracy.py widths)
    .venv/bin/python bench/qlora_pieces.py --short    # llama under DDP only (CI)

bitsandbytes' `Params4bit` is a tensor subclass made from the raw weight; under FakeTensorMode the
weight already is a `FakeTensor`, and torch refuses to re-type it ("Creating a new Tensor subclass
Params4bit but the raw Tensor object is already associated to a python object of type FakeTensor"),
and the quantization kernels read real data anyway. So:
(a) weights: the NF4 bytes of the real quantized model (real CPU tensors, the backends' LoRA transform:
    packed 4-bit codes + quant_state absmax, nested absmax, code books, offset) vs the planner's
    quantized-weights term (adapters.quantized x 4.127 bits);
(b) the rest: a LoRA simulation of the same point (16-bit base, bench/memory_accuracy.py --lora, cached)
    with its bf16 block-linear weights swapped for the NF4 bytes measured in (a) and bitsandbytes'
    dequantized copy of the largest linear added (an analytical term on both sides: not simulated),
    vs the planner's QLoRA estimate. DDP and ZeRO-2 only: there the base is replicated, so the swap is
    exact; under FSDP2 / ZeRO-3 the gathered blocks change too, which a LoRA run does not show.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.memory_accuracy import CACHE, FAMILIES, LORA, Cache, MiB, Point, compare, strategy  # noqa: E402
from orchestrate.methods.lora.adapters import adapters_for  # noqa: E402
from orchestrate.methods.lora.method import adapter_terms  # noqa: E402
from orchestrate.planner.memory import estimate_memory  # noqa: E402
from orchestrate.simulate.run_spec import plan_from_parts  # noqa: E402

QLORA = {**LORA, "method": "qlora"}
C = 2  # bf16 compute dtype


def nf4_bytes(family: str) -> tuple[int, int]:
    """(bytes of every Linear4bit's weight and quant state, planner's term) for a real quantized model."""
    import bitsandbytes as bnb
    import torch
    from transformers import AutoModelForCausalLM

    from orchestrate.methods.registry import apply_transforms
    from orchestrate.simulate.patches import hf_config_for_simulation

    plan = plan_from_parts(FAMILIES[family], strategy("ddp", 0, 1, False), 512, 2, adapters=QLORA)
    adapters = adapters_for(plan.config, plan.shape)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config_for_simulation(plan.config.model.architecture),
                                             dtype=torch.float32)
    model = apply_transforms(model, plan)
    seen: dict[int, int] = {}

    def add(t) -> None:
        if isinstance(t, torch.Tensor):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            q = m.weight.quant_state
            for t in (m.weight, q.absmax, q.code, q.offset):
                add(t)
            if q.state2 is not None:
                add(q.state2.absmax)
                add(q.state2.code)
    return sum(seen.values()), round(adapters.quantized * adapters.base_bits_quantized / 8)


def rest(family: str, backend: str, stage: int, ac: bool, measured_nf4: int, cache: Cache) -> dict | None:
    point = Point(family, strategy(backend, stage, 1, ac), 512, LORA)
    sim, _ = cache.get_or_run(point, run=False)
    if sim is None:
        return None
    lora = compare(point, sim)
    plan = plan_from_parts(FAMILIES[family], point.strategy, 512, 2, adapters=QLORA)
    adapters = adapters_for(plan.config, plan.shape)
    # The LoRA run holds the block linears' weights in bf16; QLoRA holds the measured NF4 bytes instead,
    # plus one dequantized linear (bitsandbytes MatMul4Bit), as the planner counts it.
    swapped = lora["simulated"] - C * adapters.quantized + measured_nf4 + C * adapters.largest_linear
    est = estimate_memory(plan.shape, plan.hardware, point.strategy, 512, methods=[adapter_terms(adapters, plan.shape)] if adapters else []).gpu
    return {"family": family, "strategy": point.strategy.name, "ac": ac, "analytical": sum(est.values()),
            "swapped": swapped, "ratio": sum(est.values()) / swapped}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", action="store_true", help="llama under DDP only")
    args = parser.parse_args(argv)
    families = ("llama",) if args.short else ("llama", "qwen2", "mistral")
    strategies = (("ddp", 0),) if args.short else (("ddp", 0), ("deepspeed", 2))
    cache, worst = Cache(CACHE), 0.0
    print("(a) NF4 weights, real quantized 2-block models: measured vs planner (MiB)")
    measured = {}
    for family in families:
        got, planned = nf4_bytes(family)
        measured[family] = got
        worst = max(worst, abs(planned / got - 1))
        print(f"  {family:<8} measured {got / MiB:9.2f}  planner {planned / MiB:9.2f}  ratio {planned / got:.4f}")
    print("(b) QLoRA estimate vs LoRA simulation with the weights swapped (per rank MiB, mb 1, seq 512)")
    for family in measured:
        for backend, stage in strategies:
            for ac in (False, True):
                r = rest(family, backend, stage, ac, measured[family], cache)
                if r is None:
                    print(f"  {family:<8} {backend}-{stage} ac={ac}: LoRA point not simulated yet (run --lora)")
                    continue
                worst = max(worst, abs(r["ratio"] - 1))
                print(f"  {family:<8} {r['strategy']:<28} ac={ac!s:<5} analytical {r['analytical'] / MiB:8.0f} "
                      f"swapped {r['swapped'] / MiB:8.0f}  ratio {r['ratio']:.3f}")
    print(f"worst |analytical/measured - 1| = {worst:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
