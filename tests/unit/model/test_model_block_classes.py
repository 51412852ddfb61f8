"""The block-class table equals transformers' own `_no_split_modules` for every family in it (for
encoders: without the embeddings module), and FSDP never shards a block apart from a weight tied to it."""

from __future__ import annotations

import pytest

from orchestrate.model.block_classes import (
    ENCODER_BLOCK_CLASSES,
    KNOWN_BLOCK_CLASSES,
    transformers_block_class_names,
)


@pytest.mark.parametrize("model_type", sorted(KNOWN_BLOCK_CLASSES))
def test_table_matches_transformers(model_type):
    assert KNOWN_BLOCK_CLASSES[model_type] == transformers_block_class_names(model_type)


def _encoder_config(model_type: str):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                                num_hidden_layers=3, vocab_size=100, dim=32, n_heads=2, hidden_dim=64, n_layers=3)


@pytest.mark.parametrize("model_type", sorted(ENCODER_BLOCK_CLASSES))
def test_encoder_table_is_the_repeated_layer_of_transformers_list(model_type):
    """An encoder's table entry is transformers' `_no_split_modules` without the embeddings module
    (DistilBERT names none), and names exactly one module per layer."""
    from orchestrate.backends.hf_io import find_blocks
    from orchestrate.model.meta import build_meta_model

    model = build_meta_model(_encoder_config(model_type), task="masked-lm")
    own = set(model._no_split_modules)
    table = ENCODER_BLOCK_CLASSES[model_type]
    assert not own or set(table) < own and all("Embedding" in name for name in own - set(table)), own
    assert len(find_blocks(model, table)) == 3


def test_fsdp_keeps_a_block_with_a_weight_tied_outside_it_in_the_root_unit():
    """A model whose named blocks include the embeddings (tied to the MLM decoder) must not shard
    them on their own: the tie would come apart (the error FSDP runs of BertForMaskedLM hit)."""
    from orchestrate.backends.fsdp import _shardable
    from orchestrate.backends.hf_io import StateLayout, find_blocks
    from orchestrate.model.meta import build_meta_model

    model = build_meta_model(_encoder_config("bert"), task="masked-lm")
    blocks = find_blocks(model, ["BertEmbeddings", "BertLayer"])
    assert [name for name, _ in blocks][0] == "bert.embeddings"
    assert _shardable(blocks, StateLayout.of(model)) == [False, True, True, True]
    gpt2 = build_meta_model(_encoder_config("gpt2"), task="causal-lm")
    assert all(_shardable(find_blocks(gpt2, ["GPT2Block"]), StateLayout.of(gpt2)))
