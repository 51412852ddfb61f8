"""Your own training loop, the pure and single-process parts: the `--` program, the torchrun
command and run directory it gets, the errors of the API, the sharded loader and the accumulating
optimizer. The 2-rank runs through the launcher are in test_own_loop_e2e.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from orchestrate import api
from orchestrate.cli import cli
from orchestrate.config.load import load_config
from orchestrate.errors import UserError
from orchestrate.launch.user_program import user_program
from orchestrate.loop_api import launch_state
from tests.helpers.plans import cpu_hardware

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "own_loop"
SCRIPT = EXAMPLE / "train.py"


def test_the_program_after_the_dashes_is_normalised(tmp_path: Path):
    assert user_program(["python", "train.py", "--epochs", "2"], cwd=EXAMPLE) == (str(SCRIPT), "--epochs", "2")
    assert user_program(["train.py"], cwd=EXAMPLE) == (str(SCRIPT),)
    assert user_program([sys.executable, "-m", "pkg.train", "-x"]) == ("-m", "pkg.train", "-x")
    assert user_program(["python3", "-m", "pkg.train"]) == ("-m", "pkg.train")


@pytest.mark.parametrize(("argv", "match"), [
    ([], "nothing to run"),
    (["python"], "no script"),
    (["python", "-m"], "needs a module"),
    (["python", "missing.py"], "does not exist"),
    (["/opt/other/bin/python", "train.py"], "another Python"),
])
def test_a_bad_program_is_one_user_error(argv: list[str], match: str):
    with pytest.raises(UserError, match=match) as err:
        user_program(argv, cwd=EXAMPLE)
    assert err.value.problems[0].where == "-- PROGRAM" and err.value.problems[0].fix


def test_dry_run_runs_the_script_under_the_plan_and_needs_no_data_section(tmp_path: Path):
    """A YAML without data: a plain launch refuses it (the example's model.module has no data.module);
    with a program the script's own data is used, and torchrun gets the plan path as the runner's
    argument, the script its argv."""
    config = load_config(EXAMPLE / "model.yaml", [f"train.output_dir={tmp_path}"])
    with pytest.raises(UserError, match="needs data.module"):
        api.launch(api.launch_request(config, cpu_hardware(2), dry_run=True, run_dir=tmp_path / "plain"))
    program = ("python", str(SCRIPT), "--epochs", "2")
    # api.launch's default transport runs the request's program (api.choose_transport(program=...))
    result = api.launch(api.launch_request(config, cpu_hardware(2), dry_run=True, run_dir=tmp_path / "own",
                                           program=program))
    tail = f"-m orchestrate.loop_api.run {tmp_path / 'own' / 'plan.json'} -- {SCRIPT} --epochs 2"
    assert result.command.endswith(tail)
    assert tail in (tmp_path / "own" / "launch.sh").read_text()
    assert (tmp_path / "own" / "fsdp.json").is_file()
    assert "ORCHESTRATE" not in result.command  # nothing but torchrun's and the libraries' variables


def test_cli_passes_everything_after_the_dashes_to_the_script(tmp_path: Path):
    res = CliRunner().invoke(cli, ["launch", str(EXAMPLE / "model.yaml"), "--gpus", "2", "--dry-run",
                                   "--run-dir", str(tmp_path / "run"), "--set", f"train.output_dir={tmp_path}",
                                   "--", "python", str(SCRIPT), "--dry-run", "--epochs", "3"])
    assert res.exit_code == 0, res.output
    assert f"-- {SCRIPT} --dry-run --epochs 3" in (tmp_path / "run" / "launch.sh").read_text()
    bad = CliRunner().invoke(cli, ["launch", str(EXAMPLE / "model.yaml"), "--dry-run", "--", "python", "nope.py"])
    assert bad.exit_code == 2 and "does not exist" in bad.output


def test_own_program_over_ssh_hosts_is_refused(tmp_path: Path):
    hosts = tmp_path / "hosts"
    hosts.write_text("node1 slots=1\n")
    with pytest.raises(UserError, match="this machine only"):
        api.choose_transport(hosts=hosts, program=("python", str(SCRIPT)))


@pytest.fixture
def no_launch(monkeypatch):
    monkeypatch.setattr(launch_state, "plan_path", None)
    monkeypatch.setattr(launch_state, "session", None)


def test_prepare_outside_a_launch_is_a_user_error_with_the_fix(no_launch):
    import orchestrate

    model = torch.nn.Linear(2, 2)
    with pytest.raises(UserError, match="not started by `orchestrate launch`") as err:
        orchestrate.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert "orchestrate launch CONFIG.yaml -- python SCRIPT" in err.value.problems[0].fix
    with pytest.raises(UserError, match="before orchestrate.prepare"):
        orchestrate.backward(model(torch.ones(1, 2)).sum())
    with pytest.raises(UserError, match="before orchestrate.prepare"):
        orchestrate.save()
    with pytest.raises(UserError, match="JSON values only"):
        orchestrate.save(weights=torch.ones(2))


def test_prepare_twice_is_a_user_error(no_launch, monkeypatch, tmp_path: Path):
    import orchestrate

    monkeypatch.setattr(launch_state, "plan_path", tmp_path / "plan.json")
    monkeypatch.setattr(launch_state, "session", object())  # what the first prepare left
    model = torch.nn.Linear(2, 2)
    with pytest.raises(UserError, match="called twice"):
        orchestrate.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_import_orchestrate_stays_cheap():
    code = ("import sys, orchestrate; assert callable(orchestrate.prepare); "
            "print(sorted(m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


def test_loader_shards_reshuffles_per_epoch_and_restores_its_epoch():
    from torch.utils.data import DataLoader, TensorDataset

    from orchestrate.loop_api.loader import distributed_loader

    data = TensorDataset(torch.arange(32))
    seen = []
    for rank in (0, 1):
        loader = distributed_loader(DataLoader(data, batch_size=64, shuffle=True), 4, rank, 2, 0, torch.device("cpu"))
        first, second = [torch.cat([b[0] for b in loader]) for _ in range(2)]
        assert len(first) == 16 and loader.batch_size == 4 and not torch.equal(first, second)
        seen.append(first)
        again = distributed_loader(DataLoader(data, batch_size=64, shuffle=True), 4, rank, 2, 0, torch.device("cpu"))
        again.load_state_dict({"epoch": 1})
        assert torch.equal(torch.cat([b[0] for b in again]), second)
    assert sorted(torch.cat(seen).tolist()) == list(range(32))  # the ranks split the data between them


def test_planned_optimizer_accumulates_then_steps_once():
    from orchestrate.loop_api.optim import PlannedOptimizer

    model = torch.nn.Linear(3, 1, bias=False)
    torch.nn.init.ones_(model.weight)
    inner = torch.optim.SGD(model.parameters(), lr=1.0)
    opt = PlannedOptimizer(inner, model, accumulation=2, grad_clip=None, scaler=None)
    batches = [torch.tensor([[1.0, 0.0, 0.0]]), torch.tensor([[0.0, 3.0, 0.0]])]
    for i, x in enumerate(batches):
        opt.zero_grad()
        opt.backward(model(x).sum())
        opt.step()
        if i == 0:
            assert opt.steps == 0 and torch.equal(model.weight, torch.ones(1, 3))  # no step mid-accumulation
    # one step with the mean gradient of the two micro-batches: [0.5, 1.5, 0]
    assert opt.steps == 1 and torch.allclose(model.weight, torch.tensor([[0.5, -0.5, 1.0]]))
    opt.zero_grad()
    assert model.weight.grad is None
    opt.restore(5)
    assert (opt.steps, opt.micro_steps) == (5, 10)


def test_fsdp_shards_the_repeated_blocks_of_a_module_without_plan_classes():
    from orchestrate.loop_api.wrap import _blocks

    net = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    assert _blocks(torch.nn.ModuleDict({"body": net}), ["GPT2Block"]) == [net[0], net[2]]  # ReLU has no weights
    assert _blocks(torch.nn.Linear(2, 2), None) == []


def _run(tmp_path: Path, body: str, *args: str) -> subprocess.CompletedProcess:
    """`python -m orchestrate.loop_api.run PLAN -- script.py ARGS`, as torchrun starts it on a rank."""
    plan = tmp_path / "plan.json"
    plan.write_text("{}")
    script = tmp_path / "script.py"
    script.write_text(body)
    return subprocess.run([sys.executable, "-m", "orchestrate.loop_api.run", str(plan), "--", str(script), *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_the_runner_hands_the_script_its_own_argv_and_the_plan_in_process(tmp_path: Path):
    body = ("import sys, os\nfrom orchestrate.loop_api import launch_state\n"
            "print(sys.argv[1:], sys.path[0] == os.path.dirname(__file__), launch_state.plan_path.name, __name__)\n")
    out = _run(tmp_path, body, "--epochs", "2")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['--epochs', '2'] True plan.json __main__"


def test_the_runner_turns_a_user_error_into_exit_2_and_keeps_the_scripts_exit_code(tmp_path: Path):
    failed = _run(tmp_path, "from orchestrate.errors import UserError\nraise UserError('bad input')\n")
    assert failed.returncode == 2 and "error: bad input" in failed.stderr and "Traceback" not in failed.stderr
    assert _run(tmp_path, "import sys\nsys.exit(3)\n").returncode == 3
    assert _run(tmp_path, "import sys\nsys.exit('stopped: no data')\n").returncode == 1


def test_batches_reach_the_device_with_float_inputs_in_the_engines_dtype():
    from orchestrate.loop_api.loader import to_device

    batch = (torch.ones(2, 3), torch.tensor([1, 2]), {"mask": torch.zeros(2)})
    x, y, extra = to_device(batch, torch.device("cpu"), torch.bfloat16)
    assert (x.dtype, y.dtype, extra["mask"].dtype) == (torch.bfloat16, torch.int64, torch.bfloat16)
    assert to_device(batch, torch.device("cpu"))[0].dtype == torch.float32
