"""Your own training loop under the plan (`orchestrate launch CONFIG -- python train.py ARGS`), in the
manner of accelerate and Lightning Fabric:

    model, optimizer, loader = orchestrate.prepare(model, optimizer, loader)
    ...
    orchestrate.backward(loss)          # instead of loss.backward()
    orchestrate.save()  /  state = orchestrate.load()

`run.py` is what torchrun starts on every rank: it is handed the plan's path, records it
(`launch_state`), and runs the user's script as `__main__` with the script's own argv.
`session.py` is the API; `wrap.py` applies the plan's backend, `loader.py` shards the data,
`torch_state.py` checkpoints the FSDP2/DDP state. docs/own-loop.md.
"""

from orchestrate.loop_api.session import backward, load, prepare, save

__all__ = ["backward", "load", "prepare", "save"]
