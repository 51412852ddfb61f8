"""The block-class table equals transformers' own `_no_split_modules` for every family in it."""

from __future__ import annotations

import pytest

from orchestrate.model.block_classes import KNOWN_BLOCK_CLASSES, transformers_block_class_names


@pytest.mark.parametrize("model_type", sorted(KNOWN_BLOCK_CLASSES))
def test_table_matches_transformers(model_type):
    assert KNOWN_BLOCK_CLASSES[model_type] == transformers_block_class_names(model_type)
