"""What a hostfile and the SSH flags may hold, checked where they are read, and the ssh command line
that cannot take a host for an option (issue 38, item 1)."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings

from orchestrate.errors import UserError
from orchestrate.transports.ssh.hosts import Host, NodeCommand, SshOptions, parse_hostfile, ssh_command_line
from orchestrate.transports.ssh.remote import plan_commands
from tests.daemons import require_sshd
from tests.helpers.input_fuzz import SSH_PYTHON as PYTHON
from tests.helpers.input_fuzz import check_hostfile, hostfile_lines
from tests.helpers.input_fuzz import ssh_argv as _ssh_argv
from tests.helpers.input_fuzz import ssh_destination as _destination


def test_hosts_that_ssh_or_a_shell_would_misread_are_refused_with_every_line_number():
    text = ("-oProxyCommand=touch${IFS}/x slots=1\nnode-a slots=1\nnode-b;touch${IFS}/x slots=1\n"
            "# fine\n$(id) slots=2\n[::1]:22 slots=1\n")
    with pytest.raises(UserError) as e:
        parse_hostfile(text, "hosts.txt")
    assert [p.where for p in e.value.problems] == ["hosts.txt:1", "hosts.txt:3", "hosts.txt:5", "hosts.txt:6"]
    assert "'-oProxyCommand=touch${IFS}/x' is not a host name" in str(e.value)
    assert "user and port do not belong in the hostfile" in str(e.value)


def test_ipv6_hosts_are_accepted_plain_or_bracketed_and_kept_plain():
    assert parse_hostfile("[fd00::7] slots=2\nfd00::8 slots=2\n") == [Host("fd00::7", 2, 1), Host("fd00::8", 2, 2)]
    with pytest.raises(UserError, match="listed twice"):
        parse_hostfile("[::1] slots=1\n::1 slots=1\n")


def test_the_ssh_command_line_ends_its_options_before_the_host():
    argv = _ssh_argv("node-a")
    assert argv[:argv.index("--")] == ["ssh", "-F", "/c/ssh config", "-l", "alice", "-p", "2222", "-i", "/k/id",
                                      "-o", "UserKnownHostsFile=~/.ssh/known_hosts /c/known_hosts"]
    host, rest = _destination(argv)
    assert host == "node-a" and len(rest) == 1 and shlex.split(rest[0])[:4] == ["exec", "env", "K=v w", PYTHON]


def test_an_ipv6_rendezvous_host_is_bracketed_in_the_endpoint(tmp_path):
    config = tmp_path / "ssh_config"
    config.write_text("Host v6a\n  HostName fd00::7\nHost v6b\n  HostName fd00::8\n")
    commands = plan_commands([Host("v6a", 1, 1), Host("v6b", 1, 2)], ["x.py"], python=PYTHON,
                             options=SshOptions(ssh_config=config), probe_port=False)
    assert "--rdzv-endpoint=[fd00::7]:PORT" in commands[1].argv and "--local-addr=fd00::8" in commands[1].argv
    local = plan_commands([Host("::1", 1, 1)], ["x.py"], python=PYTHON, options=SshOptions(ssh_config=config),
                          rdzv_port=29400)
    assert "--rdzv-endpoint=[::1]:29400" in local[0].argv and _destination(_ssh_argv("::1"))[0] == "::1"


def test_ssh_flags_are_checked_where_they_come_in():
    with pytest.raises(UserError) as e:
        SshOptions(user="-oProxyCommand=x", port=99999, known_hosts=Path("/a b/known_hosts"))
    assert [p.where for p in e.value.problems] == ["--ssh-user", "--ssh-port", "--known-hosts"]
    with pytest.raises(UserError, match="--ssh-port"):
        SshOptions(port=0)
    with pytest.raises(UserError, match="--known-hosts"):
        SshOptions(known_hosts=Path("/k/%d"))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(hostfile_lines)
def test_a_hostfile_either_yields_hosts_ssh_reads_as_one_destination_or_one_user_error(lines):
    """Any hostfile: a UserError, or hosts each of which is exactly one argv element after `--` in
    the ssh command line (the host as written, IPv6 without brackets), never an option."""
    check_hostfile(lines)


@pytest.mark.daemons
def test_the_launch_sh_line_runs_on_a_real_sshd():
    """OpenSSH's own client takes the line as written: options, `--`, the host, one command."""
    sshd = require_sshd()
    command = NodeCommand(sshd.aliases[0], 0, (sys.executable, "-c", "import os; print(os.environ['K'])"),
                          (("K", "v w; $(false)"),))
    line = ssh_command_line(command, SshOptions(ssh_config=sshd.ssh_config))
    done = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, "v w; $(false)\n"), done.stderr
