"""What is live at the peak (memory.py "Peak model"): backward-only states reuse the bytes of what
backward frees; with gradient accumulation they are held in full."""

from __future__ import annotations

import pytest

from orchestrate.planner.memory import _placement, estimate_memory
from tests.unit.planner.test_memory_model import FAMILIES, gpt2_xl, gpu_hw, llama2_7b, strat


@pytest.mark.parametrize("family", [f for f in FAMILIES if f[2] == "none" and f[3] == "none"],
                         ids=lambda f: "-".join(map(str, f)))
@pytest.mark.parametrize("shape", [gpt2_xl(), llama2_7b()], ids=["gpt2-xl", "llama2-7b"])
def test_one_micro_batch_peaks_at_most_as_high_as_holding_everything(family, shape):
    hw = gpu_hw(2)
    one = estimate_memory(shape, hw, strat(*family, micro=2), 1024, gradient_accumulation=1)
    held = estimate_memory(shape, hw, strat(*family, micro=2), 1024, gradient_accumulation=2)
    assert one.gpu_total <= held.gpu_total
    # what is netted is bounded by what backward frees
    freed = one.gpu["activations"] + one.gpu["logits"] + one.gpu["gathered_params"]
    assert held.gpu_total - one.gpu_total <= freed * (1 + 0.06)  # + allocator reserve on the difference


def test_static_terms_are_never_netted():
    shape, hw = llama2_7b(), gpu_hw(2)
    for family in FAMILIES:
        s = strat(*family, micro=1)
        mem, placed = estimate_memory(shape, hw, s, 512), _placement(shape, hw, s, 1).gpu
        for key in ("weights", "optimizer_states", "master_weights"):
            assert mem.gpu[key] == int(placed[key]), (family, key)


def test_zero3_step_temporaries_show_when_activations_are_small():
    # Tiny activations (seq 8): the ZeRO-3 step (fp32 gradient partition + foreach AdamW's sqrt
    # temporary, 8·P/n) is the peak, above the 4·P/n fp32 partition alone.
    shape, hw = llama2_7b(), gpu_hw(2)
    mem = estimate_memory(shape, hw, strat("deepspeed", 3, micro=1), 8)
    held16 = 2 * shape.parameters / 2  # the 16-bit gradient partition, kept for the whole run
    assert mem.gpu["gradients"] >= held16 + 8 * shape.parameters / 2 - (
        mem.gpu["activations"] + mem.gpu["logits"] + mem.gpu["gathered_params"]) - 1
