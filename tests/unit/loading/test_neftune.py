"""NEFTune (`train.neftune_noise_alpha`, orchestrate/loading/neftune.py): in training mode the input
embeddings get noise uniform in [-m, m], m = alpha / sqrt(seq_len x hidden), with seq_len the plan's
(a flattened micro-batch row gets the same m); none in eval mode; the hook reaches the embedding
through the engines' wrappers and a LoRA PeftModel; the noise repeats from a checkpoint's saved random
state (what makes a resumed run bit-exact, tests/e2e/test_train_knobs_e2e.py)."""

from __future__ import annotations

import math

import pytest
import torch

from orchestrate.backends.single_rank import SingleRank
from orchestrate.loading.neftune import add_neftune, input_embeddings, noise_bound
from orchestrate.worker.checkpointing import rng_state, set_rng_state
from tests.helpers.plans import TINY_GPT2

SEQ, ALPHA, HIDDEN = 32, 5.0, TINY_GPT2["n_embd"]


@pytest.fixture
def model():
    from transformers import AutoModelForCausalLM, GPT2Config

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(GPT2Config(**{k: v for k, v in TINY_GPT2.items() if k != "model_type"}))


def _ids(rows: int, length: int) -> torch.Tensor:
    return torch.randint(0, TINY_GPT2["vocab_size"], (rows, length), generator=torch.Generator().manual_seed(1))


def _noise(model, ids: torch.Tensor) -> torch.Tensor:
    embedding = model.get_input_embeddings()
    return embedding(ids) - embedding.weight[ids]


def test_training_forwards_get_uniform_noise_of_the_bound_and_eval_forwards_none(model):
    add_neftune(model, ALPHA, SEQ)
    bound = noise_bound(ALPHA, SEQ, HIDDEN)
    assert bound == pytest.approx(ALPHA / math.sqrt(SEQ * HIDDEN))
    model.train()
    noise = _noise(model, _ids(8, SEQ))  # 16,384 draws
    assert noise.abs().max() <= bound and noise.abs().max() > 0.99 * bound
    assert abs(noise.mean().item()) < 0.02 * bound
    assert noise.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.02)  # uniform's standard deviation
    model.eval()
    assert torch.equal(_noise(model, _ids(8, SEQ)), torch.zeros(8, SEQ, HIDDEN))


def test_the_bound_is_the_plans_seq_len_whatever_the_rows_length(model):
    # A packed micro-batch flattened into one row of 4 x seq_len (flash-attention's varlen path):
    # transformers' hook would take the row's length and noise it half as much.
    add_neftune(model, ALPHA, SEQ).remove()  # a removed hook leaves the embedding clean
    assert torch.equal(_noise(model, _ids(1, SEQ)), torch.zeros(1, SEQ, HIDDEN))
    add_neftune(model, ALPHA, SEQ)
    noise = _noise(model.train(), _ids(1, 4 * SEQ))
    assert noise.abs().max() > 0.99 * noise_bound(ALPHA, SEQ, HIDDEN)


def test_the_model_forward_trains_on_the_noised_embeddings(model):
    ids = _ids(2, SEQ)
    clean = model.train()(input_ids=ids, labels=ids).loss
    add_neftune(model, ALPHA, SEQ)
    assert model(input_ids=ids, labels=ids).loss != clean
    assert model.eval()(input_ids=ids, labels=ids).loss == clean.detach()


def test_the_embedding_is_found_through_the_wrappers_and_a_peft_model(model):
    from peft import LoraConfig, get_peft_model

    wte = model.transformer.wte
    assert input_embeddings(SingleRank(model)) is wte
    peft = get_peft_model(model, LoraConfig(r=4, target_modules=["c_attn"]))
    assert input_embeddings(SingleRank(peft)) is wte


def test_a_restored_random_state_draws_the_same_noise(model):
    add_neftune(model.train(), ALPHA, SEQ)
    ids = _ids(2, SEQ)
    saved = rng_state(torch.device("cpu"))  # what a checkpoint writes for its rank
    first = _noise(model, ids)
    assert not torch.equal(_noise(model, ids), first)  # fresh noise every forward
    set_rng_state(saved, torch.device("cpu"))
    assert torch.equal(_noise(model, ids), first)
