"""Activations of your own module, measured: no formula exists for an arbitrary nn.Module.

The module is built under torch's FakeTensorMode (tensors with shapes and dtypes, no storage) and
runs forward, the loss of `train.loss` and backward on one micro-batch of data.module's first
samples (your own loop: zeros of `model.example_input`'s shapes; without `labels` among them the
loss is the output's sum, as the script's own loss is not known at plan time), under the simulation's storage counter (orchestrate.simulate.counter.LiveStorageCounter,
the fake-tensor verifier's). Activations are everything it sees live that is neither a parameter
nor a gradient: saved tensors, outputs, loss temporaries and the backward's activation
gradients; the peak of their sum over the step is the term. Measured at micro-batches of 1 and 2
samples, it is split into a per-sample and a fixed part, so every candidate's micro-batch is
priced. fp32, as built; 16-bit plans scale it by bytes per element (planner/memory.py).

The result is cached under $XDG_CACHE_HOME/orchestrate/activations (~/.cache by default), keyed by
a fingerprint of the module's and the dataset factory's source files, their kwargs (or the
example input), the loss mode and torch's version: `orchestrate plan` measures once, then reads the number.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrate.errors import Problem, UserError
from orchestrate.methods.custom.loss import LABELS, call, logits_of, loss_and_output
from orchestrate.methods.custom.module import import_object, instantiate, module_factory, shape_of_module
from orchestrate.model.shape import ModelShape

if TYPE_CHECKING:
    from orchestrate.config.schema import RunConfig

_BATCHES = (1, 2)


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "orchestrate" / "activations"


def _source(obj: Any) -> str:
    try:
        return Path(inspect.getsourcefile(obj) or "").read_text()
    except (OSError, TypeError):
        return repr(obj)  # built-ins and C extensions: their name stands for their source


def fingerprint(config: RunConfig, model_factory: Any, data_factory: Any) -> str:
    import torch

    key = {"model": config.model.module, "model_source": _source(model_factory), "model_kwargs": config.model.kwargs,
           "data": config.data.module, "data_source": _source(data_factory), "data_kwargs": config.data.kwargs,
           "example_input": {k: t.model_dump() for k, t in (config.model.example_input or {}).items()},
           "loss": config.train.loss, "torch": torch.__version__, "batches": list(_BATCHES)}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=repr).encode()).hexdigest()[:24]


def _untagged_peak(counter: Any) -> int:
    """Peak of the bytes live at once that are neither parameters nor gradients."""
    events = []
    for life in counter.lives:
        if life.tag is None:
            events.append((life.birth, life.nbytes))
            if life.death is not None:
                events.append((life.death, -life.nbytes))
    live = peak = 0
    for _, delta in sorted(events):
        live += delta
        peak = max(peak, live)
    return peak


def measure_step(model_factory: Any, kwargs: dict[str, Any], batch: dict[str, Any], loss_mode: str) -> int:
    """fp32 activation bytes at the peak of one forward + loss + backward on `batch`, on fake tensors."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from orchestrate.simulate.counter import LiveStorageCounter

    mode = FakeTensorMode(allow_non_fake_inputs=False)
    with mode:
        with torch.device("cpu"):
            model = instantiate(model_factory, kwargs, "model.module")
        fake = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        with LiveStorageCounter() as counter:
            counter.tag("parameters", list(model.parameters()) + list(model.buffers()))
            if LABELS in fake:
                loss, output = loss_and_output(model, fake, loss_mode)
            else:
                loss, output = _output_sum(model, fake)
            loss.backward()
            counter.tag("gradients", [p.grad for p in model.parameters() if p.grad is not None])
            del loss, output
    return _untagged_peak(counter)


def _output_sum(model: Any, batch: dict[str, Any]) -> tuple[Any, Any]:
    """An own loop's stand-in loss: the sum of the output (or its logits), which backward needs and
    which keeps no temporaries of its own."""
    output = call(model, batch, with_labels=False)
    logits = logits_of(output)
    if logits is None:
        raise TypeError("without `labels` in model.example_input the output must be a tensor (or have `logits`)")
    return logits.float().sum(), output


def _example_batch(config: RunConfig, size: int) -> dict[str, Any]:
    """Zeros of model.example_input's shapes, `size` samples (values do not matter on fake tensors)."""
    import torch

    return {name: torch.zeros((size, *t.shape), dtype=getattr(torch, t.dtype))
            for name, t in config.model.example_input.items()}


def _batches(config: RunConfig) -> list[dict[str, Any]]:
    """One micro-batch per size of _BATCHES: from model.example_input, else data.module's first samples."""
    if config.model.example_input is not None:
        return [_example_batch(config, size) for size in _BATCHES]
    from orchestrate.methods.custom.data import collate, load_dataset

    dataset = load_dataset(config)
    return [collate([dataset[i % len(dataset)] for i in range(size)]) for size in _BATCHES]


def _measure(config: RunConfig, model_factory: Any) -> tuple[int, int]:
    source = "model.example_input" if config.model.example_input is not None else "data.module"
    measured = []
    for size, batch in zip(_BATCHES, _batches(config), strict=True):
        try:
            measured.append(measure_step(model_factory, config.model.kwargs, batch, config.train.loss))
        except UserError:
            raise
        except Exception as exc:  # noqa: BLE001 - user code running on fake tensors
            raise UserError("cannot measure the activations of model.module", [Problem(
                "model.module", f"forward/backward on {size} sample(s) of {source} under FakeTensorMode raised "
                f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                f"make the module run on {source} (check the input shapes and train.loss)")]) from None
    per_sample = max(0, measured[1] - measured[0])
    return per_sample, max(0, measured[0] - per_sample)


def with_measured_activations(config: RunConfig, shape: ModelShape) -> ModelShape:
    """`shape` with the module's activation bytes, read from the cache or measured (and cached)."""
    from orchestrate.methods.custom.data import load_dataset

    model_factory = module_factory(config)
    if config.data.module is None and config.model.example_input is None:
        load_dataset(config)  # the UserError that asks for data.module (or model.example_input)
    data_factory = None if config.data.module is None else import_object(config.data.module, "data.module", config)
    path = cache_dir() / f"{fingerprint(config, model_factory, data_factory)}.json"
    try:
        cached = json.loads(path.read_text())
        per_sample, fixed = int(cached["per_sample"]), int(cached["fixed"])
    except (OSError, ValueError, KeyError, TypeError):
        per_sample, fixed = _measure(config, model_factory)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps({"per_sample": per_sample, "fixed": fixed, "module": config.model.module}))
            tmp.replace(path)
        except OSError:
            pass  # a read-only cache costs a re-measurement next time, nothing else
    return dataclasses.replace(shape, activation_bytes_per_sample=per_sample, activation_bytes_fixed=fixed)


def custom_shape(config: RunConfig) -> ModelShape:
    """The planner's shape of `config.model.module`: counted on the meta device, activations measured."""
    shape = shape_of_module(module_factory(config), config.model.kwargs, config.strategy.wrap)
    return with_measured_activations(config, shape)
