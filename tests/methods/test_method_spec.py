"""The training methods' spec (orchestrate/methods): which methods a config asks for, the composition
rule each method states (`base`, `bases`, `objective`) against what planning does, and that the
memory breakdown holds exactly the keys `breakdown_keys` names for the plan's methods."""

from __future__ import annotations

from dataclasses import replace

import pytest

from orchestrate.config.load import config_from_dict
from orchestrate.errors import UserError
from orchestrate.hardware.profile import HardwareProfile
from orchestrate.methods.registry import active_methods, base_method, method_data, method_terms, methods
from orchestrate.model.formulas import shape_from_dict
from orchestrate.planner.memory import breakdown_keys, estimate_memory
from orchestrate.planner.strategy import Strategy
from orchestrate.planner.terms import trains_under
from orchestrate.planning import weigh

LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 64}
BASES = {"full": {}, "lora": {"train": {"method": "lora"}}, "qlora": {"train": {"method": "qlora"}}}
ADDONS = {"distill": {"distill": {"teacher": "t"}},
          "preference": {"preference": {"loss": "dpo"}},
          "prune": {"prune": {"target_sparsity": 0.5, "schedule": {"end_step": 10}}}}
CPU = HardwareProfile(name="cpu", gpus_per_node=0, cpu_processes=2, cpu_memory_bytes=64 * 2**30, cpu_cores=2)


def _config(*parts: dict):
    data = {"model": {"architecture": dict(LLAMA)}, "train": {"seq_len": 32, "global_batch_size": 4, "max_steps": 20}}
    for part in parts:
        for section, values in part.items():
            data.setdefault(section, {}).update(values)
    return config_from_dict(data)


def test_each_config_has_one_base_method_and_its_add_ons_in_hook_order():
    assert [m.name for m in methods()][:7] == ["full", "lora", "distill", "preference", "grpo", "prune", "custom"]
    assert sum(m.base for m in methods()) == 3 and sum(m.objective for m in methods()) == 3
    config = _config(BASES["qlora"], ADDONS["distill"])
    assert base_method(config).name == "lora"
    assert [m.name for m in active_methods(config)] == ["lora", "distill"]
    assert [m.name for m in active_methods(_config(ADDONS["prune"]))] == ["full", "prune"]


@pytest.mark.parametrize("base", sorted(BASES))
@pytest.mark.parametrize("addon", sorted(ADDONS))
def test_an_add_on_plans_with_exactly_the_bases_it_names(base, addon):
    config = _config(BASES[base], ADDONS[addon])
    method = next(m for m in methods() if m.name == addon)
    shape = shape_from_dict(dict(LLAMA))
    composes = base_method(config).name in method.bases
    if composes:  # QLoRA + distillation, and every add-on on full fine-tuning
        plan = weigh(config, CPU, shape, {"teacher": shape})
        assert plan.candidates
    else:  # LoRA / QLoRA + pruning: the base is frozen
        with pytest.raises(UserError, match="freezes the weights pruning would zero"):
            weigh(config, CPU, shape, {"teacher": shape})


@pytest.mark.parametrize("addon", sorted(ADDONS))
def test_no_add_on_composes_with_your_own_module(addon):
    assert "custom" not in next(m.bases for m in methods() if m.name == addon)
    with pytest.raises(UserError, match="not model.module"):
        config_from_dict({"model": {"module": "tests.helpers.custom_modules:ResMLP"},
                          "data": {"module": "tests.helpers.custom_modules:rule"},
                          "train": {"seq_len": 32, "global_batch_size": 4, "max_steps": 20}, **ADDONS[addon]})


@pytest.mark.parametrize("parts", [(), (BASES["qlora"],), (BASES["lora"], ADDONS["distill"]), (ADDONS["prune"],),
                                   (ADDONS["distill"], ADDONS["prune"]), (BASES["qlora"], ADDONS["preference"]),
                                   (ADDONS["preference"],)],
                         ids=["full", "qlora", "lora+distill", "prune", "distill+prune", "qlora+preference",
                              "preference"])
def test_the_breakdown_holds_the_keys_its_methods_declare(parts):
    config, shape = _config(*parts), shape_from_dict(dict(LLAMA))
    terms = method_terms(config, shape, CPU, {"teacher": shape})
    terms = [replace(t, auxiliary=tuple(m.choices(CPU)[0] for m in t.auxiliary)) for t in terms]  # "auto": a placement
    for strategy in (Strategy("ddp", 0, "none", "none", "fp32", False, 2),
                     Strategy("fsdp", 3, "none", "none", "fp32", True, 1)):
        if not all(trains_under(t, strategy.sharding) for t in terms):
            continue
        mem = estimate_memory(shape, CPU, strategy, 32, 1, terms)
        assert (tuple(mem.gpu), tuple(mem.cpu)) == breakdown_keys(terms)


def test_a_method_hands_the_data_path_its_own_records_as_values():
    """The preference method brings the reader of its records (the data pipeline names no method);
    a config without one brings nothing, and its preference records are refused."""
    plain, preference = method_data(_config()), method_data(_config(ADDONS["preference"]))
    assert plain.readers == () and plain.own is None
    assert [r.formats for r in preference.readers] == [("preference", "unpaired-preference")]
    assert preference.reader("preference") is preference.readers[0] and preference.reader("chat") is None
    preference.check_records("preference", "data.train_files")  # dpo trains on pairs
    with pytest.raises(UserError, match="trains on preference records"):
        preference.check_records("unpaired-preference", "data.train_files")
    with pytest.raises(UserError, match="the records are preference records"):
        plain.check_records("preference", "data.train_files")
