"""A GPU session's measurements (bench/gpu_session.sh, kept under bench/results/<gpu>-<date>/) against
the plans the current memory model makes for the same runs; no GPU needed.

For each GPU-check run: the plan then (gpu_check.json) and now (each stored config re-planned on the
stored hardware profile, a QLoRA base's config.json rebuilt in a temporary directory), beside the run's
torch peaks (max_memory_allocated / reserved over the whole run, set-up and final save included) and
the least memory the run's allocation history needs (cuda_trace.needed_bytes: the like-with-like figure
for the plan's allocator part, which predicts the need, not the cache a roomy card keeps), the training
steps' reserved peak alone (replayed from the run's allocation history: between the
step markers, or, in a history without them, from the cache release before step 1 to the last 5 % of
events), and the device memory it held outside the caching allocator (bench/cuda_trace.py), which the
plan's `cuda_context` term stands for. Then what each run would add to the machine's calibration file
(orchestrate/launch/calibration_record.py), measured / planned device memory per rank: from the reserved peak
(how it was recorded until 2026-12-05), from the allocated peak (how it is now: the plan with the
measured tensors in place of the predicted ones) and from the need of the run's allocation history
(what a perfect calibration would record, outside the allocator as planned). Then every allocation
history replayed through the allocator model (bench/allocator_trace_check.py) and the CUDA-side
readings of bench/cuda_constants.py.

Usage: python bench/gpu_results.py bench/results/h200-2026-12-04 [--short]
`--short`: the session's first GPU-check run only, and only its history replayed (CI; the replays are
what takes time: about a minute for the whole session on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import allocator_trace_check, cuda_trace, gpu_check, qlora_zoo  # noqa: E402

GiB, MiB = 2**30, 2**20


def replanned(results: Path, name: str, hw, work: Path):
    config = json.loads((results / "zoo" / f"{name}.config.json").read_text())
    if "name_or_path" in config["model"]:  # a QLoRA entry: its base's config.json, no weights
        config["model"]["name_or_path"] = str(qlora_zoo.prepare(qlora_zoo.ENTRIES[name]["base"], work))
    config["train"]["output_dir"] = str(work)
    plan, error = gpu_check.plan_entry(config, hw)
    if plan is None:
        raise SystemExit(f"{name}: no plan today ({error})")
    return plan


def calibration_ratios(plan, measured: dict, needed: int) -> tuple[float, float, float]:
    """measured / planned per rank from the reserved peak (until 2026-12-05), the allocated peak (now)
    and the run's need (the allocation history's), each with what lies outside the allocator as planned."""
    from orchestrate.launch.calibration_record import analytical_bytes, measured_need

    planned = analytical_bytes(plan)
    outside = plan.chosen.memory.gpu_outside_allocator
    return ((measured["gpu_max_reserved_bytes"] + outside) / planned,
            measured_need(measured["gpu_max_allocated_bytes"], plan) / planned, (needed + outside) / planned)


def main(argv: list[str] | None = None) -> int:
    from orchestrate.hardware.profile import HardwareProfile

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--short", action="store_true", help="the first GPU-check run only, and its history")
    args = parser.parse_args(argv)
    run = json.loads((args.results / "gpu_check.json").read_text())
    runs = list(run["plans"].items())[:1] if args.short else list(run["plans"].items())
    hw = HardwareProfile.model_validate(run["hardware"])
    print(f"{run['device']}, torch {run['torch']}, capped at {hw.gpu.memory_bytes / GiB:.0f} GiB, {run['steps']} steps")
    print(f"{'run':30s} {'strategy':58s} {'planned GiB: then':>17s} {'now':>5s} {'(allocator)':>11s} "
          f"{'max alloc':>9s} {'max reserved':>12s} {'reserved/planned':>16s} {'steps: reserved':>15s} "
          f"{'/planned':>8s} {'needed':>6s} {'/planned':>8s} {'outside MiB':>11s} {'planned':>7s}")
    calibrations = []
    with tempfile.TemporaryDirectory(prefix="orchestrate-gpu-results-") as tmp:
        for name, row in runs:
            if row.get("status") != "ok":
                print(f"{name:30s} {row.get('status')}")
                continue
            plan = replanned(args.results, name, hw, Path(tmp))
            then, now, measured = row["prediction"], gpu_check.prediction(plan), row["measured"]
            record = cuda_trace.read(args.results / "traces" / f"zoo-{name}.json.gz")
            summary = record["summary"]
            phases = cuda_trace.replay_trace(record)["phase_peaks"]
            steps = phases["steps"] if phases else cuda_trace.unmarked_steps_peaks(record)
            steps_reserved = f"{steps['reserved'] / GiB:15.2f} {steps['reserved'] / now['gpu_allocator_bytes']:8.2f}" \
                if steps else f"{'-':>15s} {'-':>8s}"
            same = "" if now["strategy"] == then["strategy"] else f"  (now {now['strategy']})"
            reserved, needed = measured["gpu_max_reserved_bytes"], cuda_trace.needed_bytes(record)
            print(f"{name:30s} {then['strategy']:58s} {then['gpu_bytes'] / GiB:17.2f} {now['gpu_bytes'] / GiB:5.2f} "
                  f"{now['gpu_allocator_bytes'] / GiB:11.2f} {measured['gpu_max_allocated_bytes'] / GiB:9.2f} "
                  f"{reserved / GiB:12.2f} {reserved / now['gpu_allocator_bytes']:16.2f} {steps_reserved} "
                  f"{needed / GiB:6.2f} {needed / now['gpu_allocator_bytes']:8.2f} "
                  f"{summary['outside_allocator'] / MiB:11,.0f} {now['gpu_breakdown']['cuda_context'] / MiB:7,.0f}{same}")
            calibrations.append((name, reserved / needed, calibration_ratios(plan, measured, needed)))
    print("\ncalibration file entries, measured / planned per rank (ratios above 1 raise later plans), and the "
          "reserved peak over the need (the cache a card with room keeps):")
    print(f"  {'run':30s} {'reserved peak':>13s} {'allocated peak (now)':>20s} {'need':>6s} {'reserved/need':>13s}")
    for name, cache, (reserved, allocated, need) in calibrations:
        print(f"  {name:30s} {reserved:13.2f} {allocated:20.2f} {need:6.2f} {cache:13.3f}")
    print("\nthe allocator model replaying each recorded history (reserved peaks, model / real):")
    histories = allocator_trace_check.trace_files([args.results / "traces"])
    if args.short:
        histories = [path for path in histories if path.name == f"zoo-{runs[0][0]}.json.gz"]
    for path in histories:
        r = allocator_trace_check.check(path)
        print(f"  {r['trace']:45s} {(r['settings'] or 'default'):26s} {r['events']:>8,d} events  "
              f"allocated {r['model_allocated'] / r['real_allocated']:.3f}  reserved {r['model_reserved'] / r['real_reserved']:.3f}")
    constants = json.loads((args.results / "cuda_constants.json").read_text())
    print("\ndevice memory outside the caching allocator, MiB, after each stage (bench/cuda_constants.py):")
    for name, row in constants.items():
        stages = "  ".join(f"{k} {v['outside_allocator'] / MiB:,.0f}" for k, v in row.get("readings", {}).items())
        print(f"  {name:24s} {stages or row.get('error', '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
