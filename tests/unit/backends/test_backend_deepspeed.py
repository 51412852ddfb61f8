"""DeepSpeed backend: rendered JSON checked by DeepSpeed's own config parser and against golden
files; 2-rank gloo training with ZeRO-2 and ZeRO-3 CPU offload on the tiny GPT-2.

Regenerate the golden files after an intended change of the rendering, then review the diff:
    .venv/bin/python -m tests.unit.backends.test_backend_deepspeed --regen
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import sys
from pathlib import Path

import pytest

from orchestrate.backends.deepspeed_render import CONFIG_FILE, render, render_config
from orchestrate.backends.schedule import lr_multiplier
from orchestrate.errors import UserError
from orchestrate.hardware.profile import GPUSpec, HardwareProfile
from orchestrate.planner.plan import RunPlan
from orchestrate.planner.strategy import Strategy
from tests.helpers.plans import TINY_GPT2, make_plan

GOLDEN_DIR = Path(__file__).resolve().parents[2] / "golden" / "deepspeed"
NVME = "/mnt/nvme/offload"


def _gpu_hardware(ranks: int = 2) -> HardwareProfile:
    gpu = GPUSpec(name="NVIDIA GeForce RTX 3070", memory_bytes=8 * 2**30, compute_capability=(8, 6),
                  peak_tflops_fp16=81.3, peak_tflops_bf16=81.3, peak_tflops_fp32=20.3)
    return HardwareProfile(name="2x-rtx3070", gpus_per_node=ranks, gpu=gpu, cpu_memory_bytes=64 * 2**30,
                           nvme_path=NVME, nvme_free_bytes=500 * 10**9)


def _ds(stage: int, opt: str = "none", param: str = "none", precision: str = "fp32", ac: bool = False,
        micro: int = 2) -> Strategy:
    return Strategy("deepspeed", stage, opt, param, precision, ac, micro)


def _plan(strategy: Strategy, gpu: bool = False, config: dict | None = None) -> RunPlan:
    plan = make_plan(strategy, config=config)
    return plan.model_copy(update={"hardware": _gpu_hardware()}) if gpu else plan


# name -> plan: a few representative renderings kept byte for byte in tests/golden/deepspeed/.
GOLDEN = {
    "cpu-z2-offload_opt_cpu-fp32": lambda: _plan(_ds(2, "cpu")),
    "gpu-z1-bf16": lambda: _plan(_ds(1, precision="bf16"), gpu=True),
    "gpu-z3-offload_opt_cpu-offload_param_cpu-bf16-ac": lambda: _plan(_ds(3, "cpu", "cpu", "bf16", True), gpu=True),
    "gpu-z3-offload_opt_nvme-offload_param_nvme-fp16": lambda: _plan(_ds(3, "nvme", "nvme", "fp16"), gpu=True),
}


def regen() -> None:
    GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    for name, build in GOLDEN.items():
        (GOLDEN_DIR / f"{name}.json").write_text(render(build())[CONFIG_FILE])
        print(f"wrote {GOLDEN_DIR / name}.json")


# ---------------------------------------------------------------------------------------------
# Rendering (fast)

def _variants():
    for stage, precision in itertools.product(range(4), ("bf16", "fp16", "fp32")):
        opts = ("none",) if stage == 0 else ("none", "cpu", "nvme")
        params = ("none", "cpu", "nvme") if stage == 3 else ("none",)
        for opt, param in itertools.product(opts, params):
            yield _ds(stage, opt, param, precision)


def _parse(cfg: dict, world: int, monkeypatch):
    """DeepSpeed's own parser and validator (pydantic models that reject unknown keys, plus the batch
    assertion), without a process group: DeepSpeedConfig reads rank and world size from deepspeed.comm."""
    from deepspeed.runtime import config as ds_config

    monkeypatch.setattr(ds_config.dist, "get_rank", lambda *a, **k: 0)
    monkeypatch.setattr(ds_config.dist, "get_world_size", lambda *a, **k: world)
    parsed = ds_config.DeepSpeedConfig(json.loads(json.dumps(cfg)), mpu=None)
    assert parsed.world_size == world
    return parsed


def _walk(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from _walk(v)
    else:
        yield value


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "gpu"])
@pytest.mark.parametrize("strategy", list(_variants()), ids=lambda s: s.name)
def test_rendered_config_is_complete_and_deepspeed_accepts_it(strategy, gpu, monkeypatch):
    plan = _plan(strategy, gpu=gpu, config={"strategy": {"nvme_path": NVME}})
    text = render(plan)[CONFIG_FILE]
    cfg = json.loads(text)
    assert "auto" not in list(_walk(cfg))
    assert cfg == render_config(plan)
    parsed = _parse(cfg, plan.world_size, monkeypatch)

    accumulation = plan.chosen.gradient_accumulation
    hidden = plan.shape.hidden_size
    # Every top-level key is checked against what DeepSpeed parsed from it: DeepSpeed silently
    # ignores unknown top-level (and aio) keys, so a misspelt one would otherwise pass.
    checks = {
        "train_batch_size": parsed.train_batch_size == 2 * accumulation * plan.world_size,
        "train_micro_batch_size_per_gpu": parsed.train_micro_batch_size_per_gpu == 2,
        "gradient_accumulation_steps": parsed.gradient_accumulation_steps == accumulation,
        "gradient_clipping": parsed.gradient_clipping == plan.config.train.grad_clip,
        "bf16": parsed.bfloat16_config.enabled == (strategy.precision == "bf16"),
        "fp16": parsed.float16_config.enabled == (strategy.precision == "fp16"),
        "zero_optimization": parsed.zero_config.stage == strategy.zero_stage,
        "steps_per_print": parsed.steps_per_print == cfg["steps_per_print"],
        "wall_clock_breakdown": parsed.wall_clock_breakdown is False,
        "aio": "aio" not in cfg or parsed.aio_config == {**cfg["aio"], "use_gds": False},
        # DeepSpeed lower-cases the optimizer name (runtime/config.py get_optimizer_name).
        "optimizer": parsed.optimizer_name == "adamw" and parsed.optimizer_params == cfg["optimizer"]["params"],
        "scheduler": parsed.scheduler_name == "WarmupCosineLR" and parsed.scheduler_params == cfg["scheduler"]["params"],
    }
    assert set(cfg) <= set(checks), f"unchecked keys: {set(cfg) - set(checks)}"
    assert all(checks[k] for k in cfg), {k: checks[k] for k in cfg}
    assert ("aio" in cfg) == ("nvme" in (strategy.offload_optimizer, strategy.offload_params))

    zero = parsed.zero_config
    if strategy.precision == "fp16":
        assert parsed.float16_config.loss_scale == 0 and parsed.float16_config.initial_scale_power == 16
    if strategy.zero_stage > 0:
        # GPU: hidden^2 buckets (GPU memory); CPU: the whole model in one bucket, because hidden^2
        # buckets cost 1.24-1.37x tokens/s on gloo (bench/deepspeed_settings.py, planner/ds_buckets.py).
        bucket = hidden * hidden if gpu else -(-plan.shape.parameters // 2**20) * 2**20
        assert zero.reduce_bucket_size == bucket and zero.allgather_bucket_size == bucket
        assert gpu or bucket >= plan.shape.parameters
        assert zero.overlap_comm is gpu
    if strategy.zero_stage == 3:
        assert zero.prefetch_bucket_size == int(0.9 * hidden * hidden)
        assert zero.param_persistence_threshold == 10 * hidden
        # Gathered parameters released after use, not DeepSpeed's 1e9 (planner/ds_buckets.py): what
        # DeepSpeed parsed is what the memory model charges for.
        block = plan.shape.block_parameters
        assert zero.max_live_parameters == block + int(0.9 * hidden * hidden) < 10**9
        assert zero.max_reuse_distance == 2 * block
        assert zero.gather_16bit_weights_on_model_save is True
    for want, block in ((strategy.offload_optimizer, zero.offload_optimizer),
                        (strategy.offload_params, zero.offload_param)):
        if want == "none":
            assert block is None
            continue
        assert block.device == want
        assert block.pin_memory is gpu  # pinned memory only on GPU machines
        assert (str(block.nvme_path) if want == "nvme" else block.nvme_path) == (
            NVME if want == "nvme" else None)


def test_parameter_offload_nvme_buffer_holds_the_largest_partition():
    cfg = render_config(_plan(_ds(3, "nvme", "nvme"), config={"strategy": {"nvme_path": NVME}}))
    assert cfg["zero_optimization"]["offload_param"]["buffer_size"] == 10**8  # tiny model: the default
    plan = _plan(_ds(3, "nvme", "nvme"), config={"strategy": {"nvme_path": NVME}})
    plan = plan.model_copy(update={"shape": dataclasses.replace(plan.shape, largest_layer_parameters=525_336_576)})
    assert render_config(plan)["zero_optimization"]["offload_param"]["buffer_size"] == 262_668_288


def test_nvme_path_comes_from_the_config_first_then_the_hardware(tmp_path):
    plan = make_plan(_ds(2, "nvme"), config={"strategy": {"nvme_path": "swap"}}, source_dir=tmp_path)
    plan = plan.model_copy(update={"hardware": _gpu_hardware()})
    assert render_config(plan)["zero_optimization"]["offload_optimizer"]["nvme_path"] == str(tmp_path / "swap")
    plan = _plan(_ds(2, "nvme"), gpu=True)
    assert render_config(plan)["zero_optimization"]["offload_optimizer"]["nvme_path"] == NVME


def test_nvme_offload_without_a_directory_is_a_user_error():
    with pytest.raises(UserError) as err:
        render(_plan(_ds(3, "cpu", "nvme")))
    assert err.value.problems[0].where == "strategy.nvme_path"


@pytest.mark.parametrize("strategy", [_ds(2, "cpu", "cpu"), _ds(0, "cpu")], ids=lambda s: s.name)
def test_impossible_strategies_are_user_errors_from_the_backends_rules(strategy):
    from orchestrate.backends.registry import get_backend

    with pytest.raises(UserError) as err:
        render(_plan(strategy))
    assert err.value.problems == get_backend("deepspeed").problems(strategy.sharding)


def test_another_backends_strategy_is_a_programming_error():
    with pytest.raises(ValueError):
        render(_plan(Strategy("fsdp", 3, "none", "none", "bf16", False, 1)))


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_rendering_matches_golden_file(name):
    golden = GOLDEN_DIR / f"{name}.json"
    assert golden.is_file(), "run: .venv/bin/python -m tests.unit.backends.test_backend_deepspeed --regen"
    assert render(GOLDEN[name]())[CONFIG_FILE] == golden.read_text(), (
        "rendering changed; if intended run `.venv/bin/python -m tests.unit.backends.test_backend_deepspeed --regen` "
        "and review the diff")


def test_backend_is_registered():
    from orchestrate.backends.registry import get_backend

    backend = get_backend("deepspeed")
    plan = _plan(_ds(2, "cpu"))
    assert backend.name == "deepspeed" and backend.render(plan) == render(plan)


class _FakeDeepSpeedEngine:
    """DeepSpeed's step semantics in miniature (engine.py `step`/`_take_model_step`): the update happens
    on the accumulation boundary, and an fp16 overflow skips it *and* the scheduler step."""

    def __init__(self, plan: RunPlan, overflow_on: set[int]):
        import torch

        from orchestrate.backends.schedule import make_scheduler

        self.weight = torch.nn.Parameter(torch.ones(()))
        self.module = torch.nn.ParameterList([self.weight])  # what the engine wraps (its inputs' dtype)
        self.optimizer = torch.optim.SGD([self.weight], lr=plan.config.train.optimizer.lr)
        self.lr_scheduler = make_scheduler(self.optimizer, plan.config.train)
        self.accumulation = plan.chosen.gradient_accumulation
        self.overflow_on, self.micro_steps, self.global_steps, self.skipped_steps = overflow_on, 0, 0, 0
        self.training = False  # as from_pretrained leaves a model: eval mode

    def train(self, mode: bool = True):
        self.training = mode

    def __call__(self, input_ids, labels, use_cache=None):
        return dataclasses.make_dataclass("Out", ["loss"])((self.weight * input_ids.float()).mean())

    def backward(self, loss):
        (loss / self.accumulation).backward()

    def step(self):
        self.micro_steps += 1
        if self.micro_steps % self.accumulation:
            return
        if self.global_steps in self.overflow_on:
            self.optimizer.zero_grad(set_to_none=True)  # DeepSpeed's step() runs, finds inf, updates nothing
            self.optimizer.step()
            self.skipped_steps += 1
        else:
            self.optimizer.step()
            self.lr_scheduler.step()
        self.optimizer.zero_grad()
        self.global_steps += 1

    def get_lr(self):
        return [self.optimizer.param_groups[0]["lr"]]

    def get_global_grad_norm(self):
        return None


def test_train_step_reports_unscaled_loss_and_keeps_the_schedule_through_skipped_steps(tmp_path):
    import torch

    from orchestrate.backends.deepspeed_backend import DeepSpeedTrainEngine
    from orchestrate.worker.objective import CausalLMObjective
    from tests.helpers.engines import cpu_rank

    plan = make_plan(_ds(2, precision="fp16"), config=TRAIN_CONFIG)
    engine = DeepSpeedTrainEngine(_FakeDeepSpeedEngine(plan, overflow_on={0}), plan, cpu_rank(0, 2), tmp_path,
                                  CausalLMObjective(), hf_config=None)
    batches = [{"input_ids": torch.full((2, 4), float(v)), "labels": torch.zeros(2, 4)} for v in (1, 3)]
    results = [engine.train_step(batches) for _ in range(3)]
    assert engine.engine.training  # each step trains in train mode, whatever mode the model came in
    assert [r.skipped for r in results] == [True, False, False]
    assert results[0].loss == 2.0  # mean of the micro-batch losses 1 and 3, not divided by accumulation
    assert math.isnan(results[0].grad_norm)
    train = plan.config.train
    assert [r.lr for r in results] == pytest.approx([train.optimizer.lr * lr_multiplier(s, train) for s in range(3)])
    with pytest.raises(ValueError, match="micro-batches"):
        engine.train_step(batches[:1])


# ---------------------------------------------------------------------------------------------
# Training on 2 gloo ranks (slow)

TRAIN_CONFIG = {"train": {"max_steps": 8, "optimizer": {"lr": 1e-2}, "schedule": {"warmup_steps": 2}}}
STEPS = 6
RESUME_AT = 3


def _micro_batches(plan: RunPlan, rank: int, step: int):
    """Fixed random tokens: two distinct batches per rank, alternating. Drawn from 16 of the 257 ids,
    so a few steps can learn that (the loss falls from ln 257 towards ln 16)."""
    import torch

    seq, micro = plan.config.train.seq_len, plan.strategy.micro_batch_size
    out = []
    for i in range(plan.chosen.gradient_accumulation):
        g = torch.Generator().manual_seed(1000 * rank + 10 * (step % 2) + i)
        ids = torch.randint(0, 16, (micro, seq), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)})
    return out


def _probe():
    import torch

    return torch.randint(0, TINY_GPT2["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(7))


def _train(engine, plan, rank, steps, first=0):
    results = [engine.train_step(_micro_batches(plan, rank, s)) for s in range(first, first + steps)]
    return [dataclasses.asdict(r) for r in results]


def _rank_main(strategy: Strategy, model_dir: str, work: str, also: Strategy | None) -> dict:
    """Per rank: run A (train, checkpoint midway, save HF model, probe logits), run B (same seed,
    fresh engine), run C (fresh engine resumed from A's checkpoint); then, if given, two steps with
    the strategy `also`."""
    import torch
    from transformers.integrations import is_deepspeed_zero3_enabled

    from orchestrate.backends.deepspeed_backend import DeepSpeedBackend
    from tests.helpers.dist import init_gloo
    from tests.helpers.engines import cpu_rank, setup_engine

    torch.set_num_threads(1)  # 2 ranks on 2 shared cores
    rank, world = init_gloo()
    work_dir = Path(work)
    plan = make_plan(strategy, config=TRAIN_CONFIG)
    me = cpu_rank(rank, world, int(os.environ["LOCAL_RANK"]))
    backend = DeepSpeedBackend()
    out: dict = {}

    engine = setup_engine(backend, plan, me, model_dir)
    out["zero3_init"] = is_deepspeed_zero3_enabled()  # the switch that made from_pretrained use zero.Init
    out["checkpointing"] = engine.engine.module.is_gradient_checkpointing
    # A block's first MLP linear runs once per micro-batch, twice where checkpointing recomputes it in
    # backward (transformers checkpoints only in train mode: a switch that is on can still do nothing).
    # Not the MLP itself: the recompute stops early, inside it, once the last saved tensor is rebuilt.
    mlp_calls = []
    hook = engine.engine.module.transformer.h[0].mlp.c_fc.register_forward_hook(lambda *_: mlp_calls.append(1))
    out["a"] = _train(engine, plan, rank, RESUME_AT)
    hook.remove()
    out["mlp_calls_per_micro_batch"] = len(mlp_calls) / (RESUME_AT * plan.chosen.gradient_accumulation)
    engine.save_checkpoint(work_dir / "ckpt", {"step": RESUME_AT})
    out["a"] += _train(engine, plan, rank, STEPS - RESUME_AT, first=RESUME_AT)
    out["eval"] = engine.eval_sums(_micro_batches(plan, rank, 0)[0])["loss"]
    engine.save_hf_model(work_dir / "hf")
    engine.engine.eval()
    with torch.no_grad():  # every rank runs the forward: ZeRO-3 gathers parameters collectively
        out["logits"] = engine.model(input_ids=_probe()).logits
    del engine

    engine = setup_engine(backend, plan, me, model_dir)
    out["b"] = _train(engine, plan, rank, STEPS)
    del engine

    engine = setup_engine(backend, plan, me, model_dir)
    out["client_state"] = engine.load_checkpoint(work_dir / "ckpt")
    out["c"] = _train(engine, plan, rank, STEPS - RESUME_AT, first=RESUME_AT)
    del engine

    if also is not None:
        other = make_plan(also, config=TRAIN_CONFIG)
        out["also"] = _train(setup_engine(backend, other, me, model_dir), other, rank, 2)
    return out


def _write_initial_model(path: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    arch = dict(TINY_GPT2)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(arch.pop("model_type"), **arch)).save_pretrained(path)


def _check_training(strategy: Strategy, tmp_path: Path, also: Strategy | None = None) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM

    from tests.helpers.dist import run_on_ranks

    _write_initial_model(tmp_path / "init")
    results = run_on_ranks(_rank_main, 2, strategy, str(tmp_path / "init"), str(tmp_path), also)
    plan = make_plan(strategy, config=TRAIN_CONFIG)
    train = plan.config.train
    for rank, out in results.items():
        losses = [r["loss"] for r in out["a"]]
        print(f"{strategy.name} rank {rank}: losses {[round(x, 4) for x in losses]}, "
              f"grad norms {[round(r['grad_norm'], 3) for r in out['a']]}")
        assert losses[-1] < 0.85 * losses[0], losses
        assert all(math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 for r in out["a"])
        assert not any(r["skipped"] for r in out["a"])
        # The lr of step s is schedule.py's, exactly: the client scheduler drives DeepSpeed's optimizer.
        assert [r["lr"] for r in out["a"]] == pytest.approx(
            [train.optimizer.lr * lr_multiplier(s, train) for s in range(STEPS)], rel=1e-12)
        assert out["b"] == out["a"], "same seed, same data: a fresh engine must repeat the losses"
        assert out["client_state"] == {"step": RESUME_AT}
        assert out["c"] == out["a"][RESUME_AT:], "resuming from the checkpoint must repeat the losses"
        assert math.isfinite(out["eval"])
        assert out["zero3_init"] == (strategy.zero_stage == 3)
        assert out["checkpointing"] == strategy.activation_checkpointing
        assert out["mlp_calls_per_micro_batch"] == (2 if strategy.activation_checkpointing else 1)
    # Both ranks trained the same replicated model, one data shard each, so their losses differ.
    assert results[0]["a"][0]["loss"] != results[1]["a"][0]["loss"]

    saved = tmp_path / "hf"
    assert (saved / "config.json").is_file() and (saved / "model.safetensors").is_file()
    reloaded = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = reloaded(input_ids=_probe()).logits
    # fp32 training: the saved weights are the trained fp32 weights, bit for bit.
    torch.testing.assert_close(logits, results[0]["logits"], rtol=0, atol=0)
    return [results[0], results[1]]


@pytest.mark.slow
def test_zero2_cpu_optimizer_offload_trains_resumes_and_saves(tmp_path):
    results = _check_training(_ds(2, "cpu"), tmp_path, also=_ds(0))
    for out in results:
        # Stage 0 (replicated, torch AdamW): the same first loss and gradient norm as ZeRO-2; the
        # norm is measured by the backend itself there, DeepSpeed records none without ZeRO.
        zero2, zero0 = out["a"][:2], out["also"]
        assert zero0[0]["loss"] == zero2[0]["loss"]
        assert [r["grad_norm"] for r in zero0] == pytest.approx([r["grad_norm"] for r in zero2], rel=1e-4)
        assert zero0[1]["loss"] == pytest.approx(zero2[1]["loss"], rel=1e-4)


@pytest.mark.slow
def test_zero3_parameter_and_optimizer_offload_trains_resumes_and_saves(tmp_path):
    _check_training(_ds(3, "cpu", "cpu", ac=True), tmp_path)


if __name__ == "__main__":
    if sys.argv[1:] == ["--regen"]:
        regen()
    else:
        sys.exit("usage: python -m tests.unit.backends.test_backend_deepspeed --regen")
