"""DeepSpeed-style hostfiles: one `HOST slots=N` per line, `#` comments and blank lines allowed.

    # two machines with 4 GPUs each
    node-a slots=4
    node-b slots=4   # an SSH config alias works as well as a name or address

The first host hosts the rendezvous. Every problem is reported at once, with its line number.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from orchestrate.errors import Problem, UserError

_SLOTS = re.compile(r"^slots=(?P<n>\S*)$")


@dataclass(frozen=True)
class Host:
    name: str
    """A host name, address or SSH config alias (user@ and :port are not part of it)."""
    slots: int
    """Processes (GPUs) to start on this host."""
    line: int


def parse_hostfile(text: str, source: str = "hostfile") -> list[Host]:
    hosts: list[Host] = []
    problems: list[Problem] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}:{number}"
        name, *rest = line.split()
        if "@" in name or name.count(":") == 1:
            problems.append(Problem(where, f"{name!r}: user and port do not belong in the hostfile",
                                    "put them in ~/.ssh/config (Host alias / User / Port) or use --ssh-user/--ssh-port"))
            continue
        slots = _SLOTS.match(rest[0]) if len(rest) == 1 else None
        if not slots:
            problems.append(Problem(where, f"expected `HOST slots=N`, got {line!r}", "e.g. `node-a slots=4`"))
            continue
        value = slots["n"]
        if not value.isdigit() or int(value) < 1:
            problems.append(Problem(where, f"slots={value} is not a positive whole number", "e.g. slots=4"))
            continue
        if name in seen:
            problems.append(Problem(where, f"{name} is listed twice (first on line {seen[name]})",
                                    "one line per host; slots= counts its processes"))
            continue
        seen[name] = number
        hosts.append(Host(name=name, slots=int(value), line=number))
    if not hosts and not problems:
        problems.append(Problem(source, "no hosts in the file", "one `HOST slots=N` line per machine"))
    if problems:
        raise UserError(f"cannot read the hostfile {source}", problems)
    return hosts


def load_hostfile(path: Path) -> list[Host]:
    try:
        text = path.read_text()
    except OSError as e:
        raise UserError("cannot read the hostfile", [Problem("--hosts", f"{path}: {e.strerror}")]) from None
    return parse_hostfile(text, str(path))
