"""orchestrate: plan, configure and launch training of models that do not fit on one consumer GPU.

Data flows one way: CLI -> typed config -> hardware profile -> plan -> rendered backend config
-> launcher -> workers. The plan file written by the launcher is the only channel to workers.
"""

__version__ = "0.1.0"
