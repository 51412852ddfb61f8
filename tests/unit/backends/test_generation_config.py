"""Every saved causal-LM directory has generation_config.json, like `save_pretrained` writes: the
model/ of FSDP2, DDP and DeepSpeed runs and `orchestrate export`'s output. Each backend's own
`save_hf_model` is called on a tiny model in one gloo process (no training run)."""

from __future__ import annotations

from pathlib import Path
from types import MethodType, SimpleNamespace

import pytest

from tests.helpers.dist import run_on_ranks
from tests.helpers.plans import TINY_GPT2


def _tiny():
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(**TINY_GPT2)
    return config, AutoModelForCausalLM.from_config(config)


def _assert_loadable(out: Path, model) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    assert (out / "generation_config.json").is_file(), sorted(p.name for p in out.iterdir())
    generation = GenerationConfig.from_pretrained(out)
    assert generation.to_dict() == model.generation_config.to_dict()  # what save_pretrained would write
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())


def _save_with_each_backend(root: str) -> None:
    import deepspeed.comm

    from orchestrate.backends.ddp import DDPEngine
    from orchestrate.backends.deepspeed_backend import DeepSpeedTrainEngine
    from orchestrate.backends.fsdp import FSDPEngine
    from orchestrate.backends.hf_io import StateLayout
    from tests.helpers.dist import init_gloo

    init_gloo()
    deepspeed.comm.init_distributed("gloo")
    config, model = _tiny()
    # Stand-ins for the engines' `self`, holding what each save_hf_model reads (unwrapped on 1 rank).
    torch_self = SimpleNamespace(rank=SimpleNamespace(rank=0), hf_config=config, layout=StateLayout.of(model))
    for engine, own, out in ((FSDPEngine, SimpleNamespace(model=model, **vars(torch_self)), "fsdp"),
                             (DDPEngine, SimpleNamespace(model=SimpleNamespace(module=model), **vars(torch_self)), "ddp"),
                             (DeepSpeedTrainEngine, SimpleNamespace(_zero3=False, _hf=True, hf_config=config,
                                                                    engine=SimpleNamespace(module=model)), "deepspeed")):
        own.model_state = MethodType(engine.model_state, own)
        engine.save_hf_model(own, Path(root) / out)


@pytest.mark.slow  # a spawned gloo process (tests/helpers/dist.py)
@pytest.mark.parametrize("backend", ["fsdp", "ddp", "deepspeed"])
def test_each_backends_model_dir_has_a_generation_config(tmp_path_factory, backend):
    root = tmp_path_factory.getbasetemp() / "generation-saves"
    if not root.exists():  # one process saves all three
        run_on_ranks(_save_with_each_backend, 1, str(root))
    _assert_loadable(root / backend, _tiny()[1])


def test_export_path_writes_it_from_the_meta_model(tmp_path):
    """`orchestrate export` builds its layout from the meta model (orchestrate/export.py)."""
    from orchestrate.backends.hf_io import StateLayout, save_hf_dir
    from orchestrate.model.meta import build_meta_model

    config, model = _tiny()
    save_hf_dir(model.state_dict(), config, tmp_path, StateLayout.of(build_meta_model(config)))
    _assert_loadable(tmp_path, model)
