"""The shape of the package, read from its source with `ast`: no import cycles, the launcher side
(launch/, transports/) and worker/ apart, a thin CLI, every run-directory name and exit code defined
once, `orchestrate plan` free of torch. File and function length is a guideline kept by judgement:
the ones past it are printed, not failed."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "orchestrate"
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


def test_cli_imports_only_the_api_and_the_errors():
    assert GRAPH["orchestrate.cli"] <= {"orchestrate.api", "orchestrate.errors"}


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


FILE_LINES, FUNCTION_LINES = 600, 80
"""A guideline, not a cap: a file is as long as its one job needs. Past it, a file or function is
printed by the test below so that a reviewer looks at it; cutting one into fragments to fit is worse."""

HEAVY = ("torch", "transformers", "deepspeed", "peft", "bitsandbytes")
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
    """`orchestrate plan` of a family the formulas cover (llama, gpt2) stays free of torch and the
    training libraries (its start-up is a fraction of a second; torch alone takes seconds), for
    full fine-tuning, QLoRA, method auto and pruning. In a fresh interpreter: this one has them."""
    code = (
        "import sys\nfrom click.testing import CliRunner\nfrom orchestrate.cli import cli\n"
        f"for args in {PLANS!r}:\n"
        "    result = CliRunner().invoke(cli, ['plan', *args])\n"
        "    assert result.exit_code in (0, 2) and 'candidate' in result.output, (args, result.output)\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=PACKAGE.parent, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
