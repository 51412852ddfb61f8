"""SLURM batch jobs: rendered scripts against golden files and real `sbatch --test-only`, a real
two-node job (two slurmd on loopback) running a gloo all_reduce through the rendered script, and
the USR1 -> checkpoint -> requeue -> resume path.

Regenerate the golden files after an intended change of the rendering, then review the diff:
    .venv/bin/python -m tests.unit.transports.test_slurm --regen
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrate.errors import UserError
from orchestrate.transports.slurm import cluster as slurm_cluster
from orchestrate.transports.slurm.cluster import (
    detect_slurm_allocation,
    expand_hostlist,
    parse_job_id,
    parse_scontrol_record,
    srun_argv_in_allocation,
)
from orchestrate.transports.slurm.job import (
    SlurmJob,
    parse_time_limit,
    render_sbatch,
    validate_job,
    without_teed_prefix_after_label,
)
from orchestrate.transports.slurm.transport import _run_srun
from tests.daemons import require_slurm, wait_job

GOLDEN_DIR = Path(__file__).resolve().parents[2] / "golden" / "slurm"
PYTHON = "/opt/venv/bin/python"

GOLDEN = {
    "gpu-2x4": SlurmJob(run_dir=Path("/runs/tiny-gpt2-20250101-120000"), nodes=2, procs_per_node=4,
                        gpus_per_node=4, cpus_per_task=32, mem="200G", time="4:00:00", partition="gpu",
                        account="proj42", python=PYTHON,
                        torchrun_args=("--max-restarts", "0", "--log-dir", "/runs/tiny-gpt2-20250101-120000/logs")),
    "cpu-2x2": SlurmJob(run_dir=Path("/runs/cpu"), nodes=2, procs_per_node=2, python=PYTHON, shutdown_grace_s=90,
                        env=(("OMP_NUM_THREADS", "1"), ("PET_SIGNALS_TO_HANDLE", "SIGTERM,SIGUSR1"))),
    "no-requeue-fixed-port": SlurmJob(run_dir=Path("/runs/x"), nodes=3, procs_per_node=8, gpus_per_node=8,
                                      time="1-00:00:00", requeue=False, signal_lead_s=0, rdzv_port=29400,
                                      job_name="big-run", python=PYTHON, extra_sbatch=("--exclusive",)),
}


def regen() -> None:
    GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    for name, job in GOLDEN.items():
        (GOLDEN_DIR / f"{name}.sbatch").write_text(render_sbatch(job))


# --- Pure -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_rendering_matches_golden_file(name):
    golden = GOLDEN_DIR / f"{name}.sbatch"
    assert golden.is_file(), "run: .venv/bin/python -m tests.unit.transports.test_slurm --regen"
    assert render_sbatch(GOLDEN[name]) == golden.read_text(), (
        "rendering changed; if intended run `.venv/bin/python -m tests.unit.transports.test_slurm --regen` and review the diff")


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_rendered_script_is_valid_bash(name, tmp_path):
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(GOLDEN[name]))
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(("scontrol", "addr"), [
    ("NodeName=n2 Arch=x86_64 NodeAddr=10.1.2.3 NodeHostName=n2 Version=22.05", "10.1.2.3"),
    ("", "n2"),  # scontrol unavailable or silent: the node's name
])
def test_node_shell_gives_torchrun_the_nodes_slurm_address(scontrol, addr, tmp_path):
    from orchestrate.transports.slurm.job import _NODE_SHELL

    fake = tmp_path / "scontrol"
    fake.write_text(f"#!/bin/sh\nprintf '%s\\n' '{scontrol}'\n")
    fake.chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "SLURMD_NODENAME": "n2", "SLURM_NODEID": "1"}
    proc = subprocess.run(["bash", "-c", _NODE_SHELL, "echo", "--nnodes=2"], env=env, capture_output=True, text=True)
    assert proc.stdout.split() == ["-m", "torch.distributed.run", f"--local-addr={addr}", "--rdzv-conf=is_host=0",
                                   "--nnodes=2"], proc.stderr


def test_script_asks_for_what_the_job_needs():
    text = render_sbatch(GOLDEN["gpu-2x4"])
    for line in ["#SBATCH --nodes=2", "#SBATCH --gpus-per-node=4", "#SBATCH --cpus-per-task=32",
                 "#SBATCH --mem=200G", "#SBATCH --time=4:00:00", "#SBATCH --signal=B:USR1@120",
                 "#SBATCH --requeue", "#SBATCH --open-mode=append", "#SBATCH --account=proj42"]:
        assert line in text.splitlines()
    # One task per node, each running torchrun from the absolute interpreter with c10d on the head.
    assert "--ntasks-per-node=1" in text and f"{PYTHON} --nnodes=\"$SLURM_NNODES\" --nproc-per-node=4" in text
    assert '--rdzv-backend=c10d --rdzv-endpoint="$head_addr:$rdzv_port" --rdzv-id="$SLURM_JOB_ID"' in text
    assert text.rstrip().endswith('exit "$rc"')
    plain = render_sbatch(GOLDEN["no-requeue-fixed-port"])
    assert "scontrol requeue" not in plain and "#SBATCH --signal" not in plain and "#SBATCH --no-requeue" in plain
    assert "rdzv_port=29400" in plain and "#SBATCH --job-name=big-run" in plain


def test_invalid_job_lists_every_problem():
    job = SlurmJob(run_dir=Path("rel"), nodes=0, procs_per_node=8, gpus_per_node=4, mem="lots",
                   time="soon", python="python", signal_lead_s=-1, job_name="my run")
    with pytest.raises(UserError) as e:
        validate_job(job)
    where = [p.where for p in e.value.problems]
    assert where == ["--nodes", "--gpus-per-node", "--job-name", "--mem", "--time", "--signal", "python", "run_dir"]
    with pytest.raises(UserError, match="cannot write the SLURM job") as e:
        render_sbatch(SlurmJob(run_dir=Path("/r"), nodes=1, procs_per_node=1, time="2:00", python=PYTHON))
    assert "120 s before a 120 s limit" in str(e.value)
    with pytest.raises(UserError, match="would kill them mid-checkpoint") as e:
        validate_job(SlurmJob(run_dir=Path("/r"), nodes=1, procs_per_node=1, python=PYTHON, signal_lead_s=60,
                              shutdown_grace_s=120, env=(("1BAD", "x"),)))
    assert [p.where for p in e.value.problems] == ["--signal", "env"]


def test_requeue_marker_is_the_run_contracts_and_env_is_exported_unless_set():
    text = render_sbatch(GOLDEN["cpu-2x2"])
    assert "[ -f /runs/cpu/REQUEUE ]" in text and "export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=90" in text
    # The exports honour what the job's environment already has (sbatch passes the submitter's on).
    exports = "\n".join(line for line in text.splitlines() if line.startswith("[ -n "))
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "4"}
    out = subprocess.run(["bash", "-c", exports + "\necho $OMP_NUM_THREADS $PET_SIGNALS_TO_HANDLE"], env=env,
                         capture_output=True, text=True, check=True).stdout
    assert out.split() == ["4", "SIGTERM,SIGUSR1"]


@pytest.mark.parametrize("text,seconds", [
    ("30", 1800), ("10:30", 630), ("4:00:00", 14400), ("1-0", 86400), ("1-2:03", 93780),
    ("2-00:00:05", 172805)])
def test_parse_time_limit(text, seconds):
    assert parse_time_limit(text) == seconds


@pytest.mark.parametrize("hostlist,hosts", [
    ("n1", ["n1"]), ("n[1-2]", ["n1", "n2"]), ("gpu[08-10,12],login", ["gpu08", "gpu09", "gpu10", "gpu12", "login"]),
    ("r[1-2]-n[1-2]", ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]), ("a,b[3],c", ["a", "b3", "c"])])
def test_expand_hostlist(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


def test_parse_slurm_answers():
    record = parse_scontrol_record("JobId=7 JobName=x UserId=root(0) JobState=COMPLETED Reason=None "
                                   "Restarts=1 ExitCode=0:0 NodeList=n[1-2] Command=/a b/c.sh")
    assert (record["JobId"], record["JobState"], record["Restarts"], record["ExitCode"]) == ("7", "COMPLETED", "1", "0:0")
    assert parse_job_id("42\n") == "42" and parse_job_id("42;cluster\n") == "42"
    with pytest.raises(ValueError):
        parse_job_id("sbatch: error: nope")


def test_detect_allocation_from_slurm_environment():
    assert detect_slurm_allocation({"PATH": "/bin"}) is None
    step = detect_slurm_allocation({"SLURM_JOB_ID": "12", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu[1-2]",
                                    "SLURM_NODEID": "1", "SLURM_GPUS_ON_NODE": "4", "SLURM_CPUS_ON_NODE": "32",
                                    "SLURM_STEP_ID": "0"})
    assert step == slurm_cluster.SlurmAllocation(job_id="12", nnodes=2, nodes=("gpu1", "gpu2"), node_id=1, gpus_on_node=4,
                                         cpus_on_node=32, in_step=True)
    assert step.head_node == "gpu1"
    salloc = detect_slurm_allocation({"SLURM_JOB_ID": "13", "SLURM_NNODES": "3", "SLURM_NODELIST": "a[1-3]"})
    assert salloc is not None and salloc.node_id is None and not salloc.in_step and salloc.nnodes == 3
    # An salloc shell has no SLURM_GPUS_ON_NODE / SLURM_CPUS_ON_NODE, only the job-wide variables.
    shell = detect_slurm_allocation({"SLURM_JOB_ID": "14", "SLURM_JOB_NUM_NODES": "2", "SLURM_GPUS_PER_NODE": "a100:4",
                                     "SLURM_JOB_CPUS_PER_NODE": "16(x2)"})
    assert (shell.gpus_on_node, shell.cpus_on_node) == (4, 16)


def test_srun_inside_an_allocation_targets_the_head_node_address(monkeypatch):
    monkeypatch.setattr(slurm_cluster, "head_address", lambda node: {"gpu1": "10.0.0.1"}[node])
    alloc = detect_slurm_allocation({"SLURM_JOB_ID": "20001", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "gpu[1-2]"})
    argv = srun_argv_in_allocation(GOLDEN["cpu-2x2"], alloc)
    assert argv[:3] == ["srun", "--nodes=2", "--ntasks-per-node=1"]
    assert "--rdzv-endpoint=10.0.0.1:20001" in argv and "--rdzv-id=20001" in argv and "--nnodes=2" in argv
    assert argv[-3:] == ["-m", "orchestrate.worker", "/runs/cpu/plan.json"]



@pytest.mark.parametrize(("line", "shown"), [
    ("0: [default0]:step 1/4 loss 2.31\n", "0: step 1/4 loss 2.31\n"),
    (" 3: [default0]:done\n", " 3: done\n"),                  # srun pads labels to the widest task number
    ("12: [default0]:[default0]:x\n", "12: [default0]:x\n"),  # only torchrun's own prefix goes
    ("1: srun: error: node2: task 1: Exited\n", "1: srun: error: node2: task 1: Exited\n"),
    ("[default0]:no label\n", "[default0]:no label\n"),      # not srun's step output: left as it is
    ("0: [default1]:another local rank\n", "0: [default1]:another local rank\n"),
])
def test_srun_lines_keep_the_node_label_and_lose_torchrun_s_prefix(line, shown):
    assert without_teed_prefix_after_label(line) == shown


def test_srun_inside_an_allocation_shows_its_output_without_torchrun_s_prefix(capfd):
    """_run_srun relays srun's stdout and stderr through the same filter (a stand-in prints srun's lines)."""
    stand_in = [sys.executable, "-c", "import sys; print('0: [default0]:step 1/4'); "
                "print('1: [default0]:oops', file=sys.stderr); sys.exit(3)"]
    said = []
    assert _run_srun(stand_in, {}, 5.0, said.append) == 3
    out, err = capfd.readouterr()
    assert (out, err) == ("0: step 1/4\n", "1: oops\n")
    assert said and "srun exited with code 3" in said[0]

# --- Real cluster ---------------------------------------------------------------------------------


@pytest.fixture
def cluster(monkeypatch):
    return require_slurm(monkeypatch)


@pytest.mark.daemons
@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_scripts_pass_sbatch_test_only(name, cluster, tmp_path):
    # The test cluster is small (one partition, 2 nodes of 2 CPUs and 4 fake GPUs): sizes are cut
    # down to fit; everything else is the golden script as users get it.
    golden = GOLDEN[name]
    job = dataclasses.replace(
        golden, partition=cluster.partition, mem=golden.mem and "1G", nodes=min(golden.nodes, len(cluster.nodes)),
        gpus_per_node=min(golden.gpus_per_node, cluster.gpus_per_node),
        procs_per_node=min(golden.procs_per_node, cluster.gpus_per_node or golden.procs_per_node),
        cpus_per_task=min(golden.cpus_per_task or golden.procs_per_node, cluster.cpus_per_node))
    script = slurm_cluster.write_sbatch(job, tmp_path / "job.sbatch")
    message = slurm_cluster.test_only(script)
    assert re.search(r"Job \d+ to start at .* on nodes n\[1-2\]|Job \d+ to start at .* on nodes n1", message), message


@pytest.mark.daemons
def test_sbatch_rejects_an_impossible_job(cluster, tmp_path):
    job = SlurmJob(run_dir=tmp_path, nodes=len(cluster.nodes) + 1, procs_per_node=1, partition=cluster.partition,
                   python=sys.executable)
    with pytest.raises(UserError, match="SLURM rejected the job script") as e:
        slurm_cluster.test_only(slurm_cluster.write_sbatch(job))
    assert "node" in str(e.value).lower()


REPO = str(Path(__file__).resolve().parents[3])
ALLREDUCE = """\
import json, os, sys
sys.path.insert(0, {repo!r})  # orchestrate itself, also where it is not pip-installed
import torch, torch.distributed as dist
from orchestrate.transports.slurm.cluster import detect_slurm_allocation
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
a = detect_slurm_allocation()
# One write per line: the ranks share srun's pipe and torchrun runs them unbuffered (`python -u`),
# where print() writes the text and the newline separately, so lines could interleave.
os.write(1, ("RESULT " + json.dumps({{"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t.item(),
         "group_rank": int(os.environ["GROUP_RANK"]), "node_id": a.node_id, "nnodes": a.nnodes,
         "in_step": a.in_step, "job_id": a.job_id}}) + "\\n").encode())
dist.destroy_process_group()
"""


@pytest.mark.daemons
@pytest.mark.slow
def test_two_node_job_runs_torchrun_allreduce(cluster, tmp_path):
    (tmp_path / "allreduce.py").write_text(ALLREDUCE.format(repo=REPO))
    job = SlurmJob(run_dir=tmp_path, nodes=2, procs_per_node=2, partition=cluster.partition, time="5:00",
                   python=sys.executable, program=(str(tmp_path / "allreduce.py"),))
    job_id = slurm_cluster.submit(slurm_cluster.write_sbatch(job))
    info = wait_job(job_id, timeout=180)
    output = (tmp_path / f"slurm-{job_id}.out").read_text()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), output
    import json

    results = [json.loads(line.split("RESULT ", 1)[1]) for line in output.splitlines() if "RESULT " in line]
    assert sorted(r["rank"] for r in results) == [0, 1, 2, 3], output
    assert {r["sum"] for r in results} == {10.0} and {r["world"] for r in results} == {4}
    # Two torchruns (one per node) with two workers each, all inside the job's step.
    assert sorted(r["group_rank"] for r in results) == [0, 0, 1, 1]
    assert sorted(r["node_id"] for r in results) == [0, 0, 1, 1]
    assert {(r["nnodes"], r["in_step"], r["job_id"]) for r in results} == {(2, True, job_id)}
    assert "rendezvous 127.0.0.1:" in output


CHECKPOINTING = """\
import os, signal, sys, time
from pathlib import Path
out = Path(sys.argv[1])
rank = os.environ["RANK"]
checkpoint = out / f"checkpoint-{rank}"
if checkpoint.exists():
    print(f"rank {rank}: resumed from {checkpoint.read_text()}", flush=True)
    sys.exit(0)

def on_term(signum, frame):
    # Cancelling the step signals every task and torchrun forwards SIGTERM too: act once.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    checkpoint.write_text(f"step-of-rank-{rank}")
    print(f"rank {rank}: SIGTERM: checkpoint written", flush=True)
    sys.exit(75)

signal.signal(signal.SIGTERM, on_term)  # no USR1 handler: USR1 reaching a worker would kill it
(out / f"training-{rank}").touch()
while True:
    time.sleep(0.1)
"""


@pytest.mark.daemons
@pytest.mark.slow
def test_usr1_checkpoints_requeues_and_resumes(cluster, tmp_path):
    (tmp_path / "ckpt.py").write_text(CHECKPOINTING)
    job = SlurmJob(run_dir=tmp_path, nodes=2, procs_per_node=1, partition=cluster.partition, time="10:00",
                   signal_lead_s=60, python=sys.executable, program=(str(tmp_path / "ckpt.py"), str(tmp_path)))
    job_id = slurm_cluster.submit(slurm_cluster.write_sbatch(job))
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"training-{r}").exists() for r in (0, 1)):
        assert time.monotonic() < deadline, "workers never started"
        assert slurm_cluster.job_info(job_id)["JobState"] in ("PENDING", "CONFIGURING", "RUNNING"), slurm_cluster.job_info(job_id)
        time.sleep(0.1)
    # What Slurm does before the time limit (--signal=B:USR1@60), sent now by hand.
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True)
    info = wait_job(job_id, timeout=180)
    output = (tmp_path / f"slurm-{job_id}.out").read_text()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), output
    assert "USR1: asking the workers to checkpoint" in output
    assert sorted(re.findall(r"rank (\d): SIGTERM: checkpoint written", output)) == ["0", "1"], output
    assert f"requeueing job {job_id}" in output and "(restart 1)" in output
    assert sorted(re.findall(r"rank (\d): resumed from step-of-rank-\1", output)) == ["0", "1"], output


if __name__ == "__main__" and "--regen" in sys.argv:
    regen()
