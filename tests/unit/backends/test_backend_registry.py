"""The backend registry and the parts of the Backend protocol every backend shares: one rule set
for the planner and the renderers, the process group each plan needs, a plug-in backend (an
`orchestrate.backends` entry point) planned like a built-in one and duplicate names refused."""

from __future__ import annotations

import dataclasses
from importlib.metadata import EntryPoint

import pytest

from orchestrate.backends import registry
from orchestrate.backends.registry import backend_names, get_backend
from orchestrate.errors import UserError
from orchestrate.hardware.profile import GPUSpec, HardwareProfile
from orchestrate.planner.strategy import Strategy
from orchestrate.planning import weigh
from tests.helpers.plans import make_plan as pinned_plan
from tests.unit.planner.test_planner import config, gpt2_xl, gpu_hw


def test_builtin_backends_in_planner_order_and_a_taken_name_is_refused():
    assert backend_names()[:3] == ["ddp", "deepspeed", "fsdp"]
    for name in backend_names():
        assert get_backend(name).name == name
    with pytest.raises(KeyError, match="unknown backend"):
        get_backend("megatron")


@pytest.mark.parametrize("hw", [gpu_hw(1), gpu_hw(2), gpu_hw(2, nodes=2)], ids=["1gpu", "2gpu", "2x2gpu"])
def test_every_candidate_the_planner_weighs_is_one_its_backend_renders(hw):
    plan = weigh(config(), hw, gpt2_xl())
    assert len(plan.candidates) > 5
    for candidate in plan.candidates:
        backend = get_backend(candidate.strategy.backend)
        assert backend.problems(candidate.strategy.sharding) == []
        assert candidate.strategy.zero_stage in backend.zero_stages
        plan.chosen = candidate
        assert backend.render(plan)  # no UserError from the same rules


def _gpu(plan):
    spec = GPUSpec(name="RTX 3070", memory_bytes=8 * 2**30, peak_tflops_fp16=81, peak_tflops_bf16=81,
                   peak_tflops_fp32=20, compute_capability=(8, 6))
    plan.hardware = HardwareProfile(gpus_per_node=2, gpu=spec, cpu_memory_bytes=64 * 2**30)
    return plan


@pytest.mark.parametrize(("strategy", "cpu", "gpu"), [
    (Strategy("ddp", 0, "none", "none", "fp32", False, 2), "gloo", "nccl"),
    (Strategy("deepspeed", 2, "cpu", "none", "fp32", False, 2), "gloo", "nccl"),
    (Strategy("deepspeed", 3, "cpu", "cpu", "fp32", False, 2), "gloo", "nccl"),
    (Strategy("fsdp", 3, "none", "none", "fp32", False, 2), "gloo", "nccl"),
    # Offloaded FSDP2 shards are CPU tensors: their collectives need gloo beside nccl.
    (Strategy("fsdp", 3, "cpu", "cpu", "fp32", False, 2), "gloo", "cuda:nccl,cpu:gloo"),
], ids=lambda v: v.name if isinstance(v, Strategy) else v)
def test_each_backend_names_the_process_group_its_plan_needs(strategy, cpu, gpu):
    backend = get_backend(strategy.backend)
    assert backend.process_group(pinned_plan(strategy)) == cpu
    assert backend.process_group(_gpu(pinned_plan(strategy))) == gpu


def test_renderers_refuse_with_the_backends_own_problems():
    ddp = Strategy("ddp", 2, "cpu", "none", "fp32", False, 2)
    with pytest.raises(UserError) as err:
        get_backend("ddp").render(pinned_plan(ddp))
    assert err.value.problems == get_backend("ddp").problems(ddp.sharding)
    assert {p.where for p in err.value.problems} == {"strategy.zero_stage", "strategy.offload"}


class _Twin:
    """A plug-in backend that runs what FSDP2 runs: priced by FSDP2's terms, preferred after it."""

    def __init__(self, priced_as: str = "fsdp", name: str = "fsdp-twin") -> None:
        fsdp = get_backend("fsdp")
        self.name, self.zero_stages, self.tie_break, self.priced_as = name, fsdp.zero_stages, 9, priced_as
        self.knobs = fsdp.knobs
        self.shards_parameters, self.problems = fsdp.shards_parameters, fsdp.problems


TWIN, PRICED_AS_MEGATRON, NAMED_DDP = _Twin(), _Twin("megatron", "megatron-twin"), _Twin(name="ddp")


@pytest.fixture
def installed(monkeypatch):
    """Install the backends named (`name = tests.unit.backends.test_backend_registry:OBJECT`) as entry points."""

    def install(**points: str) -> None:
        found = [EntryPoint(name, f"{__name__}:{target}", registry.PLUGIN_GROUP) for name, target in points.items()]
        monkeypatch.setattr(registry, "entry_points", lambda group: found if group == registry.PLUGIN_GROUP else [])
        registry._plugins.cache_clear()

    yield install
    registry._plugins.cache_clear()


def test_a_plug_in_backend_with_a_taken_name_or_an_unpriced_one_is_one_message(installed):
    installed(ddp="NAMED_DDP", megatron="PRICED_AS_MEGATRON")
    with pytest.raises(UserError) as err:
        backend_names()
    assert [p.message for p in err.value.problems] == [
        "names its backend 'ddp', as another backend does",
        "is priced as 'megatron'; the memory and speed models price ddp, deepspeed, fsdp"]


def test_a_plug_in_backend_is_searched_ranked_and_priced_like_a_built_in_one(installed):
    installed(twin="TWIN")
    assert backend_names() == ["ddp", "deepspeed", "fsdp", "fsdp-twin"] and get_backend("fsdp-twin") is TWIN
    plan = weigh(config(), gpu_hw(2), gpt2_xl())
    def key(c):
        return dataclasses.replace(c.strategy, backend="")

    twins = {key(c): c for c in plan.candidates if c.strategy.backend == "fsdp-twin"}
    fsdp = {key(c): c for c in plan.candidates if c.strategy.backend == "fsdp"}
    assert twins and twins.keys() == fsdp.keys()
    for name, twin in twins.items():  # the same terms: the same memory and speed
        assert (twin.memory, twin.speed) == (fsdp[name].memory, fsdp[name].speed)
        # equally fast, so the tie-break puts the twin (tie_break 9) after FSDP2
        assert plan.candidates.index(twin) > plan.candidates.index(fsdp[name])
