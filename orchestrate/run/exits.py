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
"""sysexits.h EX_OSERR (a system resource ran out): a worker's device or host ran out of memory; it
wrote RUN_DIR/oom/rank-<N>.json (which memory, the step, the phase; for the device the peak it
reached and the prediction). The launcher re-plans a device shortfall and resumes
(launch/oom_replan.py); a host one it words with HOST_MEMORY_HELP; `orchestrate launch` itself exits
with it when it could not recover."""

HOST_MEMORY_HELP = ("a smaller train.micro_batch_size, less offload to host memory (strategy.offload: none, "
                    "strategy.offload_params: false), fewer ranks on the node, a lower "
                    "strategy.cpu_memory_headroom (the plan then leaves more RAM free), or more RAM; "
                    "train.oom_retries re-plans device out-of-memory errors only, not this")
"""What would help when a worker ran out of host memory (RAM), told by the launcher and the agent."""

HOST_OOM_KILLED = ("if `dmesg` shows 'Out of memory: Killed process', host memory ran out; what would help: "
                   + HOST_MEMORY_HELP)
"""The hint on a worker killed by SIGKILL: the kernel's out-of-memory killer leaves no other trace."""


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)
