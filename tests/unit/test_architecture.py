"""The shape of the package, read from its source with `ast`: no import cycles, the launcher side
(launch/, transports/) and worker/ apart, a thin CLI, every run-directory name and exit code defined
once, imports at the top of each file (but for the slow libraries), `orchestrate plan` free of torch. File and function length is a guideline kept by judgement:
the ones past it are printed, not failed."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import tomllib

PACKAGE = Path(__file__).resolve().parents[2] / "orchestrate"
RUN_DIR_NAMES = {"plan.json", "config.yaml", "metrics.jsonl", "launch.sh", "job.sbatch", "accelerate.yaml",
                 "REQUEUE", "init_model", "data/demo_corpus.txt", "orchestrate.worker", "checkpoints",
                 ".orchestrate-run", ".lock", ".orchestrate-export"}
EXIT_CODE_NAMES = {"EX_TEMPFAIL", "EXIT_USER_ERROR"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> dict[str, tuple[Path, ast.Module]]:
    return {_module_name(p): (p, ast.parse(p.read_text(), str(p))) for p in sorted(PACKAGE.rglob("*.py"))}


SOURCES = _sources()


def _imports(tree: ast.Module, module: str) -> set[str]:
    """Every orchestrate module `module` imports, anywhere in the file (function bodies and
    TYPE_CHECKING blocks included: a cycle through them is still a knot)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                base = ".".join(module.split(".")[: -node.level] + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            # `from orchestrate.transports.ssh import remote` names a module; `from x import func` names x.
            while name and name not in SOURCES:
                name = name.rpartition(".")[0]
            if name and name != module and name != "orchestrate":
                found.add(name)
    return found


GRAPH = {module: _imports(tree, module) for module, (_, tree) in SOURCES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_the_package():
    assert _cycles(GRAPH) == []


LAUNCHER = ("orchestrate.launch", "orchestrate.transports")


def test_launcher_and_worker_never_import_each_other():
    crossing = [(m, t) for m, targets in GRAPH.items() for t in targets
                if (m.startswith(LAUNCHER) and t.startswith("orchestrate.worker"))
                or (m.startswith("orchestrate.worker") and t.startswith(LAUNCHER))]
    assert crossing == []


def test_the_agent_never_imports_the_launcher():
    """orchestrate/agent/ sits between them: it imports the worker's fork entry, the launcher only
    starts it as a program (transports/local/agent.py) and shares the plain torchrun runner."""
    crossing = [(m, t) for m, targets in GRAPH.items() for t in targets
                if m.startswith("orchestrate.agent") and t.startswith(LAUNCHER)]
    assert crossing == []
    assert not any(t.startswith("orchestrate.agent.process") for m, targets in GRAPH.items()
                   if m.startswith(LAUNCHER) for t in targets)


def test_cli_imports_only_the_api_the_errors_and_the_run_contract():
    """The run contract (exit codes, run-directory names) is what the CLI tells the user about; it
    reads them from their one definition, not through api.py."""
    assert GRAPH["orchestrate.cli"] <= {"orchestrate.api", "orchestrate.errors", "orchestrate.run.exits",
                                        "orchestrate.run.layout"}


LAYERS = ("errors", "ports", "library_messages", "run", "config", "hardware", "model", "planner", "data",
          "loading", "backends", "methods", "simulate", "worker", "report", "planning", "launch", "transports",
          "agent", "loop_api", "gguf_vocab", "gguf_export", "export", "chat", "presets", "api", "cli", "__main__", "__init__")
"""The packages (and top-level modules) from the lowest to the highest: a package builds on the ones
before it. The data flow (config -> hardware -> model -> plan -> backend -> worker) reads left to right;
methods/ sits above what it hands values to (planner, data, backends) and below the worker that runs it."""

CLIMB_BUDGET = 43
"""Imports from a lower package into a higher one today: the count may fall, never rise (43: config.schema
names the grpo section, as it names every method's section)."""


def _layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS.index(parts[1] if len(parts) > 1 else "__init__")


def climbing_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((m, t) for m, targets in graph.items() for t in targets if _layer(m) < _layer(t))


def test_every_package_has_a_layer():
    assert {m.split(".")[1] for m in SOURCES if "." in m} <= set(LAYERS)


def test_the_planner_reads_the_training_methods_as_values():
    """planner/ imports nothing of orchestrate.methods: a method's part of a plan comes in as a value
    (planner/terms.py), computed above the planner (orchestrate/planning.py), which never calls a method."""
    crossing = [(m, t) for m, targets in GRAPH.items() for t in targets
                if m.startswith("orchestrate.planner") and t.startswith("orchestrate.methods")]
    assert crossing == []


def test_imports_that_climb_from_a_lower_package_into_a_higher_one_stay_within_the_budget():
    climbs = climbing_imports(GRAPH)
    print(f"{len(climbs)} climbing imports:", *(f"{m} -> {t}" for m, t in climbs), sep="\n  ")
    assert len(climbs) <= CLIMB_BUDGET


METHOD_INTERFACE = ("orchestrate.methods.spec", "orchestrate.methods.runtime")
"""What a package below methods/ may know of the training methods: the spec and the worker half's
hooks. A method's own modules (orchestrate/methods/<name>/), and the registry that names them all,
hand their parts down as values (a model builder, record readers, the state they save)."""


def _names_a_method(packages: tuple[str, ...]) -> list[tuple[str, str]]:
    return sorted((m, t) for m, targets in GRAPH.items() for t in targets
                  if m.startswith(packages) and t.startswith("orchestrate.methods") and t not in METHOD_INTERFACE)


def test_the_backends_and_the_data_pipeline_name_no_training_method():
    assert _names_a_method(("orchestrate.backends", "orchestrate.data")) == []


def _string_constants(tree: ast.Module) -> list[tuple[str, int]]:
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [(n.value, n.lineno) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings]


def test_every_run_directory_name_is_defined_once_in_the_run_contract():
    found = {}
    for path, tree in SOURCES.values():
        for value, line in _string_constants(tree):
            if value in RUN_DIR_NAMES:
                found.setdefault(value, []).append(f"{path.relative_to(PACKAGE)}:{line}")
    outside = {v: places for v, places in found.items() if any(not p.startswith("run/") for p in places)}
    assert outside == {}
    assert all(len(places) == 1 for places in found.values()), found


def test_every_exit_code_is_defined_once():
    defined = []
    for path, tree in SOURCES.values():
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, ast.AnnAssign) else [])
            for target in targets:
                if isinstance(target, ast.Name) and target.id in EXIT_CODE_NAMES:
                    defined.append((target.id, str(path.relative_to(PACKAGE))))
    assert sorted(defined) == [("EXIT_USER_ERROR", "run/exits.py"), ("EX_TEMPFAIL", "run/exits.py")]


METHOD_FOLDERS = "methods"
"""A method's folder (methods/lora/) is laid out like every other one and like a plug-in method's
package (method.py, runtime.py, config.py), and names its other files after the concept it adds its
part to (lora/memory.py: LoRA's part of planner/memory.py; distill/objective.py: of worker/objective.py)."""

PARALLEL_PACKAGES = ("transports",)
"""Packages whose subpackages are alike (one transport each) and name a file after its role in it."""

SHARED_BASENAMES = {
    "auxiliary.py": "one concept in three packages: planner/ prices an auxiliary model, methods/ reads its shape, loading/ builds it",
    "base.py": "the base class of a kind of plug-in, in the package that runs it: backends/, worker/callbacks/",
    "describe.py": "the human-readable view of the package it sits in: config/ the schema, hardware/ a profile",
    "packing.py": "data/ packs samples into blocks, planner/ prices the attention that keeps them apart",
    "presets.py": "hardware/ names the hardware presets, orchestrate/presets.py writes launch_configs/ from them",
    "registry.py": "the registry of a kind of plug-in, in its package: backends/, methods/",
    "session.py": "a launch's session on each side of it: launch/ the launcher's, loop_api/ the user loop's",
    "strategy.py": "config/ the `strategy:` section, planner/ the Strategy it is resolved into",
}
"""Basenames two modules may share, and why: the same concept, each seen from its own package."""


def _basename_owners(paths: list[Path]) -> dict[str, set[str]]:
    """Each basename (`__init__.py`, `__main__.py` and METHOD_FOLDERS' files aside) -> where it lives:
    its folder, or for a file inside one of PARALLEL_PACKAGES' subpackages, that package with a
    wildcard (`transports/*`)."""
    owners: dict[str, set[str]] = {}
    for path in paths:
        folder = path.parent.relative_to(PACKAGE.parent)
        if path.name in ("__init__.py", "__main__.py") or (len(folder.parts) > 2 and folder.parts[1] == METHOD_FOLDERS):
            continue
        if len(folder.parts) > 2 and folder.parts[1] in PARALLEL_PACKAGES:
            folder = Path(*folder.parts[:2], "*")
        owners.setdefault(path.name, set()).add(str(folder))
    return owners


def test_the_basename_checker_finds_a_shared_name():
    paths = [PACKAGE / p for p in ("a/oom.py", "b/oom.py", "transports/x/transport.py",
                                   "transports/y/transport.py", "methods/x/oom.py", "a/__init__.py", "b/__init__.py")]
    assert {n: o for n, o in _basename_owners(paths).items() if len(o) > 1} == {"oom.py": {"orchestrate/a",
                                                                                          "orchestrate/b"}}


def test_no_two_modules_of_the_package_share_a_basename():
    """A file's name says what it holds: two files named alike for different things (oom.py for the
    worker's record and for the launcher's re-plan) send a reader to the wrong one."""
    shared = {name for name, owners in _basename_owners([p for p, _ in SOURCES.values()]).items() if len(owners) > 1}
    assert shared - set(SHARED_BASENAMES) == set()
    assert set(SHARED_BASENAMES) - shared == set(), "no longer shared: take it off SHARED_BASENAMES"


FILE_LINES, FUNCTION_LINES = 600, 80
"""A guideline, not a cap: a file is as long as its one job needs. Past it, a file or function is
printed by the test below so that a reviewer looks at it; cutting one into fragments to fit is worse."""

PLANS = [["examples/llama3-8b.yaml", "--gpus", "2", "--gpu-mem", "8GiB", "--cpu-mem", "64GiB"],
         ["examples/llama3-8b.yaml", "--gpus", "1", "--gpu-mem", "8GiB", "--set", "train.method=qlora"],
         ["examples/tiny-gpt2.yaml", "--gpus", "2", "--gpu-mem", "8GiB", "--set", "train.method=auto"],
         ["examples/tiny-gpt2.yaml", "--gpus", "2", "--set", "prune.target_sparsity=0.5",
          "--set", "prune.schedule.end_step=10"]]


def test_long_files_and_functions_are_listed_for_review():
    long = [f"{path.relative_to(PACKAGE)}: {n} lines" for path, _ in SOURCES.values()
            if (n := len(path.read_text().splitlines())) > FILE_LINES]
    for path, tree in SOURCES.values():
        long += [f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}: {node.end_lineno - node.lineno} lines"
                 for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and node.end_lineno - node.lineno > FUNCTION_LINES]
    print(f"past the guideline ({FILE_LINES}-line files, {FUNCTION_LINES}-line functions):",
          *(long or ["none"]), sep="\n  ")


def test_planning_a_known_family_imports_no_torch():
    """`orchestrate plan` of a family the formulas cover (llama, gpt2) stays free of torch, the
    training libraries and the other slow ones (SLOW_LIBRARIES; torch alone takes seconds), for
    full fine-tuning, QLoRA, method auto and pruning. In a fresh interpreter: this one has them."""
    code = (
        "import sys\nfrom click.testing import CliRunner\nfrom orchestrate.cli import cli\n"
        f"for args in {PLANS!r}:\n"
        "    result = CliRunner().invoke(cli, ['plan', *args])\n"
        "    assert result.exit_code in (0, 2) and 'candidate' in result.output, (args, result.output)\n"
        f"print(sorted(m for m in sys.modules if any(m == lib or m.startswith(lib + '.') for lib in {SLOW_LIBRARIES!r})))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=PACKAGE.parent, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# --- imports at the top of each file -----------------------------------------------------------

HEAVY = ("torch", "transformers", "deepspeed", "peft", "bitsandbytes")
SLOW_LIBRARIES = (
    *HEAVY, "accelerate", "safetensors.torch",  # these two import torch
    # Seconds or tenths of one to import (`python -X importtime`, min of 3 on the 2-core dev machine):
    # datasets 1.4 s, matplotlib 1.0 s, fabric 0.5 s, pyarrow 0.24 s, paramiko 0.28 s, tqdm.auto 0.28 s,
    # numpy 0.13 s, huggingface_hub.errors 0.12 s, against ~1 s for all of `orchestrate plan`.
    "datasets", "pyarrow", "matplotlib", "numpy", "fabric", "paramiko", "tqdm", "huggingface_hub",
    "tokenizers")  # 15 ms, but `launch --dry-run` is held free of it (tests/helpers/imports.py)
"""A module importing one of these at its top level (or through its own top-level imports) is slow,
and may be imported inside the function that needs it: that is what keeps `orchestrate plan`, the CLI
and `import orchestrate.api` light. Every other import sits at the top of its file."""

OPTIONAL_EXTRAS = {"deepspeed": "deepspeed", "nvidia-ml-py": "pynvml", "wandb": "wandb",
                   "mlflow-skinny": "mlflow", "peft": "peft", "bitsandbytes": "bitsandbytes",
                   "liger-kernel": "liger_kernel", "gguf": "gguf"}
"""pyproject's optional dependencies (a distribution: the module it installs) that are not also in
`dependencies`: a user may not have them, so they are imported where used."""

COMMAND_ENTRIES = ("orchestrate.api",)
"""The functions behind the CLI's commands import the package's modules that carry them out where
they are called: `orchestrate plan` does not load the launcher, transports and exporter (hoisted,
they cost it 0.29 s, 1.52 -> 1.81 s median of 9 runs)."""

PACKAGES = {_module_name(p) for p in PACKAGE.rglob("__init__.py")}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported_names(node: ast.Import | ast.ImportFrom, module: str, modules: set[str]) -> list[str]:
    """The modules an import statement loads, absolute: `from orchestrate.a import b` loads
    orchestrate.a, and orchestrate.a.b when that is a module."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        package = module if module in PACKAGES else module.rpartition(".")[0]
        package = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
        base = f"{package}.{base}" if base else package
    return [base, *(f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules)]


def _split_imports(tree: ast.Module, module: str, modules: set[str]):
    """(imports run when the module is imported, imports inside function bodies), each a list of
    (line, [module, ...]). `if TYPE_CHECKING:` bodies are neither (they never run), nor a module's
    `__getattr__`."""
    top, in_functions = [], []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for statement in child.orelse:
                    visit(ast.Module(body=[statement], type_ignores=[]), in_function)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and child.name == "__getattr__" \
                    and node is tree:
                continue  # a package's lazy exports (PEP 562): their one job is to import on first use
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, True)
            else:
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    (in_functions if in_function else top).append(
                        (child.lineno, _imported_names(child, module, modules)))
                visit(child, in_function)

    visit(tree, False)
    return top, in_functions


def _is_slow_library(name: str) -> bool:
    return any(name == lib or name.startswith(f"{lib}.") for lib in SLOW_LIBRARIES)


def _with_packages(name: str, modules: set[str]) -> list[str]:
    """Importing orchestrate.a.b runs orchestrate/__init__.py and orchestrate/a/__init__.py first."""
    parts = name.split(".")
    return [p for p in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if p in modules]


def _slow_modules(top_level: dict[str, list[tuple[int, list[str]]]]) -> set[str]:
    """The package's modules whose import loads a slow library: directly at their top level, or
    through their own top-level imports (transitively, packages' __init__ included)."""
    modules = set(top_level)
    slow: set[str] = set()
    changed = True
    while changed:
        changed = False
        for module, imports in top_level.items():
            if module in slow:
                continue
            loaded = {n for _, names in imports for n in names}
            inside = {m for n in loaded | {module} for m in _with_packages(n, modules)}
            if any(_is_slow_library(n) for n in loaded if n.split(".")[0] != "orchestrate") or (inside & slow):
                slow.add(module)
                changed = True
    return slow


def _misplaced_imports(sources: dict[str, tuple[Path, ast.Module]]) -> list[str]:
    """`file:line module` for each import inside a function body that could sit at the top of its
    file: neither a slow library, nor an optional extra, nor a module of the package that is slow,
    nor a command's implementation (COMMAND_ENTRIES)."""
    modules = set(sources)
    split = {m: _split_imports(tree, m, modules) for m, (_, tree) in sources.items()}
    slow = _slow_modules({m: top for m, (top, _) in split.items()})
    misplaced = []
    for module, (_, in_functions) in split.items():
        for line, names in in_functions:
            internal = [n for n in names if n in modules or n.startswith("orchestrate.")]
            if internal:
                if module in COMMAND_ENTRIES or any(m in slow for n in internal for m in _with_packages(n, modules)):
                    continue
            elif _is_slow_library(names[0]) or names[0].split(".")[0] in OPTIONAL_EXTRAS.values():
                continue
            path = sources[module][0]
            misplaced.append(f"{path.relative_to(PACKAGE.parent)}:{line} {names[-1]}")
    return misplaced


def test_the_import_checker_finds_a_misplaced_import():
    sources = {
        "orchestrate.light": "import json\n",
        "orchestrate.slow": "import torch\n",
        "orchestrate.slow_through": "from orchestrate import slow\n",
        "orchestrate.user": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import numpy\n"
                             "def f():\n    import re\n    import torch\n    import wandb\n"
                             "    from orchestrate.slow_through import x\n    from orchestrate import light\n"
                             "    from . import slow\n    from .light import y\n"
                             "def __getattr__(name):\n    from orchestrate import light\n"),
        "orchestrate.api": "def launch():\n    from orchestrate import light\n    import shlex\n",
    }
    parsed = {m: (PACKAGE / f"{m.split('.')[-1]}.py", ast.parse(src)) for m, src in sources.items()}
    assert _misplaced_imports(parsed) == ["orchestrate/user.py:5 re", "orchestrate/user.py:9 orchestrate.light",
                                          "orchestrate/user.py:11 orchestrate.light", "orchestrate/api.py:3 shlex"]


def test_the_optional_extras_are_the_ones_pyproject_declares():
    project = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]
    required = {d.split(">")[0].split("=")[0].split("<")[0].strip() for d in project["dependencies"]}
    optional = {d.split(">")[0].split("=")[0].split("<")[0].strip()
                for extra, deps in project["optional-dependencies"].items() if extra != "dev" for d in deps}
    assert set(OPTIONAL_EXTRAS) == optional - required


def test_imports_sit_at_the_top_of_each_file():
    assert _misplaced_imports(SOURCES) == []
