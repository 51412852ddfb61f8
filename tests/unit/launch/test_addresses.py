"""The rules for hosts, users, ports and rendezvous endpoints (`orchestrate.launch.addresses`), and
the rendezvous flags checked by them where they come in (`LaunchOptions`)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrate.errors import UserError
from orchestrate.launch.addresses import (
    endpoint,
    endpoint_problem,
    host_problem,
    plain_host,
    port_problem,
    user_problem,
)
from orchestrate.launch.torchrun_args import LaunchOptions
from tests.helpers.input_fuzz import check_rendezvous_flags, rendezvous_flags

GOOD_HOSTS = ["node-a", "node_b", "gpu01.cluster.example.org", "10.0.0.7", "localhost", "::1", "[::1]",
              "fe80::1%eth0", "2001:db8::42", "A" * 63]
BAD_HOSTS = ["", "-oProxyCommand=touch${IFS}/x", "node-a;touch${IFS}/x", "node a", "-node", "node-", "a..b",
             ".a", "a.", "$(id)", "`id`", "a|b", "a\nb", "10.0.0.256", "1.2.3", "[node-a]", "fe80::1%eth0;x",
             "A" * 64, "nöde", "a/b", "x'y", 'x"y']


@pytest.mark.parametrize("host", GOOD_HOSTS)
def test_hosts_that_name_a_machine_are_accepted(host):
    assert host_problem(host) is None


@pytest.mark.parametrize("host", BAD_HOSTS)
def test_hosts_that_could_be_an_option_or_shell_text_are_refused(host):
    assert repr(host) in host_problem(host)


def test_ipv6_is_kept_plain_and_bracketed_in_an_endpoint():
    assert plain_host("[::1]") == plain_host("::1") == "::1"
    assert endpoint("::1", 29400) == endpoint("[::1]", 29400) == "[::1]:29400"
    assert endpoint("node-a", "PORT") == "node-a:PORT"


@pytest.mark.parametrize("port,ok", [(1, True), (22, True), (65535, True), (0, False), (-1, False),
                                     (65536, False), (99999, False), (True, False)])
def test_ports_are_1_to_65535(port, ok):
    assert (port_problem(port) is None) is ok


@pytest.mark.parametrize("user,ok", [("alice", True), ("svc.train-01", True), ("_x", True), ("-oX", False),
                                     ("a b", False), ("a;b", False), ("", False), ("a" * 33, False)])
def test_user_names(user, ok):
    assert (user_problem(user) is None) is ok


@pytest.mark.parametrize("text,ok", [("node-a", True), ("node-a:29400", True), ("10.0.0.7:1", True),
                                     ("[::1]:29400", True), ("::1", True), ("node-a:99999", False),
                                     ("node-a:0", False), ("node-a:", False), ("-x:29400", False),
                                     ("node-a:29400:1", False), ("a b:1", False), ("[::1]:x", False)])
def test_rendezvous_endpoints(text, ok):
    assert (endpoint_problem(text) is None) is ok


def test_rendezvous_flags_are_checked_where_they_come_in():
    with pytest.raises(UserError) as e:
        LaunchOptions(master_port=99999, master_addr="-oX", rdzv_endpoint="node-a:70000")
    assert [p.where for p in e.value.problems] == ["--master-port", "--master-addr", "--rdzv-endpoint"]
    assert "99999 is not a TCP port (1 to 65535)" in str(e.value)
    assert LaunchOptions(master_port=29500, master_addr="10.0.0.1").master_port == 29500


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.text(st.one_of(st.sampled_from(list("az09-_.:[]%@;$`'\" \n\t/\\")), st.characters()), max_size=24))
def test_an_accepted_host_is_one_plain_word_that_no_program_reads_as_an_option(host):
    """Whatever the text, the rule answers (never raises); what it accepts cannot start an option or
    hold a character a shell, ssh or sbatch would split at or expand."""
    if host_problem(host) is None:
        plain = plain_host(host)
        assert not plain.startswith("-") and plain.isascii() and plain.isprintable()
        assert not set(plain) & set(" \t\n;$`'\"\\/|&<>(){}*?#!~")


@settings(max_examples=300, deadline=None, derandomize=True)
@given(rendezvous_flags)
def test_any_rendezvous_flags_are_one_user_error_or_plain_words(flags):
    """`--master-port / --master-addr / --rdzv-endpoint` as typed: one UserError naming each bad flag,
    or values that reach torchrun as one plain word each."""
    check_rendezvous_flags(flags)
