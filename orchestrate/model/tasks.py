"""What a model is trained to do (`model.task`), and which transformers class each task builds.

    causal-lm                next-token prediction, AutoModelForCausalLM (packed or padded documents)
    masked-lm                BERT-style masked tokens, AutoModelForMaskedLM (padded documents)
    sequence-classification  one label per document, AutoModelForSequenceClassification

Every place that builds, loads, saves or exports a model asks `model_class(hf_config, task)`, so a
saved BertForSequenceClassification directory is built as what it is, never as BertLMHeadModel.
"""

from __future__ import annotations

from typing import Any

TASKS = ("causal-lm", "masked-lm", "sequence-classification")

_AUTO = {"causal-lm": "AutoModelForCausalLM", "masked-lm": "AutoModelForMaskedLM",
         "sequence-classification": "AutoModelForSequenceClassification"}
_MAPPING = {"causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING", "masked-lm": "MODEL_FOR_MASKED_LM_MAPPING",
            "sequence-classification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING"}
_SUFFIX = {"ForCausalLM": "causal-lm", "LMHeadModel": "causal-lm", "ForMaskedLM": "masked-lm",
           "ForSequenceClassification": "sequence-classification"}
"""transformers' class-name endings (BertForMaskedLM, GPT2LMHeadModel, ...) and their task."""


def auto_class(task: str):
    """The transformers Auto class of `task` (AutoModelForCausalLM, ...)."""
    import transformers

    return getattr(transformers, _AUTO[task])


def model_class(hf_config, task: str):
    """The concrete class `task` builds for `hf_config` (importing its modeling code), or the Auto
    class for custom code (trust_remote_code), resolved when building."""
    from transformers.models.auto import modeling_auto

    mapping = getattr(modeling_auto, _MAPPING[task])
    return mapping[type(hf_config)] if type(hf_config) in mapping else auto_class(task)


def has_class(hf_config, task: str) -> bool:
    from transformers.models.auto import modeling_auto

    return type(hf_config) in getattr(modeling_auto, _MAPPING[task])


def task_of_architectures(architectures: object) -> str | None:
    """The task a config.json's `architectures` list was saved for (None when it names none we know)."""
    if not isinstance(architectures, list):
        return None
    for name in architectures:
        for suffix, task in _SUFFIX.items():
            if isinstance(name, str) and name.endswith(suffix):
                return task
    return None


def per_token_logits(task: str) -> bool:
    """Whether the head's logits have one row per token (LM heads) or one per sequence (classifiers)."""
    return task != "sequence-classification"


def name_the_causal_lm_loss(model: Any, task: str) -> None:
    """transformers picks a model's loss from its class name; a causal LM named otherwise
    (GPT2LMHeadModel) gets `loss_type` None, falls back to ForCausalLM and warns "`loss_type=None` was
    set in the config but it is unrecognized" (modeling_utils.py `loss_function`) at its first loss.
    The same loss, named, without the warning."""
    if task == "causal-lm" and getattr(model, "loss_type", "") is None:
        model.loss_type = "ForCausalLM"
