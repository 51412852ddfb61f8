"""Every `from orchestrate... import name` in bench/ (also inside functions) names something that
exists: the benchmarks run rarely, so a renamed module must fail here, not in a benchmark run. A bench
with a short mode runs it here."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench"


def _imports(path: Path) -> list[tuple[str, str]]:
    tree = ast.parse(path.read_text(), str(path))
    return [(node.module, alias.name) for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "orchestrate"
            for alias in node.names]


@pytest.mark.parametrize("path", sorted(BENCH.glob("*.py")), ids=lambda p: p.name)
def test_bench_imports_resolve(path: Path):
    missing = []
    for module, name in _imports(path):
        try:
            target = importlib.import_module(module)
        except ImportError as exc:
            missing.append(f"{module}: {exc}")
            continue
        if not hasattr(target, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                missing.append(f"{module}.{name}")
    assert missing == []


def test_startup_stages_wraps_functions_that_exist():
    """bench/startup_stages.py wraps launcher and worker functions by name; a rename must fail here."""
    import orchestrate.agent.process as process
    import orchestrate.data.pipeline as pipeline
    import orchestrate.launch.session as session
    import orchestrate.transports.local.agent as warm_agent
    import orchestrate.worker.stages as stages
    from bench.startup_stages import STAGES

    for module, name in [(session, "prepare_run_dir"), (pipeline, "prepare_for_plan"), (warm_agent.WarmAgent, "start"),
                         (warm_agent.WarmAgent, "run"), (process, "import_worker_code"), (process, "main"),
                         *((stages, s) for s in STAGES)]:
        assert callable(getattr(module, name, None)), f"{module.__name__}.{name}"
    assert warm_agent.AGENT_PROGRAM == ("-m", "orchestrate.agent")  # what the bench replaces


def test_tiled_mlp_speed_runs_its_short_mode(capsys):
    """bench/tiled_mlp_speed.py --short: a row per arm, each tiled arm's tensor peak under the untiled one."""
    from bench.tiled_mlp_speed import main

    main(["--short"])
    lines = capsys.readouterr().out.splitlines()
    rows = lines[next(i for i, line in enumerate(lines) if line.startswith("arm ")) + 1:]
    assert [row[:24].strip() for row in rows] == ["untiled", "4 tiles, deepspeed", "4 tiles, checkpoint"]
    peaks = [float(row.split()[-1]) for row in rows]
    assert max(peaks[1:]) < peaks[0]


def test_fits_8gb_runs_its_short_mode_and_prints_the_readme_s_rows(capsys):
    """bench/fits_8gb.py --short: the README's "what fits on 8 GiB" rows, each of them in the README."""
    from bench.fits_8gb import main

    assert main(["--short"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == 9
    readme = (BENCH.parent / "README.md").read_text()
    assert [row for row in rows if row not in readme] == []
