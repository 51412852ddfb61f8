"""Analytical vs simulated per-rank peak memory over a zoo of families, strategies and shapes.

    .venv/bin/python bench/memory_accuracy.py                 # the whole zoo (simulations cached)
    .venv/bin/python bench/memory_accuracy.py --family llama --seq 512 --jobs 2
    .venv/bin/python bench/memory_accuracy.py --lora          # the LoRA zoo (lora_zoo; docs/memory-model.md)

The zoo: gpt2, llama, qwen2, mistral, phi3 (2-block models with each family's real widths, so a
simulation takes seconds) x {FSDP2 full shard, FSDP2 shard-grad-op, ZeRO-2, ZeRO-3, DDP} x
{activation checkpointing off, on} x micro-batch {1, 2, 4} x seq {512, 2048}, on two generic 8 GB GPUs
(launch_configs/profiles/generic-8gb.yaml). Each row plans the strategy, simulates rank 0 on fake
tensors (orchestrate.simulate, the real backends) and compares:
- analytical: the planner's per-rank estimate (orchestrate.planner.memory.estimate_memory);
- simulated: tensor bytes the simulation saw at the peak (512-byte CUDA blocks), plus what no
  simulation sees, taken from the analytical model's named constants (CUDA context, workspace,
  NCCL buffers, allocator reserve);
- the allocator replay: the simulation's allocations and frees through the CUDA caching-allocator
  model (orchestrate/simulate/replay.py), expandable_segments off and on: reserved / allocated on a
  device with room to spare (what torch.cuda.max_memory_reserved / max_memory_allocated would say)
  and needed / requested (the least device memory it runs in, over the bytes asked for), which
  the planner's allocator reserve (planner/allocator_reserve.py: a constant + fractions of the states
  and of the transient bytes)
  must cover, per backend.
Simulation results are cached in bench/results/memory_accuracy.json, keyed by the full run spec, so
a rerun after a change to the analytical model costs no simulation; a changed spec simulates again.
Prints the table, the worst |analytical / simulated - 1|, the replay per backend and setting and,
with --json, writes every row.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrate.methods.lora.adapters import adapters_for  # noqa: E402
from orchestrate.methods.lora.method import adapter_terms  # noqa: E402
from orchestrate.planner.allocator_reserve import RESERVE, reserve_bytes, state_bytes  # noqa: E402
from orchestrate.planner.memory import estimate_memory  # noqa: E402
from orchestrate.planner.strategy import Strategy  # noqa: E402
from orchestrate.simulate.in_subprocess import make_spec, simulate  # noqa: E402
from orchestrate.simulate.result import SimulationResult  # noqa: E402
from orchestrate.simulate.run_spec import plan_from_parts  # noqa: E402
from orchestrate.simulate.verify import _unseen, allocator_setting  # noqa: E402

CACHE = Path(__file__).resolve().parent / "results" / "memory_accuracy.json"
WORLD = 2
MiB = 2**20
LAYERS = 2

# Real widths (config.json of the Hub model named), two blocks. max_position_embeddings >= 2048.
FAMILIES: dict[str, dict] = {
    # openai-community/gpt2 (dropout 0.1 everywhere, as shipped)
    "gpt2": {"model_type": "gpt2", "n_layer": LAYERS, "n_positions": 2048},
    # TinyLlama/TinyLlama-1.1B: GQA 32/4, SwiGLU
    "llama": {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": LAYERS,
              "num_attention_heads": 32, "num_key_value_heads": 4, "vocab_size": 32000,
              "max_position_embeddings": 2048, "tie_word_embeddings": False},
    # Qwen/Qwen2.5-0.5B: q/k/v biases, GQA 14/2, tied 151936-entry vocabulary
    "qwen2": {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": LAYERS,
              "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
              "max_position_embeddings": 32768, "tie_word_embeddings": True},
    # mistralai/Mistral-7B-v0.3 widths at 1/4 (GQA 32/8 kept as 8/2), no sliding window (v0.3)
    "mistral": {"model_type": "mistral", "hidden_size": 1024, "intermediate_size": 3584, "num_hidden_layers": LAYERS,
                "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 32768,
                "max_position_embeddings": 32768, "sliding_window": None, "tie_word_embeddings": False},
    # microsoft/Phi-3-mini-4k-instruct widths at 1/3: fused qkv and gate_up projections
    "phi3": {"model_type": "phi3", "hidden_size": 1024, "intermediate_size": 2730, "num_hidden_layers": LAYERS,
             "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 32064,
             "max_position_embeddings": 4096, "tie_word_embeddings": False},
}
STRATEGIES = (("fsdp", 3), ("fsdp", 2), ("deepspeed", 2), ("deepspeed", 3), ("ddp", 0))
# --lora: r=16 on every block linear (train.lora defaults otherwise), under the (backend, stage) pairs
# LoRA trains on (methods/lora/adapters.py); the frozen base in bf16 as the transform casts it.
LORA = {"method": "lora", "lora": {"r": 16}}
LORA_STRATEGIES = (("ddp", 0), ("fsdp", 3), ("deepspeed", 2), ("deepspeed", 3))
LORA_FAMILIES = ("llama", "qwen2", "mistral", "gpt2")  # the four simulated (bench/results cache)


def strategy(backend: str, stage: int, mb: int, ac: bool) -> Strategy:
    return Strategy(backend=backend, zero_stage=stage, offload_optimizer="none", offload_params="none",
                    precision="bf16", activation_checkpointing=ac, micro_batch_size=mb)


@dataclass(frozen=True)
class Point:
    family: str
    strategy: Strategy
    seq_len: int
    adapters: dict | None = None
    """`train` keys of a LoRA run (LORA), None for full fine-tuning."""
    layers: int = LAYERS

    def plan(self):
        arch = FAMILIES[self.family]
        if self.layers != LAYERS:  # --layers: the same widths, deeper
            arch = {**arch, ("n_layer" if self.family == "gpt2" else "num_hidden_layers"): self.layers}
        return plan_from_parts(arch, self.strategy, self.seq_len, WORLD, adapters=self.adapters)


def zoo(families=None, seqs=(512, 2048), mbs=(1, 2, 4), acs=(False, True), strategies=STRATEGIES,
        adapters: dict | None = None, layers: int = LAYERS) -> list[Point]:
    # Families innermost, so that a partial run covers every family (and both lengths at micro-batch 1).
    return [Point(f, strategy(b, st, mb, ac), seq, adapters, layers) for mb in mbs for seq in seqs for ac in acs
            for (b, st) in strategies for f in (families or FAMILIES)]


def lora_zoo(families=None, seqs=(512, 1024), strategies=LORA_STRATEGIES) -> list[Point]:
    """The LoRA zoo: micro-batch 1 and 2 at each length."""
    return zoo(families or LORA_FAMILIES, seqs, (1, 2), strategies=strategies, adapters=LORA)


def spec_key(spec) -> str:
    data = spec.to_dict()
    # The run, not the environment: config.json's stamp of the installed transformers release would
    # make every release a cold 30-minute rerun (a model class whose saved tensors change is simulated
    # again by running without --cached-only after deleting the cache file).
    data["model_config"].pop("transformers_version", None)
    if data.get("rows") is None and not data.get("phases"):  # no method's rows or phases: the key from before
        data.pop("rows", None)
        data.pop("phases", None)
    if data.get("adapters") is None:  # full fine-tuning: the key it had before specs named adapters
        data.pop("adapters", None)
    elif data["adapters"]["lora"].get("dtype") == "fp32":  # train.lora.dtype at its default: the key from before
        data["adapters"]["lora"].pop("dtype")
    # The memory knobs at their defaults (no chunked loss, no activation offload, fp32 AdamW, the embedding
    # on the device, no tiles, no sequence split, no fused kernels): the key it had before strategies named them; the zoo plans none of them.
    for knob, default in (("loss_chunks", 0), ("activation_offload", False), ("optimizer", "adamw"),
                          ("embedding_offload", False), ("mlp_tiles", 0), ("sequence_parallel", 1),
                          ("fused_kernels", False)):
        if data["strategy"].get(knob) == default:
            data["strategy"].pop(knob)
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:20]


class Cache:
    """Simulation results by a hash of the run spec, in one JSON file (written after each result)."""

    def __init__(self, path: Path) -> None:
        self.path, self.lock = path, threading.Lock()
        self.data: dict = json.loads(path.read_text()) if path.is_file() else {}

    def get_or_run(self, point: Point, run: bool = True, plan=None) -> tuple[SimulationResult | None, bool]:
        """`plan`: the point's, when the caller has it (planning builds a meta model)."""
        with self.lock:  # transformers' lazy imports are not thread-safe
            spec = make_spec(plan or point.plan())
        key = spec_key(spec)
        with self.lock:
            hit = self.data.get(key)
        # A result from before the allocator replay is simulated again when simulations may run.
        if hit is not None and (hit.get("allocator") or not run):
            return SimulationResult.from_dict(hit), True
        if not run:
            return None, False
        result = simulate(spec)
        with self.lock:  # merge with what another run of this script may have written meanwhile
            on_disk = json.loads(self.path.read_text()) if self.path.is_file() else {}
            self.data = {**on_disk, **self.data, key: result.to_dict()}
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(self.data, indent=0, sort_keys=True))
        return result, False


def analytical(point: Point, plan) -> dict[str, float]:
    """The planner's per-rank device terms for the point (`plan`: point.plan())."""
    adapters = adapters_for(plan.config, plan.shape)
    return estimate_memory(plan.shape, plan.hardware, point.strategy, point.seq_len,
                           methods=[adapter_terms(adapters, plan.shape)] if adapters else []).gpu


def compare(point: Point, sim: SimulationResult) -> dict:
    plan = point.plan()
    est = analytical(point, plan)
    seen = sim.peak_bytes_cuda_rounded
    total = seen + sum(_unseen(plan, est, reserve=True).values())
    act = est.get("activations", 0) + est.get("logits", 0)
    replayed = {name: {"reserved_over_allocated": peaks["reserved"] / peaks["allocated"],
                       "needed_over_requested": peaks["needed"] / peaks["requested"], **peaks}
                for name, peaks in sim.allocator.items()}  # empty if simulated before the replay
    # The whole plan against the replay of the setting it models: the allocator's needed bytes for
    # the tensors, plus what no simulation sees.
    needed = sim.allocator.get(allocator_setting(plan.hardware), {}).get("needed")
    with_replay = needed + sum(_unseen(plan, est).values()) if needed else None
    return {"family": point.family, "backend": point.strategy.backend, "strategy": point.strategy.name,
            "seq": point.seq_len, "mb": point.strategy.micro_batch_size, "ac": point.strategy.activation_checkpointing,
            "analytical": sum(est.values()), "simulated": total, "ratio": sum(est.values()) / total,
            "act_logits_analytical": act, "act_peak_simulated": sim.activation_peak_bytes,
            "states_analytical": state_bytes(est),
            "peak_phase": sim.peak_phase, "allocator": replayed,
            "ratio_replayed": sum(est.values()) / with_replay if with_replay else None}


def row_text(r: dict) -> str:
    text = (f"{r['family']:<8} {r['strategy']:<30} {r['seq']:>5} {r['analytical'] / MiB:>9.0f} "
            f"{r['simulated'] / MiB:>9.0f} {r['ratio']:>6.3f} {r['act_logits_analytical'] / MiB:>8.0f} "
            f"{r['act_peak_simulated'] / MiB:>8.0f} {r['peak_phase']:>9}")
    if not r["allocator"]:
        return text + "      (simulated before the allocator replay)"
    off, on = r["allocator"]["segments"], r["allocator"]["expandable"]
    return (text + f" {off['reserved_over_allocated']:>6.3f} {on['reserved_over_allocated']:>6.3f} "
            f"{off['needed_over_requested']:>6.3f} {on['needed_over_requested']:>6.3f}")


def allocator_summary(rows: list[dict]) -> list[str]:
    """Per backend and expandable_segments setting: the replayed overheads against the planner's
    allocator reserve (planner/allocator_reserve.py: a constant + fractions of the states and of the
    transient bytes), which must cover every point."""
    replayed = [r for r in rows if r["allocator"]]
    if not replayed:
        return ["no point replayed yet"]
    whole = sorted(r["ratio_replayed"] for r in replayed)
    lines = [f"{len(replayed)} of {len(rows)} points replayed; analytical / (replayed needed bytes + unseen terms), "
             f"expandable segments as planned: {whole[0]:.3f}-{whole[-1]:.3f}, median {statistics.median(whole):.3f}",
             f"{'backend':<10} {'expandable':<10} {'points':>6} {'res/alloc med':>13} {'max':>6} "
             f"{'need/req med':>12} {'max':>6} {'beyond const max':>16} {'of trans':>8} {'short':>5}"]
    for backend in sorted({r["backend"] for r in replayed}):
        for name, on in (("segments", False), ("expandable", True)):
            mine = [r for r in replayed if r["backend"] == backend]
            reps = [r["allocator"][name] for r in mine]
            res = sorted(x["reserved_over_allocated"] for x in reps)
            need = sorted(x["needed_over_requested"] for x in reps)
            constant = reserve_bytes(backend, on, 0, 0)
            beyond = max((x["needed"] - x["requested"] - constant) / x["requested"] for x in reps)
            short = sum(not covered(r, name, on) for r in mine)
            lines.append(f"{backend:<10} {str(on):<10} {len(reps):>6} {statistics.median(res):>13.3f} {res[-1]:>6.3f} "
                         f"{statistics.median(need):>12.3f} {need[-1]:>6.3f} {beyond:>16.3f} "
                         f"{RESERVE[backend][on][2]:>8.3f} {short:>5}")
    return lines


def covered(row: dict, name: str, on: bool) -> bool:
    """Whether the planned reserve covers what the replayed allocator needs beyond the requested bytes."""
    a = row["allocator"][name]
    return a["needed"] <= a["requested"] + reserve_bytes(row["backend"], on, a["requested"], row["states_analytical"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", action="append", choices=sorted(FAMILIES), help="only these (repeatable)")
    parser.add_argument("--seq", type=int, action="append", help="only these sequence lengths")
    parser.add_argument("--strategy", action="append", metavar="BACKEND:STAGE",
                        help="only these (repeatable), e.g. deepspeed:3")
    parser.add_argument("--jobs", type=int, default=2, help="simulations run at once (each is one process)")
    parser.add_argument("--json", type=Path, help="write every row here")
    parser.add_argument("--cache", type=Path, default=CACHE)
    parser.add_argument("--cached-only", action="store_true", help="skip the points not simulated yet")
    parser.add_argument("--lora", action="store_true", help="the LoRA zoo (lora_zoo) instead of full fine-tuning")
    parser.add_argument("--layers", type=int, default=LAYERS,
                        help="blocks per model (default 2; more shows how a term grows with depth)")
    parser.add_argument("--mb", type=int, action="append", help="only these micro-batch sizes")
    args = parser.parse_args(argv)
    chosen = LORA_STRATEGIES if args.lora else STRATEGIES
    if args.strategy:
        chosen = tuple(pair for pair in chosen if f"{pair[0]}:{pair[1]}" in args.strategy)
    points = (lora_zoo(args.family, tuple(args.seq or (512, 1024)), chosen) if args.lora
              else zoo(args.family, tuple(args.seq or (512, 2048)), strategies=chosen, layers=args.layers))
    if args.mb:
        points = [p for p in points if p.strategy.micro_batch_size in args.mb]
    cache, start = Cache(args.cache), time.perf_counter()
    print(f"per-rank MiB, {WORLD} x generic 8 GB GPU, bf16, {args.layers}-block models; ratio = analytical / simulated")
    print(f"{'family':<8} {'strategy':<30} {'seq':>5} {'analytic':>9} {'simulated':>9} {'ratio':>6} "
          f"{'act+lg A':>8} {'act+lg S':>8} {'peak in':>9} {'res/al':>6} {'res/al':>6} {'need':>6} {'need':>6}")
    print(f"{'':<99} {'off':>6} {'on':>6} {'off':>6} {'on':>6}")
    rows, simulated = [], 0

    def one(point: Point):
        return point, *cache.get_or_run(point, run=not args.cached_only)

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for point, sim, hit in pool.map(one, points):
            if sim is None:
                continue
            simulated += not hit
            rows.append(compare(point, sim))
            print(row_text(rows[-1]), flush=True)
    if not rows:
        print("no simulated points")
        return 1
    worst = max(rows, key=lambda r: abs(r["ratio"] - 1))
    lo, hi = min(r["ratio"] for r in rows), max(r["ratio"] for r in rows)
    print(f"\n{len(rows)} points ({simulated} simulated now, the rest cached), ratio {lo:.3f}-{hi:.3f}, "
          f"worst |analytical/simulated - 1| = {abs(worst['ratio'] - 1):.3f} "
          f"({worst['family']} {worst['strategy']} seq {worst['seq']}); {time.perf_counter() - start:.0f} s")
    print("\nCUDA caching-allocator replay (expandable_segments off / on): reserved / allocated on a device with "
          "room to spare, and the memory the allocator runs in / the bytes requested")
    print("\n".join(allocator_summary(rows)))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
