"""The rollout's weights are gathered once per rollout phase, not once per decoded token
(orchestrate/methods/grpo/gather.py), on 2 gloo ranks (slow): the engines as the backends build them
(FSDP2 full shard, DeepSpeed ZeRO-3) around the tiny GPT-2 of tests/helpers/plans.py, the same greedy
completions sampled with and without `gathered`, the gathers counted. FSDP2: all-gathers
(`torch.distributed.all_gather_single`, FSDP2's default all-gather); ZeRO-3: the parameter
coordinator's module fetches (the hooks that gather a module's partitions before its forward)."""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import pytest

from orchestrate.planner.strategy import Strategy
from tests.helpers.plans import TINY_GPT2, make_plan

pytestmark = pytest.mark.slow
NEW_TOKENS = 6


def _write_initial_model(path: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    arch = dict(TINY_GPT2)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(arch.pop("model_type"), **arch)).save_pretrained(path)


def _greedy(inner) -> list[list[int]]:
    import torch

    prompt = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    with torch.no_grad():
        out = inner.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                             max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=0)
    return out[:, prompt.shape[1]:].tolist()


def _rank_main(backend_name: str, model_dir: str) -> dict:
    import torch

    from orchestrate.backends.registry import get_backend
    from orchestrate.methods.grpo.gather import gathered
    from tests.helpers.dist import init_gloo
    from tests.helpers.engines import cpu_rank, setup_engine

    torch.set_num_threads(1)
    rank, world = init_gloo()
    plan = make_plan(Strategy(backend_name, 3, "none", "none", "fp32", False, 1))
    engine = setup_engine(get_backend(backend_name), plan, cpu_rank(rank, world, int(os.environ["LOCAL_RANK"])),
                          model_dir)
    model = engine.model
    if backend_name == "fsdp":
        from torch.distributed.fsdp import FSDPModule

        target = "torch.distributed.all_gather_single"
        units = sum(isinstance(m, FSDPModule) for m in model.modules())
    else:
        target = "deepspeed.runtime.zero.partitioned_param_coordinator.PartitionedParameterCoordinator.fetch_sub_module"
        units = None
    probe = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        before = model(input_ids=probe).logits
    counted: dict[str, list[list[int]] | int | bool] = {"units": units}
    # gathered first: after it every unit is resharded, as at the start (an FSDP2 root stays unsharded
    # after its forward, which would spare it a gather in whichever run came second)
    for name, context in (("gathered", gathered), ("per_token", None)):
        calls: list[int] = []
        with mock.patch(target, _counting(_resolve(target), calls)):
            if context is None:
                completions = _greedy(getattr(model, "module", model))
            else:
                with context(model) as inner:
                    completions = _greedy(inner)
        counted[name] = len(calls)
        counted[f"{name}_completions"] = completions
    # the forward gathers as before once the rollout phase is over (the ZeRO-3 hooks registered again)
    with torch.no_grad():
        counted["same_logits_after"] = torch.equal(model(input_ids=probe).logits, before)
    return counted


def _counting(original, calls: list[int]):
    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    return counting


def _resolve(dotted: str):
    import importlib

    module, _, attr = dotted.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except ModuleNotFoundError:  # a class attribute
        owner, _, cls = module.rpartition(".")
        return getattr(getattr(importlib.import_module(owner), cls), attr)


@pytest.mark.parametrize("backend", ["fsdp", "deepspeed"])
def test_the_rollout_gathers_the_sharded_weights_once_not_per_decoded_token(backend, tmp_path):
    from tests.helpers.dist import run_on_ranks

    _write_initial_model(tmp_path / "init")
    results = run_on_ranks(_rank_main, 2, backend, str(tmp_path / "init"))
    for out in results.values():
        assert out["gathered_completions"] == out["per_token_completions"]  # the same weights, whole
        assert out["same_logits_after"]
        if backend == "fsdp":
            assert out["gathered"] == out["units"]  # one all-gather per FSDP unit (each block, the root)
            assert out["per_token"] >= NEW_TOKENS * (out["units"] - 1)  # every forward gathers every block again
        else:
            assert out["gathered"] == 0  # no module fetch: GatheredParameters gathered everything up front
            assert out["per_token"] >= NEW_TOKENS * TINY_GPT2["n_layer"]
