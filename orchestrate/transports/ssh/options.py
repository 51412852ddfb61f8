"""How `launch --hosts` reaches the hosts (each host's own settings belong in the ssh config)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SshOptions:
    user: str | None = None
    port: int | None = None
    key_filename: str | None = None
    ssh_config: Path | None = None
    """An ssh_config file to use instead of ~/.ssh/config and /etc/ssh/ssh_config."""
    known_hosts: Path | None = None
    """Trusted host keys in addition to ~/.ssh/known_hosts and the ssh config's UserKnownHostsFile."""
    trust_on_first_use: bool = False
    connect_timeout: float = 15
    stop_grace_s: float | None = None
    """SIGTERM to SIGKILL when stopping a host's command; None: DEFAULT_STOP_GRACE_S."""
