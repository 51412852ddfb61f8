"""How the planner prices a preference run, and the bad inputs it refuses: two sequences per record in
the activations and logits; the reference placed per candidate (auto: adapter under LoRA / QLoRA, else
the first of replicated, sharded, offload, precomputed that fits, saying why); the plan names the
longest seq_len that fits; a placement the run cannot hold, or a reference with another tokenizer, is
one error naming every YAML path with a fix."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from orchestrate.backends.registry import runs_knob
from orchestrate.config.load import config_from_dict
from orchestrate.hardware.flags import HardwareFlags
from orchestrate.methods.preference.memory import REFERENCE, reference_model
from orchestrate.methods.preference.method import PREFERENCE, preference_terms
from orchestrate.methods.registry import method_terms
from orchestrate.model.formulas import shape_from_dict
from orchestrate.planner.memory import estimate_memory
from orchestrate.planner.plan import Refusal
from orchestrate.planner.search import Limits, _candidate
from orchestrate.planning import plan_for, weigh
from tests.helpers.cli import assert_one_message, invoke
from tests.helpers.plans import TINY_GPT2, cpu_hardware
from tests.methods.lora.test_lora_plan import LLAMA3_8B
from tests.unit.planner.test_memory_model import strat

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
GPU_8GIB = HardwareFlags(gpus=1, gpu_mem="8GiB", cpu_mem="32GiB")


def _config(train: dict, preference: dict | None = None, model: dict | None = None, data: dict | None = None):
    raw = {"model": {"architecture": dict(model or LLAMA3_8B)}, "train": {"global_batch_size": 8, **train},
           "data": {"packing": False, **(data or {})}}
    if preference is not None:
        raw["preference"] = preference
    return config_from_dict(raw)


def test_a_record_s_two_sequences_are_twice_the_micro_batch_s_activations_and_logits():
    shape, hw = shape_from_dict(dict(LLAMA3_8B)), GPU_8GIB.resolve()
    pair, doubled = strat(micro=2), strat(micro=4)
    terms = preference_terms(reference_model(shape, "precomputed", adapter=False), packed=False)
    dpo = estimate_memory(shape, hw, pair, 1024, methods=[terms])
    sft = estimate_memory(shape, hw, doubled, 1024)
    assert dpo.gpu["activations"] == sft.gpu["activations"] and dpo.gpu["logits"] == sft.gpu["logits"]
    assert dpo.gpu["reference_weights"] == 0 and dpo.gpu["reference_logits"] > 0  # the cached log-probs


def test_llama3_8b_dpo_with_qlora_on_one_8gib_card_names_its_longest_seq_len_and_the_adapter_reference():
    # Llama-3.1's positions: with every knob the planner has, DPO reaches past Llama-3's 8192 on this card
    llama31 = {**LLAMA3_8B, "max_position_embeddings": 131_072}
    shape, hw = shape_from_dict(dict(llama31)), GPU_8GIB.resolve()
    plan = weigh(_config({"method": "qlora", "seq_len": 1024}, {"loss": "dpo"}, llama31), hw, shape)
    assert not isinstance(plan, Refusal) and plan.chosen.placements[REFERENCE] == "adapter"
    assert plan.chosen.memory.gpu["reference_weights"] == 0
    chunked = [c for c in plan.candidates if c.strategy.loss_chunks > 0]
    assert chunked and all(runs_knob(c.strategy.backend, "loss_chunks") for c in chunked)  # log-probs in chunks
    note = next(n for n in plan.notes if n.startswith("the longest train.seq_len"))
    found = re.search(r"the longest train.seq_len that fits: (\d+) \((\S+)\)", note)
    longest, name = int(found.group(1)), found.group(2)
    at = {s: weigh(_config({"method": "qlora", "seq_len": s}, {"loss": "dpo"}, llama31), hw, shape)
          for s in (longest, longest + 64)}
    assert any(c.fits and c.name == name and c.placements[REFERENCE] == "adapter" for c in at[longest].candidates)
    assert plan.strategy.loss_chunks > 0  # at 1024 the fastest plan takes the log-probs in chunks
    assert isinstance(at[longest + 64], Refusal)  # no strategy fits 64 tokens more
    assert 8192 < longest < 131_072
    sft = weigh(_config({"method": "qlora", "seq_len": longest + 64}, model=llama31), hw, shape)
    assert not isinstance(sft, Refusal)  # one sequence per sample: SFT fits where DPO no longer does


def test_auto_takes_the_first_placement_that_fits_and_says_why():
    llama_1b = {"model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 22, "num_attention_heads": 32,
                "num_key_value_heads": 4, "intermediate_size": 5632, "vocab_size": 32000,
                "max_position_embeddings": 2048}
    shape, hw = shape_from_dict(dict(llama_1b)), GPU_8GIB.resolve()
    plan = weigh(_config({"method": "full", "seq_len": 512}, {"loss": "dpo"}, llama_1b), hw, shape)
    chosen = plan.chosen
    assert chosen.placements[REFERENCE] != "replicated"
    assert "replicated does not fit (GPU" in chosen.placement_reason
    assert "replicated does not fit" in PREFERENCE.report(plan)[0][0]  # what `orchestrate plan` prints
    config = _config({"method": "full", "seq_len": 512}, {"loss": "dpo", "placement": "replicated"}, llama_1b)
    replicated = _candidate(shape, hw, chosen.strategy, 512, chosen.gradient_accumulation, Limits.of(config, hw),
                            method_terms(config, shape, hw))
    assert not replicated.fits and replicated.reason in chosen.placement_reason  # what auto said


@pytest.mark.parametrize("free", ["orpo", "simpo"])
def test_full_fine_tuning_on_cpu_ranks_replicates_the_reference_and_the_reference_free_losses_have_none(free):
    hw = cpu_hardware(2)
    tiny = {"seq_len": 32, "micro_batch_size": 2}
    dpo = plan_for(_config({"method": "full", **tiny}, {"loss": "dpo"}, TINY_GPT2), hw)
    assert dpo.chosen.placements[REFERENCE] == "replicated" and dpo.chosen.memory.gpu["reference_weights"] > 0
    plan = plan_for(_config({"method": "full", **tiny}, {"loss": free}, TINY_GPT2), hw)
    assert REFERENCE not in plan.chosen.placements and "reference_weights" not in plan.chosen.memory.gpu
    assert "reference_forward" not in plan.chosen.memory.gpu
    assert PREFERENCE.report(plan)[0] == [f"preference: {free}, no reference model"]


def _yaml(tmp_path: Path, preference: dict, train: dict | None = None) -> Path:
    import yaml

    config = {"model": {"architecture": dict(TINY_GPT2)},
              "train": {"seq_len": 32, "global_batch_size": 8, "method": "full", **(train or {})},
              "preference": preference}
    path = tmp_path / "dpo.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_placements_the_run_cannot_hold_are_one_error_with_every_path(tmp_path):
    result = invoke("plan", _yaml(tmp_path, {"placement": "adapter", "reference": str(tmp_path)}), "--gpus", 1)
    assert_one_message(result, "preference.placement", "train.method: lora or qlora", "drop preference.reference")
    result = invoke("plan", _yaml(tmp_path, {"placement": "offload"}), "--gpus", 2)
    assert_one_message(result, "preference.placement", "CPU processes", "use replicated, sharded or precomputed")


def _reference_dir(tmp_path: Path, vocab: int) -> Path:
    from transformers import GPT2Config

    from orchestrate.data.tokenizer import byte_tokenizer_fast

    path = tmp_path / "reference"
    GPT2Config(**{k: v for k, v in TINY_GPT2.items() if k not in ("model_type", "vocab_size")}, vocab_size=vocab).save_pretrained(path)
    tok = byte_tokenizer_fast()
    tok.add_tokens(["<extra>"])  # another tokenizer than the model's byte tokenizer
    tok.save_pretrained(path)
    return path


def test_a_reference_with_another_tokenizer_and_vocabulary_is_refused_with_both_problems(tmp_path):
    reference = _reference_dir(tmp_path, vocab=300)
    result = invoke("plan", _yaml(tmp_path, {"reference": str(reference)}), "--gpus", 2)
    assert_one_message(result, "preference.reference", "data.tokenizer", "300 ids", "the trained model's 257")


@pytest.mark.parametrize("placement", ["sharded", "precomputed"])
def test_the_chosen_placement_is_in_plan_json(tmp_path, placement):
    result = invoke("plan", _yaml(tmp_path, {"placement": placement}), "--gpus", 2, "--json")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    chosen = next(c for c in plan["candidates"] if c["name"] == plan["chosen"])
    assert chosen["reference_placement"] == placement


def test_a_step_s_tokens_count_both_sequences_of_every_record():
    from orchestrate.planner.strategy import tokens_per_step

    hw, tiny = cpu_hardware(2), {"method": "full", "seq_len": 32, "micro_batch_size": 2}
    dpo = plan_for(_config(tiny, {"loss": "dpo"}, TINY_GPT2), hw)
    one = tokens_per_step(dpo.strategy, dpo.chosen.gradient_accumulation, hw.world_size, 32)
    assert dpo.tokens_per_step == 2 * one  # the intro line's and the step records' tokens
    speed = dpo.chosen.speed
    assert speed.tokens_per_s * speed.step_time_s == pytest.approx(dpo.tokens_per_step)  # the speed model's too


def test_a_resume_with_another_preference_loss_or_reference_is_refused():
    from orchestrate.run.resume_rules import config_changes

    then = _config({"method": "full", "seq_len": 32}, {"loss": "dpo"}, TINY_GPT2)
    now = _config({"method": "full", "seq_len": 32}, {"loss": "ipo", "beta": 0.2}, TINY_GPT2)
    applied, problems = config_changes(then, now)
    assert not applied and sorted(p.where for p in problems) == ["preference.beta", "preference.loss"]


def test_the_method_names_its_metrics_for_trackers_and_sums_its_rewards_for_the_report():
    """The rewards reach TensorBoard/wandb/MLflow tags and `orchestrate report` through the method's own
    hooks (metric_keys, run_summary), not through preference code in worker/ or report/."""
    from types import SimpleNamespace

    from orchestrate.worker.scalars import step_scalars

    dpo, plain = _config({"method": "full", "seq_len": 64}, {"loss": "dpo"}), _config({"method": "full", "seq_len": 64})
    first = {"step": 1, "loss": 0.69, "rewards/chosen": 0.0, "rewards/margins": 0.0, "rewards/accuracies": 0.0}
    last = {"step": 9, "loss": 0.2, "rewards/chosen": 1.5, "rewards/margins": 2.25, "rewards/accuracies": 1.0,
            "eval_loss": 0.3, "eval_rewards/margins": 1.75, "eval_rewards/accuracies": 0.9, "logps/chosen": -3.0}
    scalars = step_scalars(last, SimpleNamespace(config=dpo))
    assert scalars["train/rewards/margins"] == 2.25 and scalars["eval/rewards/accuracies"] == 0.9
    assert scalars["train/logps/chosen"] == -3.0 and scalars["eval/loss"] == 0.3
    assert not [tag for tag in step_scalars(last, SimpleNamespace(config=plain)) if "rewards" in tag or "logps" in tag]
    assert PREFERENCE.run_summary(dpo, [first, last]) == [
        "- rewards (dpo): chosen 0.0000 -> 1.5000; margins 0.0000 -> 2.2500; accuracies 0.0000 -> 1.0000",
        "- held-out rewards at step 9: margins 1.7500; accuracies 0.9000"]
    assert PREFERENCE.run_summary(dpo, [{"step": 1, "loss": 1.0}]) == []


@pytest.mark.parametrize("packing", [False, True])
def test_plan_simulate_trains_a_pair_as_the_plan_prices_it(packing):
    """The simulation's training micro-batch is the forward the planner priced: a pair's two sequences as
    two rows, or packed into one row twice as long; the reference copy's weights, which it does not build,
    are taken from the plan (simulate/verify.py)."""
    from orchestrate import api
    from orchestrate.simulate.run_spec import spec_from_plan
    from orchestrate.simulate.verify import _unseen

    plan = api.plan_from_file(EXAMPLES / "preference" / "model.yaml", [f"data.packing={str(packing).lower()}",
                                                                       "preference.placement=replicated"],
                              cpu_hardware(1))
    spec = spec_from_plan(plan)
    mb, seq = plan.strategy.micro_batch_size, plan.config.train.seq_len
    assert (spec.rows, spec.seq_len) == ((None, 2 * seq) if packing else (2 * mb, seq))
    unseen = _unseen(plan, plan.chosen.memory.gpu)
    assert unseen.get("reference_weights", 0) > 0 and unseen["reference_weights"] == plan.chosen.memory.gpu["reference_weights"]
