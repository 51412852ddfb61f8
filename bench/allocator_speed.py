"""How fast the CUDA caching-allocator model replays a training step (orchestrate/simulate/replay.py).

    .venv/bin/python bench/allocator_speed.py            # 10^5 events, both expandable_segments settings
    .venv/bin/python bench/allocator_speed.py --short    # one training step's events (CI)

The trace is synthetic and deterministic: a 32-block step whose forward keeps a few activations
per block of a few sizes (some under 1 MiB, some in 1-10 MiB, some larger), frees them in reverse in
backward with short-lived temporaries in between, and per-block gradients that live until the
optimizer step, on two streams (parameters gathered on a second one, as FSDP2 does). It prints the
time of one replay on an unlimited device and of the `needed` bisection, per setting.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrate.simulate.replay import SETTINGS, Trace, replay, smallest_capacity  # noqa: E402

MiB = 2**20


def synthetic_trace(events: int = 100_000, blocks: int = 32, seed: int = 0) -> Trace:
    rng = random.Random(seed)
    sizes: list[int] = []
    streams: list[int] = []
    order: list[int] = []

    def alloc(nbytes: int, stream: int = 0) -> int:
        sizes.append(nbytes)
        streams.append(stream)
        order.append(len(sizes))
        return len(sizes) - 1

    def free(i: int) -> None:
        order.append(-(i + 1))

    widths = [rng.choice((96 * 1024, 3 * MiB, 24 * MiB, 56 * MiB)) for _ in range(6)]
    while len(order) < events:
        saved, grads = [], []
        for _ in range(blocks):  # forward
            gathered = alloc(88 * MiB, stream=1)
            saved += [alloc(w + rng.randrange(0, 4096, 512)) for w in widths]
            free(alloc(rng.choice(widths)))  # a temporary
            free(gathered)
        for block in range(blocks):  # backward, last block first
            gathered = alloc(88 * MiB, stream=1)
            for _ in range(3):
                free(alloc(rng.choice(widths) * 2))
            for i in saved[-len(widths):]:
                free(i)
            del saved[-len(widths):]
            grads.append(alloc(44 * MiB + block * 512))
            free(gathered)
        for g in grads:  # the optimizer step
            free(alloc(44 * MiB))
            free(g)
    return Trace(sizes=sizes, streams=streams, events=order, initial=0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=100_000, help="at least this many (whole steps)")
    parser.add_argument("--short", action="store_true", help="one training step's events (overrides --events)")
    args = parser.parse_args(argv)
    trace = synthetic_trace(1 if args.short else args.events)
    print(f"{len(trace.events)} events, {len(trace.sizes)} allocations")
    for name, settings in SETTINGS.items():
        start = time.perf_counter()
        peaks = replay(trace, settings)
        one = time.perf_counter() - start
        start = time.perf_counter()
        needed = smallest_capacity(trace, settings)
        search = time.perf_counter() - start
        print(f"{name:<10} one replay {one:.2f} s ({one / len(trace.events) * 1e6:.1f} us/event), needed bisection "
              f"{search:.1f} s; allocated {peaks.allocated / MiB:.0f} MiB, reserved {peaks.reserved / MiB:.0f}, "
              f"needed {needed / MiB:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
