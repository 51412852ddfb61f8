"""Which training methods exist, which of them a config asks for, and their worker halves.

The built-in methods are named here in the order their hooks run (orchestrate/methods/spec.py
states the composition rule). An installed package adds its own through the entry-point group
`orchestrate.methods` (PLUGIN_GROUP), read when this module is imported, so the launcher and every
worker find the same methods; they run after the built-in ones and before the custom module's, by
name. A name taken twice is refused. The worker halves (`Method.runtime`, torch inside) are imported
on first use, on the worker only.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

from orchestrate.config.requirements import METHOD_LIBRARIES, installed
from orchestrate.config.schema import RunConfig
from orchestrate.errors import Problem, UserError
from orchestrate.hardware.profile import HardwareProfile
from orchestrate.loading.packed_attention import packed_attention
from orchestrate.methods.custom.method import CUSTOM
from orchestrate.methods.distill.method import DISTILL
from orchestrate.methods.full.method import FULL
from orchestrate.methods.grpo.method import GRPO
from orchestrate.methods.lora.config import LoraSection, QuantizationSection
from orchestrate.methods.lora.method import LORA
from orchestrate.methods.preference.method import PREFERENCE
from orchestrate.methods.prune.method import PRUNE
from orchestrate.methods.runtime import MethodRuntime
from orchestrate.methods.spec import Method
from orchestrate.model.shape import ModelShape
from orchestrate.model.tasks import name_the_causal_lm_loss
from orchestrate.planner.terms import MethodTerms

if TYPE_CHECKING:
    from orchestrate.data.method_data import MethodData

PLUGIN_GROUP = "orchestrate.methods"
"""The entry-point group of training methods other packages add: each entry point names a `Method`
instance (`stepmark = stepmark:METHOD`)."""


def _plugin_methods(builtin: list[Method]) -> list[Method]:
    """The methods installed packages add (PLUGIN_GROUP), by name; UserError listing every entry point
    that names no Method or takes a name another method has."""
    taken = {m.name: "orchestrate's own" for m in builtin}
    found, problems = [], []
    for point in entry_points(group=PLUGIN_GROUP):
        method, where = point.load(), f"{PLUGIN_GROUP} entry point {point.name} = {point.value}"
        if not isinstance(method, Method):
            problems.append(Problem(where, f"names a value of type {type(method).__name__}, not a Method instance",
                                    "point it at an instance of an orchestrate.methods.spec.Method subclass"))
        elif method.name in taken:
            problems.append(Problem(where, f"names its method {method.name!r}, as {taken[method.name]} does",
                                    "rename one of them, or uninstall the package you do not use"))
        else:
            taken[method.name] = point.value
            found.append(method)
    if problems:
        raise UserError("two training methods share a name, or a plug-in names no method", problems)
    return sorted(found, key=lambda m: m.name)


_METHODS: list[Method] = [FULL, LORA, DISTILL, PREFERENCE, GRPO, PRUNE,
                          *_plugin_methods([FULL, LORA, DISTILL, PREFERENCE, GRPO, PRUNE, CUSTOM]), CUSTOM]

AUTO_METHODS = ("full", "lora", "qlora")
"""train.method auto, most faithful first: every weight trained; a low-rank update of a frozen base in
the training precision; the same on a base rounded to 4-bit NF4."""


def methods() -> list[Method]:
    """Every method, in the order their hooks run."""
    return list(_METHODS)


def active_methods(config: RunConfig) -> list[Method]:
    """The methods `config` asks for: its base method and its add-ons, in hook order."""
    return [m for m in _METHODS if m.active(config)]


def base_method(config: RunConfig) -> Method:
    """The one base method of a run (spec.py): custom for your own module, lora for `train.method:
    lora | qlora`, else full."""
    return next(m for m in _METHODS if m.base and m.active(config))


def runtime(method: Method) -> MethodRuntime:
    """The worker half of `method` (torch inside: import it on the worker only)."""
    if method.runtime is None:
        return MethodRuntime()
    return importlib.import_module(method.runtime).RUNTIME


def runtimes(config: RunConfig) -> list[MethodRuntime]:
    """The worker halves of the config's methods, in hook order."""
    return [runtime(m) for m in active_methods(config)]


def base_runtime(config: RunConfig) -> MethodRuntime:
    """The worker half of the run's base method: the one that builds the model."""
    return runtime(base_method(config))


def method_data(config: RunConfig) -> MethodData:
    """What the config's methods bring to the data path (orchestrate/data/method_data.py), for the
    pipeline's entry points: records of their own, or data a method brings itself."""
    from orchestrate.data.method_data import (  # numpy, through orchestrate.data
        MethodData,
        OwnData,
        RecordReader,
    )

    found = [importlib.import_module(m.data).data_path(config) for m in active_methods(config) if m.data]
    return MethodData(tuple(d for d in found if isinstance(d, RecordReader)),
                      next((d for d in found if isinstance(d, OwnData)), None))


def apply_transforms(model: Any, plan: Any) -> Any:
    """Between building the model and wrapping it: the causal LM's loss named, the attention of packed
    chat samples (whatever the method: loading/packed_attention.py), then every active method's model
    transform, in hook order."""
    name_the_causal_lm_loss(model, plan.config.model.task)
    model = packed_attention(model, plan)
    for method in runtimes(plan.config):
        model = method.transform(model, plan)
    return model


def auxiliary_shapes(config: RunConfig, shape: ModelShape) -> dict[str, ModelShape]:
    """Every active method's auxiliary-model shapes (launcher side: reads their config.json)."""
    return {name: s for m in active_methods(config) for name, s in m.auxiliary_shapes(config, shape).items()}


def method_terms(config: RunConfig, shape: ModelShape, hw: HardwareProfile,
                 auxiliary: dict[str, ModelShape] | None = None) -> list[MethodTerms]:
    """Every active method's terms for the planner, in hook order (a UserError for settings that do not
    fit the model); `auxiliary`: the shapes `auxiliary_shapes` read (None: none read)."""
    return [m.terms(config, shape, hw, auxiliary or {}) for m in active_methods(config)]


def auto_variants(config: RunConfig) -> tuple[list[tuple[str, RunConfig]], list[str]]:
    """train.method auto: (name, config) of every method to try in AUTO_METHODS order, and why the
    ones whose libraries are missing are left out. Each variant sets its own method's settings to
    their defaults for the methods not taken (a config dumped whole lists them)."""
    variants, why = [], []
    for name in AUTO_METHODS:
        if not installed(METHOD_LIBRARIES[name]):
            why.append(f"{name} needs {' and '.join(METHOD_LIBRARIES[name])} (not installed)")
            continue
        unused = {"lora": LoraSection()} if name == "full" else {}
        if name != "qlora":
            unused["quantization"] = QuantizationSection()
        train = config.train.model_copy(update={"method": name, **unused})
        variants.append((name, config.model_copy(update={"train": train})))
    return variants, why


def is_auto(config: RunConfig) -> bool:
    """`train.method: auto`: the planner tries AUTO_METHODS in turn (`auto_variants`)."""
    return config.train.method == "auto"


def auto_note(taken: str | None, why: list[str], shown: RunConfig | None = None) -> str:
    """The plan's note on what train.method auto took (`taken`), or that nothing fits (`shown`: the
    config of the method whose candidates the plan shows)."""
    if taken is not None:
        because = f" ({'; '.join(why)})" if why else ""
        return f"train.method auto: {taken}, the most faithful method that fits{because}"
    return f"train.method auto: nothing fits ({'; '.join(why)}); shown: {shown.train.method}"


def no_auto_method(why: list[str]) -> UserError:
    return UserError("Cannot plan this run: train.method auto found no method to plan",
                     [Problem("train.method", "; ".join(why), "set train.method: full, lora or qlora")])
