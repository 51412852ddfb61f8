"""Fuzz orchestrate's input surfaces longer than the property tests do, and table what held and what broke.

    .venv/bin/python bench/fuzz.py                      # 300 inputs per surface
    .venv/bin/python bench/fuzz.py --examples 3000 --seed 1
    .venv/bin/python bench/fuzz.py --only hostfile --only slurm
    .venv/bin/python bench/fuzz.py --short              # 8 inputs per surface (CI)

The surfaces and their invariants are tests/helpers/input_fuzz.py's, the ones the property tests
run for a few seeded examples each: the YAML parser, `--set`, whole `orchestrate plan` calls of the
demo config mutated, one record of every data format (GRPO's prompt files too), chat templates,
hostfiles and the ssh line, the rendezvous flags, the SLURM fields. For each surface hypothesis
draws `--examples` inputs (seeded by `--seed`, no shrinking while counting); every input either
holds the surface's invariants or breaks one. Breaks are grouped by the rule broken (or the
exception that escaped and where it was raised), and each group is shrunk to a minimal example by
hypothesis' `find`. The process's peak memory is checked last (below MAX_RSS_GIB).

Prints one row per surface (inputs tried, invariants held, broke, seconds), then each break with
its minimal example; exits 1 when anything broke. The short mode runs in
tests/unit/bench/test_bench_short_modes.py; what a deep run found is in docs/security.md.
"""

from __future__ import annotations

import argparse
import random
import resource
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, find, given, seed, settings
from hypothesis.errors import NoSuchExample

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.helpers.input_fuzz import InvariantBroken, Surface, all_surfaces  # noqa: E402

EXAMPLES = 300
SHORT_EXAMPLES = 8
SHRINK_EXAMPLES = 2000
"""Inputs `find` may draw to meet a break again before shrinking it (then the first one seen is shown)."""
MAX_RSS_GIB = 4
ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Row:
    surface: str
    tried: int = 0
    held: int = 0
    seconds: float = 0.0
    breaks: dict[str, list[Any]] = field(default_factory=dict)
    """signature -> [count, first input seen, minimal input (None: not found again)]."""

    @property
    def broke(self) -> int:
        return sum(count for count, *_ in self.breaks.values())


def _where(exc: BaseException) -> str:
    """The innermost frame of orchestrate's (else the innermost at all) that the exception passed."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if "/orchestrate/" in f.filename] or frames
    if not ours:
        return "?"
    frame = ours[-1]
    return f"{Path(frame.filename).relative_to(ROOT) if frame.filename.startswith(str(ROOT)) else frame.filename}" \
           f":{frame.lineno}"


def signature(exc: BaseException) -> str:
    """What a break is grouped by: the invariant broken (with where the exception behind it came
    from, if one did), or the escaped exception's type and where it was raised."""
    if isinstance(exc, InvariantBroken):
        cause = exc.__cause__
        return exc.invariant + (f" ({type(cause).__name__} at {_where(cause)})" if cause is not None else "")
    return f"{type(exc).__name__} escaped at {_where(exc)}"


def _outcome(surface: Surface, value: Any) -> str | None:
    try:
        surface.check(value)
    except Exception as exc:  # noqa: BLE001 - every escape is a finding, counted by its signature
        return signature(exc)
    return None


def explore(surface: Surface, examples: int, seed_value: int) -> Row:
    """`examples` inputs from the surface's strategy, each checked; breaks counted by signature."""
    row = Row(surface.name)

    @seed(seed_value)
    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(surface.strategy)
    def run(value):
        row.tried += 1
        broke = _outcome(surface, value)
        if broke is None:
            row.held += 1
        else:
            row.breaks.setdefault(broke, [0, value, None])[0] += 1

    start = time.perf_counter()
    run()
    row.seconds = time.perf_counter() - start
    return row


def shrink(surface: Surface, row: Row, seed_value: int) -> None:
    """Each break's minimal input: hypothesis draws until it meets the same break, then shrinks it."""
    for broke, entry in row.breaks.items():
        try:
            entry[2] = find(surface.strategy, lambda v, broke=broke: _outcome(surface, v) == broke,
                            settings=settings(max_examples=SHRINK_EXAMPLES, deadline=None, database=None,
                                              suppress_health_check=list(HealthCheck)),
                            random=random.Random(seed_value))
        except NoSuchExample:
            entry[2] = None


def _short(value: Any, width: int = 240) -> str:
    text = repr(value)
    return text if len(text) <= width else text[:width] + f"... ({len(text):,} characters)"


def report(rows: list[Row], peak_gib: float) -> None:
    name_width = max(len(r.surface) for r in rows)
    print(f"{'surface':<{name_width}}  {'tried':>7}  {'held':>7}  {'broke':>6}  {'seconds':>8}")
    for r in rows:
        print(f"{r.surface:<{name_width}}  {r.tried:>7,}  {r.held:>7,}  {r.broke:>6,}  {r.seconds:>8.1f}")
    total = [sum(getattr(r, k) for r in rows) for k in ("tried", "held", "broke")]
    print(f"{'all':<{name_width}}  {total[0]:>7,}  {total[1]:>7,}  {total[2]:>6,}")
    print(f"peak RSS {peak_gib:.2f} GiB (bound {MAX_RSS_GIB} GiB)")
    for r in rows:
        for broke, (count, first, minimal) in r.breaks.items():
            print(f"\nBROKE {r.surface}: {broke} ({count}x)")
            print(f"  minimal: {_short(minimal)}" if minimal is not None else
                  f"  not met again while shrinking; first seen: {_short(first)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", type=int, default=EXAMPLES, help="inputs per surface")
    parser.add_argument("--short", action="store_true", help=f"{SHORT_EXAMPLES} inputs per surface (CI)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", action="append", default=[],
                        help="run the surfaces whose name contains this (repeatable)")
    args = parser.parse_args(argv)
    examples = SHORT_EXAMPLES if args.short else args.examples
    with tempfile.TemporaryDirectory(prefix="orchestrate-fuzz-") as work:
        chosen = [build for name, build in all_surfaces(Path(work))
                  if not args.only or any(o.lower() in name.lower() for o in args.only)]
        rows = []
        for build in chosen:
            surface = build()
            row = explore(surface, examples, args.seed)
            shrink(surface, row, args.seed)
            rows.append(row)
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    report(rows, peak_gib)
    return 1 if any(r.breaks for r in rows) or peak_gib >= MAX_RSS_GIB else 0


if __name__ == "__main__":
    sys.exit(main())
