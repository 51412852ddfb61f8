"""Run the orchestrate CLI in a fresh interpreter and report which heavy libraries it imported."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "tokenizers", "datasets", "deepspeed")
_SCRIPT = f"""
import json, sys
from orchestrate.cli import cli
code = 0
try:
    cli(prog_name="orchestrate", args=sys.argv[1:])
except SystemExit as exc:
    code = exc.code
print("\\n" + json.dumps({{"code": code, "heavy": [m for m in {HEAVY!r} if m in sys.modules]}}))
"""


@dataclass
class CliRun:
    code: int
    heavy: list[str]
    """The HEAVY modules in sys.modules when the command returned."""
    output: str


def run_cli(*args: str, cwd: Path = ROOT) -> CliRun:
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(cwd), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", _SCRIPT, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    *output, last = done.stdout.rstrip().splitlines()
    result = json.loads(last)
    return CliRun(result["code"], result["heavy"], "\n".join(output))
