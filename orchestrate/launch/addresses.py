"""What may name a machine, a login and a port where the launcher reads one (the hostfile,
`--ssh-user`, `--ssh-port`, `--master-addr`, `--master-port`, `--rdzv-endpoint`): one rule per kind,
checked when the value comes in, so nothing that reaches a command line can be read as an option or
split in two.

- A host is a name (dot-separated labels of letters, digits, `-` and `_`, none starting or ending
  with `-`: RFC 1123 plus the `_` of ssh config aliases), an IPv4 address, or an IPv6 address, plain
  or in brackets (`[::1]`). Never a leading `-` (ssh would read `-oProxyCommand=...` as an option),
  never a shell character.
- A user is a POSIX-style login name: letters, digits, `.`, `_`, `-`, not starting with `-`.
- A port is a whole number from 1 to 65535.

Each `*_problem` function says why a value breaks its rule, or returns None; callers turn the
answer into a `Problem` at the place the value came from (a hostfile line, a flag).
"""

from __future__ import annotations

import ipaddress
import re

_LABEL = re.compile(r"^[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?$")
_USER = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,31}$")
_SCOPE = re.compile(r"^[A-Za-z0-9_.-]+$")
_HOST_RULE = "a host name (letters, digits, - and _ between dots), an IPv4 address or an IPv6 address"


def _ipv6(text: str) -> ipaddress.IPv6Address | None:
    """`text` as an IPv6 address (brackets optional, a zone such as %eth0 of plain characters), else None."""
    plain = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    try:
        address = ipaddress.IPv6Address(plain)
    except ValueError:
        return None
    return address if address.scope_id is None or _SCOPE.match(address.scope_id) else None


def host_problem(host: str) -> str | None:
    """Why `host` cannot name a machine to connect to (see the module docstring), or None."""
    if _ipv6(host):
        return None
    labels = host.split(".")
    if len(host) > 253 or not all(_LABEL.match(label) for label in labels):
        return f"{host!r} is not {_HOST_RULE}"
    if all(label.isdigit() for label in labels):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            return f"{host!r} is not an IPv4 address"
    return None


def plain_host(host: str) -> str:
    """A valid host as ssh, fabric and the hostfile's duplicate check take it: IPv6 without brackets."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def endpoint(host: str, port: int | str) -> str:
    """`HOST:PORT` as torchrun parses it: an IPv6 host in brackets."""
    return f"[{plain_host(host)}]:{port}" if _ipv6(host) else f"{host}:{port}"


def user_problem(user: str) -> str | None:
    """Why `user` cannot be a login name on the hosts, or None."""
    if _USER.match(user):
        return None
    return f"{user!r} is not a user name (letters, digits, . _ -, not starting with -; 32 at most)"


def port_problem(port: object) -> str | None:
    """Why `port` is not a TCP port to listen on or connect to, or None (any value: the text of a port
    that is no number is named as given)."""
    if isinstance(port, int) and not isinstance(port, bool) and 1 <= port <= 65535:
        return None
    return f"{port!r} is not a TCP port (1 to 65535)"


def endpoint_problem(text: str) -> str | None:
    """Why `text` is not a rendezvous endpoint, `HOST` or `HOST:PORT` (IPv6 in brackets when a port
    follows), or None."""
    if _ipv6(text):
        return None
    host, colon, port = text.rpartition(":") if text.count(":") == 1 or "]:" in text else (text, "", "")
    problem = host_problem(host)
    if problem is None and colon:
        problem = port_problem(int(port) if port.isascii() and port.isdigit() else port)
    return problem
