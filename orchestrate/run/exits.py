"""How a run ends, defined once: the exit codes of `orchestrate` and of its workers, and the signals
that stop a run (torchrun handles them: launch.session.launch_env gives it this list as
PET_SIGNALS_TO_HANDLE; the launcher forwards them to torchrun's agent process; the workers
checkpoint on SIGTERM/SIGHUP/SIGQUIT/SIGUSR1, orchestrate.worker.signals)."""

import signal

EXIT_USER_ERROR = 2
"""Bad input: one message listing every problem, no traceback."""

EX_TEMPFAIL = 75
"""sysexits.h EX_TEMPFAIL: the workers checkpointed on a stop signal; requeue / resume the run."""

EX_PEER_LOST = 69
"""sysexits.h EX_UNAVAILABLE: a worker's collective failed because another rank was gone (it died or
stopped first); not this rank's fault, so the launcher blames another (orchestrate.agent.torchrun)."""

EX_OUT_OF_MEMORY = 71
"""sysexits.h EX_OSERR (a system resource ran out): a worker's device ran out of memory; it wrote
RUN_DIR/oom/rank-<N>.json (the peak it reached, the step, the phase, the prediction). The launcher
re-plans with the shortfall added and resumes (launch/oom_replan.py); `orchestrate launch` itself exits
with it when it could not recover."""


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)
