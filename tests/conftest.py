"""Shared pytest wiring: GPU tests skip on machines without CUDA, with the reason shown; plans model
the CUDA allocator setting orchestrate launches with, whatever the shell running the tests set."""

from __future__ import annotations

import pytest

from orchestrate.hardware.alloc_conf import CONF_VARS


@pytest.fixture(autouse=True)
def _allocator_setting_of_orchestrate(monkeypatch):
    # resolve_hardware reads PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF (hardware/alloc_conf.py)
    for var in CONF_VARS:
        monkeypatch.delenv(var, raising=False)


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
