"""The preference objective on real tiny models, in one process: a packed batch gives every answer the
log-probability it has padded alone (attention stays within each sequence, for every family packing
is planned for), the objective's loss is the loss of the log-probabilities computed apart, the
adapter placement's reference is the base model, and the logged metrics are TRL's means."""

from __future__ import annotations

import json

import pytest
import torch

from orchestrate.config.load import config_from_dict
from orchestrate.data.pipeline import prepare_data, samples_for
from orchestrate.methods.preference.config import REFERENCE_FREE, PreferenceSection
from orchestrate.methods.preference.losses import pair_loss
from orchestrate.methods.preference.objective import PreferenceObjective, answer_logps, step_metrics
from orchestrate.methods.preference.reference import adapter_reference, module_reference
from orchestrate.methods.registry import method_data
from tests.unit.data.test_sft_packing import FAMILIES as SFT_FAMILIES

FAMILIES = {name: SFT_FAMILIES[name] for name in ("gpt2", "llama", "qwen2")}  # tiny configs of the packing tests


def _pairs(n: int) -> list[dict]:
    return [{"prompt": f"Q{i}:", "chosen": "yes" * (1 + i % 3), "rejected": "no" * (1 + i % 4)} for i in range(n)]


def _views(tmp_path, packing: bool, loss: str = "dpo", rows: list[dict] | None = None):
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows or _pairs(6)))
    config = config_from_dict({"model": {"architecture": {"model_type": "gpt2", "n_embd": 32, "n_layer": 1,
                                                         "n_head": 2, "vocab_size": 257}},
                               "train": {"seq_len": 16, "global_batch_size": 2}, "preference": {"loss": loss},
                               "data": {"train_files": ["p.jsonl"], "packing": packing, "num_proc": 1,
                                        "validation_ratio": 0.0, "cache_dir": str(tmp_path / "cache")}}, tmp_path)
    methods = method_data(config)  # the preference method's reader of its records
    return samples_for(prepare_data(config, methods=methods), config, methods=methods)[0]


def _model(family: str, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(family, vocab_size=257, **FAMILIES[family])
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def _by_record(batch, logps) -> dict[int, tuple[float, float]]:
    n = batch["record_index"].numel()
    return {int(doc): (float(logps.logps[j]), float(logps.logps[n + j])) for j, doc in enumerate(batch["record_index"])}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_answers_have_the_log_probabilities_they_have_padded(tmp_path, family):
    model = _model(family)
    padded, packed = _views(tmp_path / "a", False), _views(tmp_path / "b", True)
    with torch.no_grad():
        alone = {}
        for k in range(padded.samples):
            batch = padded.batch([k])
            alone.update(_by_record(batch, answer_logps(model, batch)))
        batch = packed.batch(list(range(len(packed))))
        together = _by_record(batch, answer_logps(model, batch))
        leaked = answer_logps(model, {**batch, "position_ids": torch.arange(batch["input_ids"].shape[1]).expand_as(
            batch["input_ids"])})  # one stream: every sequence sees the ones before it
    assert batch["input_ids"].shape[0] < packed.samples  # records did share blocks
    assert together.keys() == alone.keys()
    assert max(abs(a - b) for k in alone for a, b in zip(alone[k], together[k], strict=True)) < 1e-5
    assert max(abs(a - b) for k in alone for a, b in zip(alone[k], _by_record(batch, leaked)[k], strict=True)) > 1e-3


@pytest.mark.parametrize("loss", ["dpo", "ipo", "robust", "hinge", "simpo", "orpo"])
def test_the_objective_is_the_loss_of_the_log_probabilities_computed_apart(tmp_path, loss):
    settings = PreferenceSection(loss=loss, **({"label_smoothing": 0.1} if loss == "robust" else {}),
                                 **({"rpo_alpha": 1.0} if loss != "orpo" else {}))
    model, reference = _model("llama", 0), _model("llama", 1)
    batch = _views(tmp_path, False).batch([0, 1, 2])
    free = loss in REFERENCE_FREE
    objective = PreferenceObjective(settings, None if free else module_reference(reference))
    got = objective.loss(model, batch)
    with torch.no_grad():
        ref = None if free else answer_logps(reference, batch)
    expected = pair_loss(settings, answer_logps(model, batch), ref)
    assert float(got.detach()) == pytest.approx(float(expected.loss), abs=1e-6)
    got.backward()  # the gradient reaches the model, not the reference
    assert next(model.parameters()).grad is not None and next(reference.parameters()).grad is None
    metrics = step_metrics({k: float(v) for k, v in objective.take_sums().items()}, loss)
    margins = expected.chosen_rewards - expected.rejected_rewards
    assert metrics["rewards/margins"] == pytest.approx(float(margins.mean()), abs=1e-6)
    assert metrics["rewards/accuracies"] == pytest.approx(float((margins > 0).float().mean()))
    assert metrics["nll_loss"] == pytest.approx(float(expected.extras["nll_loss"]), abs=1e-6)
    assert objective.take_sums() == {}


def test_the_adapter_placement_is_the_base_model(tmp_path):
    import peft

    base = _model("llama", 0)
    policy = peft.get_peft_model(_model("llama", 0), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_()  # a trained adapter: the policy differs from its base
    policy.train()
    batch = _views(tmp_path, True).batch([0, 1])
    with torch.no_grad():
        disabled = adapter_reference()(policy, batch)
        assert policy.training  # back to training after the reference's forward
        enabled = answer_logps(policy.eval(), batch)
        expected = answer_logps(base, batch)
    assert torch.allclose(disabled.logps, expected.logps, atol=1e-6)
    assert not torch.allclose(enabled.logps, expected.logps, atol=1e-3)


def test_kto_metrics_split_desirable_and_undesirable_answers(tmp_path):
    rows = [{"prompt": f"Q{i}:", "completion": "ab" * (1 + i), "label": i % 2 == 0} for i in range(4)]
    batch = _views(tmp_path, False, "kto", rows).batch([0, 1, 2, 3])
    objective = PreferenceObjective(PreferenceSection(loss="kto"), module_reference(_model("llama", 1)))
    loss = objective.loss(_model("llama", 0), batch)
    metrics = step_metrics({k: float(v) for k, v in objective.take_sums().items()}, "kto")
    assert torch.isfinite(loss) and metrics["kl"] >= 0
    assert metrics["rewards/margins"] == pytest.approx(metrics["rewards/chosen"] - metrics["rewards/rejected"])


def _answer_logp(model, ids: list[int], answer_from: int) -> float:
    """log π of ids[answer_from:] given what precedes it, the sequence alone, by hand from the logits."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double().log_softmax(-1)
    return sum(float(logits[t - 1, ids[t]]) for t in range(answer_from, len(ids)))


def test_kto_kl_is_the_clamped_mean_log_ratio_of_each_prompt_with_the_previous_records_answer(tmp_path):
    # TRL's KTOTrainer (_get_kl_dataset): each prompt with the completion of the record before it; z = max(0,
    # mean over them of log π − log π_ref), detached. Both orders of two models: one mean is positive.
    rows = [{"prompt": f"Q{i}:", "completion": "ab" * (1 + i), "label": i % 2 == 0} for i in range(4)]
    batch = _views(tmp_path, False, "kto", rows).batch([0, 1, 2, 3])
    ids, scored = batch["input_ids"].tolist(), (batch["labels"] != -100).tolist()
    prompts = [row[:s.index(True)] for row, s in zip(ids[:4], scored[:4], strict=True)]
    answers = [[t for t, keep in zip(row, s, strict=True) if keep] for row, s in zip(ids[:4], scored[:4], strict=True)]
    mismatched = [(prompts[k] + answers[(k - 1) % 4], len(prompts[k])) for k in range(4)]
    first, second = _model("llama", 0), _model("llama", 1)
    found = []
    for policy, reference in ((first, second), (second, first)):
        hand = sum(_answer_logp(policy, s, a) - _answer_logp(reference, s, a) for s, a in mismatched) / 4
        objective = PreferenceObjective(PreferenceSection(loss="kto"), module_reference(reference))
        objective.loss(policy, batch)
        kl = step_metrics({k: float(v) for k, v in objective.take_sums().items()}, "kto")["kl"]
        assert kl == pytest.approx(max(0.0, hand), abs=1e-4)
        found.append(kl)
    assert max(found) > 0.01 and min(found) == 0.0
