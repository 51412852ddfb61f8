"""torchrun's agent as a process of its own, between the launcher and the workers: started by the
launcher before planning (orchestrate.transports.local.agent), it imports what the workers need, then runs
torchrun with the workers forked from it (orchestrate.agent.process). Neither launch/ nor worker/:
it imports the worker's entry function, and the launcher reaches it only as a program
(`python -m orchestrate.agent`) over pipes, as torchrun reaches `-m orchestrate.worker`."""
