"""Multi-host launch over SSH: hostfile parsing, the remote command wrapper, and real launches on a
real sshd (two ssh config aliases of 127.0.0.1 as two "hosts"): a torchrun gloo all_reduce across
both, a failing host stopping the other, Ctrl-C stopping all, and host-key checking."""

from __future__ import annotations

import dataclasses
import io
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from orchestrate.errors import UserError
from orchestrate.transports.ssh import hosts as ssh_commands
from orchestrate.transports.ssh import remote as ssh
from orchestrate.transports.ssh.hosts import Host, load_hostfile, node_commands, parse_hostfile
from orchestrate.transports.ssh.remote import (
    HostFailure,
    SshOptions,
    plan_commands,
    run_commands,
    run_on_hosts,
)
from tests.daemons import require_sshd

PYTHON = sys.executable

# --- Hostfile -------------------------------------------------------------------------------------



def launch_on_hosts(hosts, program, *, python, options, out=None, **kwargs):
    """torchrun on every host running `program` (what the SSH transport does with the worker),
    waiting for all of them; HostFailure when a host fails."""
    commands = plan_commands(hosts, program, python=python, options=options, **kwargs)
    return run_commands(commands, options, out)


def test_hostfile_with_comments_and_blank_lines():
    text = "# cluster\n\nnode-a slots=4   # head\n  node-b\tslots=2\n10.0.0.7 slots=1\n"
    assert parse_hostfile(text) == [Host("node-a", 4, 3), Host("node-b", 2, 4), Host("10.0.0.7", 1, 5)]


def test_hostfile_errors_name_every_bad_line():
    text = "a slots=4\nb\nc slots=0\nd slots=x\na slots=2\nroot@e slots=1\nf:2222 slots=1\ng slots=1 extra\n"
    with pytest.raises(UserError) as e:
        parse_hostfile(text, "hosts.txt")
    where = [p.where for p in e.value.problems]
    assert where == [f"hosts.txt:{n}" for n in (2, 3, 4, 5, 6, 7, 8)]
    assert "first on line 1" in str(e.value) and "user and port" in str(e.value)


def test_hostfile_empty_or_missing(tmp_path):
    with pytest.raises(UserError, match="hostfile"):
        parse_hostfile("# nothing\n")
    with pytest.raises(UserError) as e:
        load_hostfile(tmp_path / "nope")
    assert e.value.problems[0].where == "--hosts"


# --- Pure launch parts ----------------------------------------------------------------------------


def test_node_commands_put_the_rendezvous_on_the_first_host():
    hosts = [Host("a", 2, 1), Host("b", 4, 2)]
    cmds = node_commands(hosts, python="/venv/bin/python", addresses=["10.0.0.1", "10.0.0.2"],
                         rdzv_endpoint="10.0.0.1:29400", rdzv_id="r1",
                         program=["-m", "orchestrate.worker", "/runs/x/plan.json"], torchrun_args=["--max-restarts=0"])
    assert [(c.host, c.rank) for c in cmds] == [("a", 0), ("b", 1)]
    assert cmds[1].argv == ("/venv/bin/python", "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=4",
                            "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.1:29400", "--rdzv-id=r1",
                            "--rdzv-conf=is_host=0", "--local-addr=10.0.0.2", "--max-restarts=0",
                            "-m", "orchestrate.worker", "/runs/x/plan.json")
    assert {"--rdzv-conf=is_host=1", "--nproc-per-node=2", "--local-addr=10.0.0.1"} <= set(cmds[0].argv)
    with pytest.raises(UserError, match="absolute interpreter"):
        node_commands(hosts, python="python3", addresses=["x", "y"], rdzv_endpoint="x:1", rdzv_id="r",
                      program=["a.py"])


def test_remote_command_reports_its_process_group_and_becomes_the_command(tmp_path):
    # What sshd does with it: run it through the login shell, in a session of its own.
    line = ssh_commands.remote_command([PYTHON, "-c", "import os, sys; print('pgid', os.getpgrp(), sys.argv[1:])",
                               "it's", "$HOME"])
    proc = subprocess.run(["sh", "-c", line], capture_output=True, text=True, start_new_session=False)
    tag, pgid = proc.stdout.splitlines()[0].split()
    assert tag == ssh_commands.PGID_TAG and proc.returncode == 0
    assert proc.stdout.splitlines()[1] == f"pgid {pgid} [\"it's\", '$HOME']"  # same group, arguments intact
    assert int(pgid) != os.getpgrp()  # not ours: it made a group of its own


def test_remote_command_adds_the_environment_unless_the_host_has_it():
    line = ssh_commands.remote_command([PYTHON, "-c", "import os; print(os.environ['A'], os.environ['B'])"],
                              env=(("A", "from plan"), ("B", "from plan")))
    env = {"PATH": os.environ["PATH"], "B": "host's own"}
    proc = subprocess.run(["sh", "-c", line], capture_output=True, text=True, env=env)
    assert proc.stdout.splitlines()[1] == "from plan host's own", proc.stderr


def test_line_writer_prefixes_whole_lines_and_takes_the_pgid():
    lines, pgids = [], []
    w = ssh._LineWriter("[a:0]", lines.append, pgids.append)
    for chunk in [f"{ssh_commands.PGID_TAG} 4", "2\nhel", "lo\r\nwor", "ld\n", "tail"]:
        w.write(chunk)
    w.close()
    assert pgids == [42] and lines == ["[a:0] hello", "[a:0] world", "[a:0] tail"]


def test_stop_script_kills_the_group_and_workers_in_other_sessions(marker):
    # Like torchrun: the group leader ignores SIGTERM here (worst case) and its worker lives in a
    # session of its own, out of reach of a signal to the group.
    leader = subprocess.Popen([PYTHON, "-c", (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)', sys.argv[1]], start_new_session=True)\n"
        "print('started', flush=True)\n"
        "time.sleep(300)\n"), marker], start_new_session=True, stdout=subprocess.PIPE, text=True)
    assert leader.stdout.readline().strip() == "started"
    assert len(_left_running(marker).splitlines()) == 2
    proc = subprocess.run([PYTHON, "-c", ssh._STOP, str(leader.pid), "0.5"], capture_output=True, text=True, timeout=30)
    assert proc.stdout.strip() == f"stopped process group {leader.pid} (killed 2 that outlived the grace period)", proc.stderr
    leader.wait(timeout=10)
    assert _left_running(marker) == ""


def test_loopback_head_with_remote_hosts_is_refused(tmp_path):
    config = tmp_path / "ssh_config"
    config.write_text("Host head\n  HostName 127.0.0.1\nHost far\n  HostName 10.1.2.3\n")
    with pytest.raises(UserError, match="cannot host the rendezvous"):
        launch_on_hosts([Host("head", 1, 1), Host("far", 1, 2)], ["x.py"], python=PYTHON,
                        options=SshOptions(ssh_config=config))
    assert ssh_commands.is_loopback("127.0.1.1") and ssh_commands.is_loopback("::1") and not ssh_commands.is_loopback("node-a")


# --- Real sshd ------------------------------------------------------------------------------------


@pytest.fixture
def sshd():
    return require_sshd()


def _options(sshd, **kw) -> SshOptions:
    return SshOptions(ssh_config=sshd.ssh_config, stop_grace_s=5, **kw)


def _hosts(sshd) -> list[Host]:
    return [Host(alias, 1, i + 1) for i, alias in enumerate(sshd.aliases)]


ALLREDUCE = """\
import os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"RESULT rank={dist.get_rank()} world={dist.get_world_size()} group_rank={os.environ['GROUP_RANK']} "
      f"sum={t.item():.0f} marker={sys.argv[1]}", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.daemons
@pytest.mark.slow
def test_two_hosts_run_torchrun_allreduce(sshd, tmp_path):
    (tmp_path / "allreduce.py").write_text(ALLREDUCE)
    out = io.StringIO()
    results = launch_on_hosts(_hosts(sshd), [str(tmp_path / "allreduce.py"), "m1"], python=PYTHON,
                              options=_options(sshd), out=out)
    text = out.getvalue()
    assert [(r.host, r.exit_code) for r in results] == [(a, 0) for a in sshd.aliases], text
    found = re.findall(r"^\[(orch-[ab]):(\d)\] RESULT rank=(\d) world=2 group_rank=(\d) sum=3 marker=m1$", text, re.M)
    assert sorted((host, pos) for host, pos, _, _ in found) == [("orch-a", "0"), ("orch-b", "1")], text
    # Distinct node ranks (c10d hands them out) and global ranks across the two hosts.
    assert sorted(g for *_, g in found) == ["0", "1"] and sorted(r for _, _, r, _ in found) == ["0", "1"]


SLEEPER = """\
import os, sys, time
from pathlib import Path
Path(sys.argv[1], f"pid-{sys.argv[-1]}").write_text(str(os.getpid()))
print(f"worker on {sys.argv[-1]} waiting", flush=True)
time.sleep(300)
"""


def _sleepers(sshd, tmp_path, marker):
    """Both hosts run torchrun with a worker that sleeps; each worker records its pid by host."""
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    cmds = node_commands(_hosts(sshd), python=PYTHON, addresses=["127.0.0.1"] * len(sshd.aliases),
                         rdzv_endpoint=f"127.0.0.1:{_free_port()}",
                         rdzv_id=uuid.uuid4().hex[:8], program=[str(tmp_path / "sleeper.py"), str(tmp_path), marker])
    return [dataclasses.replace(c, argv=(*c.argv, c.host)) for c in cmds]


def _free_port() -> int:
    from orchestrate.ports import free_port

    return free_port()


def _wait_for_pids(tmp_path, hosts, timeout=90) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = {h: tmp_path / f"pid-{h}" for h in hosts}
        if all(f.exists() and f.read_text() for f in files.values()):
            return {h: int(f.read_text()) for h, f in files.items()}
        time.sleep(0.1)
    raise AssertionError("workers did not start")


def _left_running(marker: str) -> str:
    return subprocess.run(["pgrep", "-af", marker], capture_output=True, text=True).stdout


@pytest.fixture
def marker():
    """A unique word in the test workers' command lines; whatever still carries it at the end (only
    when a test failed half-way) is killed by PID, so no test leaves processes behind."""
    word = f"orch-test-{uuid.uuid4().hex}"
    yield word
    for line in _left_running(word).splitlines():
        try:
            os.kill(int(line.split()[0]), signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.daemons
@pytest.mark.slow
def test_failing_host_stops_the_other_with_a_clear_error(sshd, tmp_path, marker):
    import threading

    cmds = _sleepers(sshd, tmp_path, marker)
    out = io.StringIO()
    outcome = {}

    def launch():
        try:
            run_on_hosts(cmds, _options(sshd), out)
        except HostFailure as e:
            outcome["error"] = e

    thread = threading.Thread(target=launch, daemon=True)
    thread.start()
    pids = _wait_for_pids(tmp_path, sshd.aliases)
    os.kill(pids["orch-b"], signal.SIGKILL)  # orch-b's worker dies: torchrun there fails
    thread.join(timeout=60)
    assert not thread.is_alive()
    error = outcome["error"]
    assert str(error).startswith("host orch-b (hostfile position 1) exited with code 1"), out.getvalue()
    assert "stopped the workers on orch-a" in str(error)
    assert [(r.host, r.stopped) for r in error.results] == [("orch-a", True), ("orch-b", False)]
    assert "[orch-a:0] stopped process group" in out.getvalue()
    time.sleep(0.5)
    assert _left_running(marker) == ""


@pytest.mark.daemons
@pytest.mark.slow
def test_ctrl_c_stops_every_host(sshd, tmp_path, marker):
    cmds = _sleepers(sshd, tmp_path, marker)
    script = tmp_path / "launch.py"
    script.write_text(f"""\
import sys
sys.path.insert(0, {str(Path(__file__).resolve().parents[3])!r})
from orchestrate.transports.ssh.remote import SshOptions, run_on_hosts
from orchestrate.transports.ssh.hosts import NodeCommand
cmds = [NodeCommand(h, r, tuple(a)) for h, r, a in {[(c.host, c.rank, list(c.argv)) for c in cmds]!r}]
run_on_hosts(cmds, SshOptions(ssh_config={str(sshd.ssh_config)!r}, stop_grace_s=5))
""")
    proc = subprocess.Popen([PYTHON, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for_pids(tmp_path, sshd.aliases)
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode != 0 and "KeyboardInterrupt" in output, output
    assert "interrupted: stopping every host" in output
    assert output.count("stopped process group") == 2, output
    time.sleep(0.5)
    assert _left_running(marker) == ""


@pytest.mark.daemons
def test_unusable_host_stops_the_others(sshd, tmp_path, monkeypatch, marker):
    monkeypatch.setenv("HOME", str(tmp_path))
    config = tmp_path / "ssh_config"  # orch-a as usual; "stranger" is the same sshd, its key not trusted
    config.write_text(sshd.ssh_config.read_text() + f"Host stranger\n  HostName {sshd.host}\n  Port {sshd.port}\n"
                      f"  User {sshd.user}\n  IdentityFile {sshd.key}\n")
    sleeper = (PYTHON, "-c", "import time; print('up', flush=True); time.sleep(300)", marker)
    cmds = [ssh_commands.NodeCommand("orch-a", 0, sleeper), ssh_commands.NodeCommand("stranger", 1, sleeper)]
    out = io.StringIO()
    with pytest.raises(HostFailure) as e:
        run_on_hosts(cmds, SshOptions(ssh_config=config, stop_grace_s=5), out)
    assert str(e.value).startswith("host stranger (hostfile position 1): stranger is not in known_hosts"), out.getvalue()
    assert e.value.results[0].stopped
    time.sleep(0.5)
    assert _left_running(marker) == ""


@pytest.mark.daemons
def test_unknown_host_key_is_refused(sshd, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # an empty ~/.ssh/known_hosts
    config = tmp_path / "ssh_config"  # the same host, without the known_hosts that trusts it
    config.write_text(f"Host target\n  HostName {sshd.host}\n  Port {sshd.port}\n  User {sshd.user}\n"
                      f"  IdentityFile {sshd.key}\n")
    with pytest.raises(UserError) as e:
        ssh.remote_free_port("target", PYTHON, SshOptions(ssh_config=config))
    assert "target is not in known_hosts: refusing an unknown host key" in str(e.value)
    assert not (tmp_path / ".ssh" / "known_hosts").exists()


@pytest.mark.daemons
def test_changed_host_key_is_refused(sshd, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    forged = tmp_path / "known_hosts"
    key_type, key = other.with_suffix(".pub").read_text().split()[:2]
    forged.write_text(f"[{sshd.host}]:{sshd.port} {key_type} {key}\n")
    config = tmp_path / "ssh_config"
    config.write_text(f"Host target\n  HostName {sshd.host}\n  Port {sshd.port}\n  User {sshd.user}\n"
                      f"  IdentityFile {sshd.key}\n  UserKnownHostsFile {forged}\n")
    with pytest.raises(UserError, match="does not match known_hosts"):
        ssh.remote_free_port("target", PYTHON, SshOptions(ssh_config=config))


@pytest.mark.daemons
def test_trust_on_first_use_records_the_key(sshd, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    config = tmp_path / "ssh_config"
    config.write_text(f"Host target\n  HostName {sshd.host}\n  Port {sshd.port}\n  User {sshd.user}\n"
                      f"  IdentityFile {sshd.key}\n")
    port = ssh.remote_free_port("target", PYTHON, SshOptions(ssh_config=config, trust_on_first_use=True))
    assert 0 < port < 65536
    recorded = (tmp_path / ".ssh" / "known_hosts").read_text()
    assert recorded.split()[:3] == sshd.known_hosts.read_text().split()[:3]
    # Recorded: the next connection is checked against it without trusting anything new.
    assert ssh.remote_free_port("target", PYTHON, SshOptions(ssh_config=config)) > 0
