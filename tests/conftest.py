"""Shared pytest wiring: GPU tests skip on machines without CUDA, with the reason shown; plans model
the CUDA allocator setting orchestrate launches with, whatever the shell running the tests set; no
test writes into the checkout's ./runs; DeepSpeed's extensions built once are found by every test."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from orchestrate.hardware.alloc_conf import CONF_VARS


def _pin_torch_extensions_dir() -> None:
    """Where `make install` pre-built DeepSpeed's CPU Adam, FusedAdam and shared-memory collectives
    (orchestrate/backends/prebuild.py): torch's default extension root, which follows XDG_CACHE_HOME.
    Tests that point XDG_CACHE_HOME at a tmp dir to isolate orchestrate's own caches would otherwise
    send their DeepSpeed workers to an empty root and a fresh C++ build (30 s of a 40 s test).
    Same path as torch.utils.cpp_extension._get_build_directory without TORCH_EXTENSIONS_DIR."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    hip, cuda = torch.version.hip, torch.version.cuda
    device = f"rocm{hip.replace('.', '')}" if hip else f"cu{cuda.replace('.', '')}" if cuda else "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(get_default_build_root(), f"{python}_{device}"))


_pin_torch_extensions_dir()


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


_CHECKOUT_RUNS = Path(__file__).resolve().parents[1] / "runs"


def _runs_entries() -> set[str]:
    """What is in the checkout's ./runs (the default train.output_dir of a command run from it)."""
    if not _CHECKOUT_RUNS.is_dir():
        return set()
    return {str(p.relative_to(_CHECKOUT_RUNS)) for p in [*_CHECKOUT_RUNS.glob("*"), *_CHECKOUT_RUNS.glob("*/*")]}


@pytest.fixture(autouse=True)
def _nothing_written_into_the_checkout():
    """A config loaded from a file without train.output_dir runs under the working directory, the
    checkout for pytest: a test that launches or prepares one must chdir into its tmp_path (or set
    train.output_dir), not leave runs or data caches in the user's ./runs."""
    before = _runs_entries()
    yield
    added = _runs_entries() - before
    assert not added, f"the test wrote into {_CHECKOUT_RUNS}: {sorted(added)[:5]}"
