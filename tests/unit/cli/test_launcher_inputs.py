"""Hostfiles, ports and SLURM fields through the CLI (issue 38, items 1, 9, 10): a bad value is one
message with exit 2, before anything is written; a good path with spaces comes back quoted."""

from __future__ import annotations

import shlex
from pathlib import Path

from tests.helpers.cli import assert_one_message, invoke

CONFIG = Path(__file__).parents[3] / "examples" / "tiny-gpt2.yaml"


def test_launch_refuses_a_hostfile_whose_hosts_ssh_would_read_as_options(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("-oProxyCommand=touch${IFS}/x slots=1\nnode-a slots=1\nnode-a;touch${IFS}/x slots=1\n")
    run = tmp_path / "run"
    result = invoke("launch", CONFIG, "--hosts", hosts, "--dry-run", "--run-dir", run)
    assert_one_message(result, f"{hosts}:1", f"{hosts}:3", "-oProxyCommand=touch${IFS}/x")
    assert f"{hosts}:2" not in result.output and not run.exists()


def test_every_port_flag_is_1_to_65535(tmp_path):
    assert_one_message(invoke("launch", CONFIG, "--gpus", 1, "--master-port", 99999, "--dry-run",
                              "--run-dir", tmp_path / "run"), "--master-port", "99999 is not a TCP port (1 to 65535)")
    hosts = tmp_path / "hosts"
    hosts.write_text("node-a slots=1\n")
    assert_one_message(invoke("launch", CONFIG, "--hosts", hosts, "--ssh-port", 0, "--dry-run"),
                       "--ssh-port", "0 is not a TCP port")
    assert not (tmp_path / "run").exists()


def test_slurm_refuses_a_partition_that_would_add_an_sbatch_option_before_writing(tmp_path):
    run = tmp_path / "run"
    result = invoke("slurm", CONFIG, "--nodes", 2, "--gpus", 1, "--partition", "gpu --wrap=touch", "--account",
                    "proj 42", "--run-dir", run)
    assert_one_message(result, "--partition", "--account", "'gpu --wrap=touch'")
    assert not run.exists()


def test_slurm_quotes_a_run_directory_with_spaces_in_the_script_and_the_hint(tmp_path):
    run = tmp_path / "my runs" / "it's"
    result = invoke("slurm", CONFIG, "--nodes", 2, "--gpus", 1, "--run-dir", run, "--set",
                    f"train.output_dir={tmp_path / 'out'}")
    assert result.exit_code == 0, result.output
    hint = next(line for line in result.output.splitlines() if line.startswith("submit with: "))
    assert shlex.split(hint.removeprefix("submit with: ")) == ["sbatch", str(run / "job.sbatch")]
    assert f'#SBATCH "--chdir={run}"' in (run / "job.sbatch").read_text().splitlines()


def test_an_ipv6_loopback_first_host_is_bracketed_alone_and_refused_before_other_hosts(tmp_path):
    """`[::1]` as the first host (addresses.py): alone, it is the rendezvous host, bracketed in the
    endpoint and plain after ssh's `--`; before another host, which cannot reach it, it is refused."""
    alone = tmp_path / "alone"
    alone.write_text("[::1] slots=1\n")
    result = invoke("launch", CONFIG, "--hosts", alone, "--dry-run", "--run-dir", tmp_path / "run")
    assert result.exit_code == 0, result.output
    line = next(x for x in (tmp_path / "run" / "launch.sh").read_text().splitlines() if x.startswith("ssh "))
    argv = shlex.split(line.removesuffix(" &"))
    assert argv[argv.index("--") + 1] == "::1" and "--rdzv-endpoint=[::1]:PORT" in shlex.split(argv[-1])
    two = tmp_path / "two"
    two.write_text("[::1] slots=1\nnode-b slots=1\n")
    assert_one_message(invoke("launch", CONFIG, "--hosts", two, "--dry-run", "--run-dir", tmp_path / "run2"),
                       "hostfile:1", "::1 is a loopback address, which the other hosts cannot reach")
