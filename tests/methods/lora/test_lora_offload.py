"""LoRA and QLoRA (NF4) under DeepSpeed with offload, on 2 gloo ranks: ZeRO-2/3 with the adapters'
optimizer in host memory (`offload_optimizer: {device: cpu}`), and ZeRO-3 with the frozen base's
partitions there too (`offload_param: {device: cpu}`, fsdp_qlora's layout). The same
combined run as tests/methods/lora/test_lora_backends.py (loss falls, base bytes identical, adapters-only
checkpoint resumed bit-exactly, RUN_DIR/adapter loads with peft, RUN_DIR/model merged).

On CPU "offloaded to cpu" moves nothing, so this checks DeepSpeed's offload code path (the partitions
and the optimizer's states held by the offload machinery, DeepSpeedCPUAdam stepping the adapters), not
the host-to-device copies; no GPU has run it.
"""

from __future__ import annotations

import pytest

from tests.helpers.dist import run_on_ranks
from tests.methods.lora.test_lora_backends import _train, check_adapter_run, model_dirs  # noqa: F401 (a fixture)

# Both families and both methods over the cases, each offload setup once: the optimizer-only setups hold
# only the adapters offloaded (the same code for either method), and ZeRO-3 with the base's partitions
# offloaded runs QLoRA's 4-bit base, the harder of the two (LoRA on llama there, and the other pairings,
# passed too when this was written, and cost CI a minute and a half).
CASES = [("zero2_offload_opt", "qlora", "llama"), ("zero3_offload_opt", "lora", "qwen2"),
         ("zero3_offload", "qlora", "qwen2")]
DEVICES = {"zero2_offload_opt": ["cpu", None], "zero3_offload_opt": ["cpu", None], "zero3_offload": ["cpu", "cpu"]}
"""The engine's (offload_optimizer, offload_param) devices (DeepSpeedEngine.zero_offload_*)."""


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "method", "family"), CASES, ids=["-".join(c) for c in CASES])
def test_adapters_train_with_the_base_offloaded(backend, method, family, model_dirs, tmp_path):  # noqa: F811
    out = run_on_ranks(_train, 2, backend, method, family, model_dirs[family], str(tmp_path))
    for rank, r in out.items():
        assert r["offload"] == DEVICES[backend], f"rank {rank}: offload devices {r['offload']}"
    check_adapter_run(out, f"{backend} {method} {family}", method)
