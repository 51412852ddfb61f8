"""The signals that stop a run: torchrun handles them (launch.session.launch_env gives it this list as
PET_SIGNALS_TO_HANDLE), the launcher forwards them to torchrun's agent process, the workers checkpoint
on SIGTERM/SIGUSR1 (orchestrate.worker.signals)."""

import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)
