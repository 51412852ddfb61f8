"""Your own loop planned from your own nn.Module: `model.module` + `model.example_input`
without data.module, the activations measured on fake inputs of those shapes, and `prepare`
refusing a module that is not the planned one. The 2-rank runs are in test_own_loop_e2e.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from orchestrate import api
from orchestrate.config.load import config_from_dict, load_config
from orchestrate.errors import UserError
from orchestrate.loop_api.session import _check_size
from orchestrate.model.meta import shape_for
from orchestrate.planner.plan import RunPlan
from tests.helpers.plans import cpu_hardware

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "own_loop"
HELPERS = "tests.helpers.custom_modules"
LABELS = {"shape": [], "dtype": "int64"}


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def _config(model: dict, data: dict | None = None, **train):
    model = {"trust_remote_code": True, **model}  # the opt-in to run model.module (tests/unit/config/test_code_opt_in.py)
    return config_from_dict({"model": model, "data": data or {},
                             "train": {"seq_len": 1, "global_batch_size": 8, **train}}, EXAMPLE)


def _messages(exc: pytest.ExceptionInfo) -> list[str]:
    return [f"{p.where}: {p.message}" for p in exc.value.problems]


def test_example_input_shorthand_and_full_form():
    config = _config({"module": f"{HELPERS}:ResMLP", "example_input": {"features": [16], "labels": LABELS}})
    inputs = config.model.example_input
    assert (inputs["features"].shape, inputs["features"].dtype) == ([16], "float32")
    assert (inputs["labels"].shape, inputs["labels"].dtype) == ([], "int64")


@pytest.mark.parametrize(("model", "data", "words"), [
    ({"architecture": {"model_type": "gpt2"}, "example_input": {"x": [16]}}, {}, "set model.module"),
    ({"module": f"{HELPERS}:ResMLP", "example_input": {"features": [16]}}, {"module": f"{HELPERS}:Rule"},
     "keep one"),
    ({"module": f"{HELPERS}:ResMLP", "example_input": {"features": [0]}}, {}, "at least 1"),
    ({"module": f"{HELPERS}:ResMLP", "example_input": {"features": {"shape": [16], "dtype": "float64"}}}, {},
     "float32"),
])
def test_bad_example_input_is_one_user_error(model, data, words):
    with pytest.raises(UserError) as exc:
        _config(model, data)
    assert any(words in m for m in _messages(exc)), _messages(exc)


def test_example_input_with_labels_measures_what_the_dataset_measures():
    """The same shapes from data.module's samples or from example_input: the same bytes."""
    from_data = shape_for(_config({"module": f"{HELPERS}:ResMLP"}, {"module": f"{HELPERS}:Rule"},
                                  loss="cross_entropy"))
    from_shapes = shape_for(_config({"module": f"{HELPERS}:ResMLP",
                                     "example_input": {"features": [16], "labels": LABELS}}, loss="cross_entropy"))
    assert from_shapes.activation_bytes_per_sample == from_data.activation_bytes_per_sample > 0
    assert from_shapes.activation_bytes_fixed == from_data.activation_bytes_fixed
    assert from_shapes.parameters == from_data.parameters and from_shapes.block_classes == ("Block",)


def test_without_labels_the_output_sum_stands_for_the_scripts_loss():
    with_labels = shape_for(_config({"module": f"{HELPERS}:ResMLP",
                                     "example_input": {"features": [16], "labels": LABELS}}, loss="cross_entropy"))
    plain = shape_for(_config({"module": f"{HELPERS}:ResMLP", "example_input": {"features": [16]}}))
    # ResMLP(width 32, depth 3) saves at least each Block's 4*32-wide hidden (fp32) per sample.
    assert 3 * 4 * 32 * 4 <= plain.activation_bytes_per_sample <= with_labels.activation_bytes_per_sample


def test_the_example_input_is_part_of_the_cache_fingerprint():
    from orchestrate.methods.custom.activations import fingerprint
    from tests.helpers.custom_modules import ResMLP

    def key(example_input: dict) -> str:
        return fingerprint(_config({"module": f"{HELPERS}:ResMLP", "example_input": example_input}), ResMLP, None)

    assert key({"features": [16]}) == key({"features": {"shape": [16]}})
    assert key({"features": [16]}) != key({"features": [2, 16]})
    assert key({"features": [16]}) != key({"features": {"shape": [16], "dtype": "bfloat16"}})


def test_a_module_that_does_not_run_on_the_example_input_names_it():
    with pytest.raises(UserError) as exc:
        shape_for(_config({"module": f"{HELPERS}:ResMLP", "example_input": {"features": [15]}}))
    assert "model.example_input" in exc.value.problems[0].message, _messages(exc)


def test_without_data_module_or_example_input_the_error_names_both():
    with pytest.raises(UserError) as exc:
        shape_for(_config({"module": f"{HELPERS}:ResMLP"}))
    problem = exc.value.problems[0]
    assert problem.where == "data.module" and "model.example_input" in problem.fix


def test_the_example_plans_its_own_net_and_the_builtin_worker_still_needs_data_module(tmp_path: Path):
    import sys

    config = load_config(EXAMPLE / "model.yaml", [f"train.output_dir={tmp_path}"])
    sys.path.insert(0, str(EXAMPLE))
    try:
        from train import Net  # examples/own_loop/train.py, the module the script trains
    finally:
        sys.path.remove(str(EXAMPLE))
    plan = api.plan_for(config, cpu_hardware(2))
    assert plan.shape.parameters == sum(p.numel() for p in Net().parameters()) == 19_204
    assert plan.shape.activation_bytes_per_sample > 0 and isinstance(plan, RunPlan)
    from orchestrate.methods.custom.method import CUSTOM

    assert "one micro-batch of model.example_input" in CUSTOM.report(plan)[0][0]
    with pytest.raises(UserError, match="needs data.module"):  # no program after `--`: the worker has no data
        api.launch(api.launch_request(config, cpu_hardware(2), dry_run=True, run_dir=tmp_path / "plain"))


def _plan(module: str | None, parameters: int) -> SimpleNamespace:
    return SimpleNamespace(shape=SimpleNamespace(parameters=parameters),
                           config=SimpleNamespace(model=SimpleNamespace(module=module)))


def test_prepare_refuses_another_module_than_the_planned_one(capsys):
    _check_size(_plan("train:Net", 19_204), 19_204, warn=True)
    with pytest.raises(UserError) as exc:
        _check_size(_plan("train:Net", 19_204), 19_205, warn=True)
    assert "train:Net with 19,204 parameters" in exc.value.problems[0].message
    assert "has 19,205" in exc.value.problems[0].message and exc.value.problems[0].where == "model.module"
    assert capsys.readouterr().out == ""


def test_prepare_warns_when_a_stand_in_model_is_far_from_the_module(capsys):
    _check_size(_plan(None, 20_000), 19_204, warn=True)
    assert capsys.readouterr().out == ""
    _check_size(_plan(None, 20_000), 50_000, warn=False)  # not rank 0: silent
    assert capsys.readouterr().out == ""
    _check_size(_plan(None, 20_000), 50_000, warn=True)
    assert "warning: the plan's memory estimate is for the YAML's model (20,000 parameters)" in capsys.readouterr().out


def _example_script():
    import importlib
    import sys

    sys.path.insert(0, str(EXAMPLE))
    try:
        return importlib.import_module("train")  # examples/own_loop/train.py, the script the YAML plans
    finally:
        sys.path.remove(str(EXAMPLE))


def test_analytical_total_matches_the_scripts_real_cpu_step_within_ten_percent():
    """The plan (activations measured on zeros of example_input, output-sum loss) against 3 real
    fp32 steps of the script's own code: Net, its nll_loss on real data, Adam. At 256 samples the
    activations are 70 % of the total. (At 8 samples the real peak is 1.43x the plan: it is then
    Adam's step, whose foreach=False temporaries for the largest weight the CPU term omits.)"""
    micro = 256
    import torch.nn.functional as F

    from orchestrate.planner.memory import estimate_memory
    from orchestrate.planner.strategy import Strategy
    from orchestrate.simulate.counter import LiveStorageCounter

    script = _example_script()
    config = load_config(EXAMPLE / "model.yaml", [f"train.global_batch_size={micro}", f"train.micro_batch_size={micro}"])
    predicted = estimate_memory(shape_for(config), cpu_hardware(1),
                                Strategy("ddp", 0, "none", "none", "fp32", False, micro), 1).gpu_total
    data = script.generated_data(micro)
    x, y = data.tensors
    torch.manual_seed(0)
    with LiveStorageCounter() as counter:  # real tensors: a real measurement
        model = script.Net()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
        for _ in range(3):
            optimizer.zero_grad(set_to_none=True)
            loss = F.nll_loss(model(x), y)
            loss.backward()
            del loss
            optimizer.step()
    real = counter.peak
    print(f"micro {micro}: predicted {predicted:,} B, real {real:,} B, real/predicted {real / predicted:.3f}")
    assert abs(real - predicted) <= 0.10 * real


@pytest.mark.slow
def test_a_launched_script_with_another_module_stops_in_prepare_with_the_numbers(tmp_path: Path):
    """Through the real launcher, one gloo rank: the script builds Net(hidden=64), the YAML plans Net()."""
    script = tmp_path / "other.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(EXAMPLE)!r})\n"
                      "import torch\nimport orchestrate\nfrom train import Net\n"
                      "model = Net(hidden=64)\n"
                      "orchestrate.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))\n"
                      "print('prepared', flush=True)\n")
    config = load_config(EXAMPLE / "model.yaml", [f"train.output_dir={tmp_path}", "train.global_batch_size=8"])
    program = ("python", str(script))
    result = api.launch(api.launch_request(config, cpu_hardware(1), run_dir=tmp_path / "run", program=program))
    assert result.exit_code != 0
    err = "".join(log.read_text() for log in (tmp_path / "run").glob("logs/*/attempt_*/0/std*.log"))
    assert "the plan is for train:Net with 19,204 parameters; the module given to prepare has 5,508" in err, err
    assert "prepared" not in err and "Traceback" not in err
