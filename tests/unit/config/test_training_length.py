"""How long a run trains: `train.max_steps` or `train.num_epochs`, exactly one (each wrong mix is one
problem with its YAML path and a fix); num_epochs gives the steps transformers' Trainer would count
for the same data and batch; what is written out (plan.json, a checkpoint's plan copy) is the length as
the user gave it, and a config without num_epochs dumps as before it existed; the plan says the steps
are resolved at prepare. Also which configs NEFTune (`train.neftune_noise_alpha`) is refused with."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from orchestrate import api
from orchestrate.config.describe import describe_schema
from orchestrate.config.load import config_from_dict
from orchestrate.errors import UserError
from orchestrate.hardware.flags import HardwareFlags
from tests.helpers.plans import TINY_GPT2


def _config(train: dict | None = None, **sections):
    return config_from_dict({"model": {"architecture": dict(TINY_GPT2)},
                             "train": {"seq_len": 32, "global_batch_size": 8, **(train or {})}, **sections})


def _problems(train: dict | None = None, **sections) -> list:
    with pytest.raises(UserError) as refused:
        _config(train, **sections)
    return refused.value.problems


def test_max_steps_by_default_num_epochs_instead_and_fractional():
    assert (_config().train.max_steps, _config().train.num_epochs) == (100, None)
    epochs = _config({"num_epochs": 1.5}).train
    assert (epochs.max_steps, epochs.num_epochs) == (None, 1.5)
    assert epochs.length() == "1.5 epochs (steps resolved at prepare)"
    assert _config({"max_steps": 7}).train.length() == "7 steps"


@pytest.mark.parametrize(("train", "message"), [
    ({"max_steps": 10, "num_epochs": 2}, "give train.max_steps (10) or train.num_epochs (2), not both"),
    ({"max_steps": None}, "give train.max_steps or train.num_epochs: how long to train"),
])
def test_both_or_neither_is_one_problem_naming_the_key_and_the_fix(train, message):
    (problem,) = _problems(train)
    assert problem.where == "train.num_epochs" and problem.message == message
    assert "train.max_steps=null" in problem.fix


@pytest.mark.parametrize("epochs", [0, -1, True, "2"])
def test_num_epochs_is_a_positive_number(epochs):
    (problem,) = _problems({"num_epochs": epochs})
    assert problem.where == "train.num_epochs"


def _hf_max_steps(tmp_path, samples: int, micro: int, accumulation: int, epochs: float) -> int:
    """transformers' own count: `Trainer.set_initial_training_values` over a DataLoader of `samples`
    at per-device batch `micro` on one process (its other inputs stubbed as the Trainer computes them)."""
    from torch.utils.data import DataLoader
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=micro, report_to=[],
                             gradient_accumulation_steps=accumulation, num_train_epochs=epochs, max_steps=-1)
    trainer = SimpleNamespace(get_total_train_batch_size=lambda a: micro * accumulation, get_sp_size=lambda: 1,
                              num_examples=lambda loader: len(loader.dataset))
    return Trainer.set_initial_training_values(trainer, args, DataLoader(list(range(samples)), batch_size=micro))[-1]


@pytest.mark.parametrize(("samples", "micro", "accumulation", "epochs"), [
    (100, 4, 2, 1), (100, 4, 2, 3), (101, 4, 2, 1), (7, 4, 4, 2), (1000, 8, 1, 0.25), (999, 3, 5, 2.5), (5, 8, 2, 1),
])
def test_num_epochs_counts_the_steps_as_the_hf_trainer(tmp_path, samples, micro, accumulation, epochs):
    train = _config({"num_epochs": epochs, "global_batch_size": micro * accumulation}).train
    resolved = train.resolved(samples)
    assert resolved.max_steps == _hf_max_steps(tmp_path, samples, micro, accumulation, epochs)
    assert resolved.length() == f"{epochs:g} epoch{'' if epochs == 1 else 's'} = {resolved.max_steps} steps"


def test_what_is_written_out_is_the_length_as_given():
    epochs = _config({"num_epochs": 2}).train
    written = epochs.model_dump(mode="json")
    assert written["num_epochs"] == 2 and "max_steps" not in written
    assert epochs.resolved(50).model_dump(mode="json") == written  # a worker's resolved count stays in the worker
    assert config_from_dict({"model": {"architecture": dict(TINY_GPT2)}, "train": written}).train == epochs
    steps = _config({"max_steps": 9}).train.model_dump(mode="json")
    assert steps["max_steps"] == 9 and "num_epochs" not in steps and "neftune_noise_alpha" not in steps


def test_the_plan_says_the_steps_are_resolved_at_prepare(tmp_path):
    config = tmp_path / "model.yaml"
    config.write_text("model: {architecture: {model_type: gpt2, n_embd: 64, n_layer: 2, n_head: 4}}\n"
                      "train: {seq_len: 64, global_batch_size: 8, num_epochs: 3}\n")
    plan = api.plan_from_file(config, [], HardwareFlags(calibration=False).resolve())
    (note,) = [n for n in plan.notes if n.startswith("length:")]
    assert note == ("length: 3 epochs (steps resolved at prepare): ceil(num_epochs x ceil(training samples / "
                    "global_batch_size 8))")
    rendered = api.render_plan(plan)["config"]["train"]
    assert rendered["num_epochs"] == 3 and "max_steps" not in rendered


def test_orchestrate_schema_lists_the_new_keys():
    text = describe_schema()
    for key in ("train.num_epochs", "train.neftune_noise_alpha", "data.last_turn_only"):
        assert f"\n{key}  (" in text, key


@pytest.mark.parametrize(("sections", "says"), [
    ({"preference": {"beta": 0.1}}, "preference: and grpo:"),
    ({"grpo": {"rewards": [{"kind": "length", "target_tokens": 8}]}}, "preference: and grpo:"),
])
def test_neftune_is_refused_where_a_reference_would_see_no_noise(sections, says):
    (problem,) = _problems({"neftune_noise_alpha": 5.0}, **sections)
    assert problem.where == "(top level)" and says in problem.message
    assert _config({"neftune_noise_alpha": 5.0}).train.neftune_noise_alpha == 5.0


def test_neftune_needs_a_positive_alpha():
    (problem,) = _problems({"neftune_noise_alpha": 0})
    assert problem.where == "train.neftune_noise_alpha"
