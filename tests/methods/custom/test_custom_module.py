"""Your own nn.Module (`model.module`, `data.module`): config validation, the meta-device shape,
the measured activations and their cache, the objective, and the memory model against a real
CPU step."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from orchestrate.config.load import config_from_dict
from orchestrate.errors import UserError
from orchestrate.methods.custom import activations as custom_activations
from orchestrate.methods.custom.module import shape_of_module
from orchestrate.model.meta import shape_for
from orchestrate.planner.plan import RunPlan

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "cnn"
HELPERS = "tests.helpers.custom_modules"


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def _config(model: dict, data: dict | None = None, train: dict | None = None, **sections):
    model = {"trust_remote_code": True, **model}  # the opt-in to run model.module (tests/unit/config/test_code_opt_in.py)
    return config_from_dict({"model": model, "data": data or {},
                             "train": {"seq_len": 1, "global_batch_size": 8, **(train or {})}, **sections}, EXAMPLE)


def _problems(exc: pytest.ExceptionInfo) -> list[tuple[str, str, str]]:
    return [(p.where, p.message, p.fix) for p in exc.value.problems]


@pytest.mark.parametrize(("model", "data", "where", "words"), [
    ({"module": "cnn_example:CNN", "name_or_path": "x"}, {}, "model", "exactly one of"),
    ({"module": "cnn_example"}, {}, "model.module", "package.module:ClassOrFactory"),
    ({"architecture": {"model_type": "gpt2"}}, {"module": "cnn_example:patterns"}, "(top level)", "data.module feeds"),
    ({"module": "cnn_example:CNN"}, {"module": "cnn_example:patterns", "train_files": ["a.txt"]}, "(top level)",
     "model.module trains on data.module"),
])
def test_bad_combinations_are_one_user_error_with_the_yaml_path(model, data, where, words):
    with pytest.raises(UserError) as exc:
        _config(model, data)
    assert any(w == where and words in m for w, m, _ in _problems(exc)), _problems(exc)


@pytest.mark.parametrize("section", [{"distill": {"teacher": "teacher_dir"}},
                                     {"prune": {"method": "magnitude", "target_sparsity": 0.5,
                                                "schedule": {"start_step": 1, "end_step": 5, "every": 1}}}])
def test_distillation_and_pruning_are_refused_for_a_custom_module(section):
    with pytest.raises(UserError) as exc:
        _config({"module": "cnn_example:CNN"}, {"module": "cnn_example:patterns"}, **section)
    assert any("work on Hugging Face models, not model.module" in m for _, m, _ in _problems(exc)), _problems(exc)


def test_train_loss_and_strategy_wrap_belong_to_a_custom_module():
    with pytest.raises(UserError, match="train.loss is for model.module"):
        _config({"architecture": {"model_type": "gpt2"}}, train={"loss": "model"})
    with pytest.raises(UserError, match="strategy.wrap is for model.module"):
        _config({"architecture": {"model_type": "gpt2"}}, strategy={"wrap": ["GPT2Block"]})


@pytest.mark.parametrize(("module", "words"), [
    ("no_such_package_xyz.models:Net", ["no_such_package_xyz", "ModuleNotFoundError"]),
    ("cnn_example:NoSuchClass", ["cnn_example", "no attribute 'NoSuchClass'"]),
])
def test_a_module_that_cannot_be_imported_names_the_path_and_the_error(module, words):
    with pytest.raises(UserError) as exc:
        shape_for(_config({"module": module}, {"module": "cnn_example:patterns"}))
    (where, message, fix), = _problems(exc)
    assert where == "model.module" and all(w in message for w in words) and module in exc.value.headline
    assert "importable" in fix


@pytest.mark.parametrize(("factory", "words"), [
    ("an_int", "returned no Dataset"),
    ("not_a_dataset", "neither dicts nor tuples"),
    ("broken_factory", "RuntimeError: no data here"),
])
def test_a_factory_that_returns_no_dataset_is_a_user_error(factory, words):
    with pytest.raises(UserError) as exc:
        shape_for(_config({"module": f"{HELPERS}:ResMLP"}, {"module": f"{HELPERS}:{factory}"}))
    text = str(exc.value)
    assert "data.module" in text and words in text, text


def test_planning_a_custom_module_needs_data_module():
    with pytest.raises(UserError) as exc:
        shape_for(_config({"module": f"{HELPERS}:ResMLP"}))
    assert _problems(exc)[0][0] == "data.module"


def test_meta_shape_counts_parameters_and_detects_the_repeated_blocks():
    from tests.helpers.custom_modules import ResMLP

    real = ResMLP(width=32, depth=3)
    shape = shape_of_module(ResMLP, {"width": 32, "depth": 3})
    assert shape.parameters == sum(p.numel() for p in real.parameters())
    assert shape.block_classes == ("Block",) and shape.num_layers == 3
    assert shape.block_parameters == sum(p.numel() for p in real.blocks[0].parameters())
    assert shape.largest_layer_parameters == 32 * 128 + 128  # Linear up (or down: same count)
    assert shape_of_module(real).parameters == shape.parameters  # an instance works too
    assert shape_of_module(ResMLP, {}, wrap=["LayerNorm"]).block_classes == ("LayerNorm",)
    with pytest.raises(UserError, match="strategy.wrap"):
        shape_of_module(ResMLP, {}, wrap=["NoSuchBlock"])


def test_activations_are_measured_once_then_read_from_the_cache(monkeypatch):
    config = _config({"module": "cnn_example:CNN"}, {"module": "cnn_example:patterns", "kwargs": {"size": 50}})
    first = shape_for(config)
    # CNN(32 channels) on 1x28x28: at least the conv output (32x26x26 fp32) per sample is saved.
    assert first.activation_bytes_per_sample >= 32 * 26 * 26 * 4
    monkeypatch.setattr(custom_activations, "_measure", lambda *a: pytest.fail("measured again"))
    assert shape_for(config) == first
    other = _config({"module": "cnn_example:CNN", "kwargs": {"channels": 8}},
                    {"module": "cnn_example:patterns", "kwargs": {"size": 50}})
    with pytest.raises(pytest.fail.Exception, match="measured again"):
        shape_for(other)  # other kwargs, other fingerprint


def test_the_plan_says_the_activations_were_measured():
    from orchestrate.planner.report import plan_json, render_plan
    from orchestrate.planning import method_reports, weigh
    from tests.helpers.plans import cpu_hardware

    config = _config({"module": "cnn_example:CNN"}, {"module": "cnn_example:patterns", "kwargs": {"size": 50}})
    shape = shape_for(config)
    plan = weigh(config, cpu_hardware(2), shape)
    assert isinstance(plan, RunPlan) and plan.chosen.memory.gpu["activations"] > 0
    assert "measured on fake tensors" in plan_json(plan, method_reports(plan))["activations_source"]
    assert not any(c.strategy.activation_checkpointing for c in plan.candidates)  # the CNN has no blocks to recompute
    from rich.console import Console

    console = Console(record=True, width=200)
    console.print(render_plan(plan, method_reports(plan)))
    assert "measured on fake tensors" in console.export_text()


def _real_peak(config, micro: int) -> int:
    """Live tensor bytes at the peak of 3 real fp32 CPU steps (forward, loss, backward, AdamW)."""
    from orchestrate.methods.custom.data import collate, load_dataset
    from orchestrate.methods.custom.loss import loss_and_output
    from orchestrate.methods.custom.module import build_module
    from orchestrate.simulate.counter import LiveStorageCounter

    dataset = load_dataset(config)
    batch = collate([dataset[i] for i in range(micro)])
    torch.manual_seed(0)
    with LiveStorageCounter() as counter:  # real tensors: a real measurement
        model = build_module(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)  # the worker's CPU AdamW
        for _ in range(3):
            loss, _out = loss_and_output(model, batch, config.train.loss)
            loss.backward()
            del loss, _out
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return counter.peak


@pytest.mark.parametrize(("model", "data", "micro"), [
    ({"module": "cnn_example:CNN"}, {"module": "cnn_example:patterns", "kwargs": {"size": 64}}, 32),
    ({"module": f"{HELPERS}:ResMLP", "kwargs": {"width": 256, "depth": 4}}, {"module": f"{HELPERS}:rule"}, 16),
])
def test_analytical_total_matches_a_real_cpu_step_within_ten_percent(model, data, micro):
    from orchestrate.planner.memory import estimate_memory
    from orchestrate.planner.strategy import Strategy
    from tests.helpers.plans import cpu_hardware

    config = _config(model, data, {"global_batch_size": micro})
    predicted = estimate_memory(shape_for(config), cpu_hardware(1),
                                Strategy("ddp", 0, "none", "none", "fp32", False, micro), 1).gpu_total
    real = _real_peak(config, micro)
    print(f"{model['module']}: predicted {predicted:,} B, real {real:,} B, real/predicted {real / predicted:.3f}")
    assert abs(real - predicted) <= 0.10 * real


def test_custom_objective_cross_entropy_own_loss_and_accuracy():
    from orchestrate.methods.custom.data import collate
    from orchestrate.methods.custom.objective import CustomObjective
    from tests.helpers.custom_modules import ResMLP, Rule, WithOwnLoss

    data = Rule(size=16)
    batch = collate([data[i] for i in range(16)])
    torch.manual_seed(0)
    plain, own = ResMLP(), WithOwnLoss()
    own.load_state_dict(plain.state_dict())
    ce = CustomObjective("cross_entropy").loss(plain, batch)
    assert torch.allclose(ce, torch.nn.functional.cross_entropy(plain(batch["features"]), batch["labels"]))
    assert torch.allclose(CustomObjective("auto").loss(own, batch), ce)  # auto: the model's own loss
    sums = CustomObjective("model").eval_sums(own, batch)
    expected = float((plain(batch["features"]).argmax(-1) == batch["labels"]).sum())
    assert sums["correct"] == expected and sums["count"] == 16
    metrics = CustomObjective("model").metrics(sums, 1)
    assert metrics["eval_accuracy"] == expected / 16 and metrics["eval_loss"] == pytest.approx(float(ce.detach()))
    with pytest.raises(TypeError, match="no `loss`"):
        CustomObjective("model").loss(plain, batch)


def test_tuple_samples_become_positional_inputs_and_labels():
    from orchestrate.methods.custom.data import collate, split

    sys.path.insert(0, str(EXAMPLE))
    try:
        from cnn_example import CNN, patterns
    finally:
        sys.path.remove(str(EXAMPLE))
    dataset = patterns(size=20)
    batch = collate([dataset[i] for i in range(4)])
    assert set(batch) == {"_0", "labels"} and batch["_0"].shape == (4, 1, 28, 28)
    from orchestrate.methods.custom.loss import call

    assert call(CNN(), batch, with_labels=False).shape == (4, 10)
    train, validation = split(dataset, 0.25, seed=0)
    assert len(train) == 15 and len(validation) == 5
    assert not set(train.indices.tolist()) & set(validation.indices.tolist())


def test_module_data_resumes_at_the_exact_sample():
    from types import SimpleNamespace

    from orchestrate.methods.custom.train_data import build_module_data

    config = _config({"module": f"{HELPERS}:ResMLP"}, {"module": f"{HELPERS}:rule", "kwargs": {"size": 40}})
    plan = SimpleNamespace(config=config)
    first = build_module_data(plan, rank=1, world_size=2)
    assert len(first.train) + len(first.validation) == 40 and len(first.validation) == 2  # validation_ratio 0.05
    for _ in range(5):  # across an epoch end: 5 x 2 ranks x 4 > 38
        first.micro_batch(4)
    state = first.sampler.state_dict()
    expected = first.micro_batch(4)
    resumed = build_module_data(plan, rank=1, world_size=2)
    resumed.sampler.load_state_dict(state)
    got = resumed.micro_batch(4)
    assert torch.equal(got["features"], expected["features"]) and torch.equal(got["labels"], expected["labels"])
