"""The exit codes of `orchestrate` and of its workers, defined once."""

EXIT_USER_ERROR = 2
"""Bad input: one message listing every problem, no traceback."""

EX_TEMPFAIL = 75
"""sysexits.h EX_TEMPFAIL: the workers checkpointed on a stop signal; requeue / resume the run."""

EX_PEER_LOST = 69
"""sysexits.h EX_UNAVAILABLE: a worker's collective failed because another rank was gone (it died or
stopped first); not this rank's fault, so the launcher blames another (orchestrate.agent.torchrun)."""
