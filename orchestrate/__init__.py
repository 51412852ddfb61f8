"""orchestrate: plan, configure and launch training of models that do not fit on one consumer GPU.

Data flows one way: CLI -> typed config -> hardware profile -> plan -> rendered backend config
-> launcher -> workers. The plan file written by the launcher is the only channel to workers.

Your own training loop: `orchestrate.prepare`, `backward`, `save`, `load` (orchestrate.loop_api,
docs/own-loop.md), imported on first use so that `import orchestrate` stays cheap.
"""

from orchestrate.library_messages import silence_library_messages

__version__ = "0.1.0"

silence_library_messages()

_LOOP_API = ("prepare", "backward", "save", "load")


def __getattr__(name: str):
    if name in _LOOP_API:
        from orchestrate import loop_api

        return getattr(loop_api, name)
    raise AttributeError(f"module 'orchestrate' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LOOP_API])
