"""The data path against the demo model's training step: loader vs step tokens/s, cold vs cached
start-up, and the memory of 1 vs 2 workers mapping the token file.

    .venv/bin/python bench/data.py                      # ~16M tokens, about a minute on 2 cores
    .venv/bin/python bench/data.py --documents 20000    # quicker
    .venv/bin/python bench/data.py --short              # 500 documents, 2 steps, one round (CI)

The corpus is the demo grammar (orchestrate/data/corpus.py) with --documents documents; the model,
sequence length and batch are examples/tiny-gpt2.yaml's, on 2 CPU ranks (micro-batch 8, one thread
per rank, as `orchestrate launch --gpus 2` runs them on this 2-core machine).
- cold start: tokenise into an empty cache + map + first batch (datasets.map, byte tokenizer);
- cached start: the same with the cache filled (what every later launch and every worker does);
- loader: `TrainData.micro_batch` (sampler + gather from the memory map), one rank;
- step: forward + backward + AdamW step of the demo model on those batches, one rank;
- memory: PSS of the token file's mapping in 1 and in 2 worker processes reading every block.
Start-ups (cold, cached) and rates (loader, step) run as interleaved pairs, `--repeats` rounds
(bench/repeats.py); each prints median (min-max), and each ratio is that of the per-round pairs.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.repeats import interleave, paired_ratio, spread  # noqa: E402
from orchestrate.config.load import load_config  # noqa: E402
from orchestrate.data.corpus import demo_corpus  # noqa: E402
from orchestrate.data.pipeline import build_data, prepare_data  # noqa: E402
from orchestrate.model.meta import load_model_config, shape_for  # noqa: E402
from orchestrate.planner.plan import RunFiles  # noqa: E402
from tests.helpers.memory import measure_mapping_workers  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20


class _Plan:  # build_data reads config, shape and files (typed, as RunPlan's)
    def __init__(self, config):
        self.config, self.shape, self.files = config, shape_for(config), RunFiles()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=100_000)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds (bench/repeats.py)")
    parser.add_argument("--short", action="store_true",
                        help="500 documents, 2 steps, one round (overrides --documents, --steps, --repeats)")
    args = parser.parse_args(argv)
    if args.short:
        args.documents, args.steps, args.repeats = 500, 2, 1
    import datasets  # noqa: F401  (imported up front: timed start-ups measure data work, not imports)

    with tempfile.TemporaryDirectory(prefix="orchestrate-bench-") as tmp:
        corpus = Path(tmp) / "corpus.txt"
        corpus.write_text("\n\n".join(demo_corpus(0, documents=args.documents)) + "\n")
        base = [f"data.train_files=[{corpus}]", "data.generate_demo_corpus=false"]
        rounds = iter(range(10**9))
        fresh: dict = {}

        def cold() -> float:  # tokenise into an empty cache (a new one each round) + map + first batch
            config = load_config(ROOT / "examples" / "tiny-gpt2.yaml",
                                 [*base, f"train.output_dir={tmp}/runs-{next(rounds)}"])
            start = time.perf_counter()
            fresh["prepared"] = prepare_data(config)
            build_data(_Plan(config), Path(tmp), 0, 2).micro_batch(args.micro)
            fresh["config"] = config
            return time.perf_counter() - start

        def cached() -> float:  # the same with this round's cache filled
            start = time.perf_counter()
            fresh["data"] = build_data(_Plan(fresh["config"]), Path(tmp), 0, 2)
            fresh["data"].micro_batch(args.micro)
            return time.perf_counter() - start

        starts = interleave({"cold": cold, "cached": cached}, args.repeats)
        config, prepared = fresh["config"], fresh["prepared"]
        seq_len = config.train.seq_len
        tokens = int(prepared.train.meta["tokens"])

        torch.set_num_threads(1)
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(load_model_config(config))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(batch: dict[str, torch.Tensor]) -> None:
            loss = model(**batch, use_cache=False).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        def loader() -> float:
            calls = 2000
            start = time.perf_counter()
            for _ in range(calls):
                fresh["data"].micro_batch(args.micro)
            return calls * args.micro * seq_len / (time.perf_counter() - start)

        def trainer() -> float:
            start = time.perf_counter()
            for _ in range(args.steps):
                step(fresh["data"].micro_batch(args.micro))
            return args.steps * args.micro * seq_len / (time.perf_counter() - start)

        for _ in range(3):
            step(fresh["data"].micro_batch(args.micro))
        rates = interleave({"loader": loader, "step": trainer}, args.repeats)

        entry, size = prepared.train.directory, prepared.train.tokens.nbytes
        del prepared
        fresh.clear()  # unmap here: only the measured workers may map the file
        gc.collect()
        (one,) = measure_mapping_workers(entry, 1, seq_len)
        two = measure_mapping_workers(entry, 2, seq_len)

    print(f"corpus: {args.documents:,} documents, {tokens:,} tokens ({size / MiB:.1f} MiB as uint16); "
          f"seq_len {seq_len}, micro-batch {args.micro}, rank 0 of 2")
    print(f"start-up   median (min-max) of {args.repeats} interleaved rounds: cold (tokenise + map + first batch) "
          f"{spread(starts['cold']).format('.2f')} s, cached {spread(starts['cached']).format('.3f')} s, "
          f"cold/cached {paired_ratio(starts['cold'], starts['cached']).format(',.0f')}")
    print(f"tokens/s   loader {spread(rates['loader']).format(',.0f')}   training step {spread(rates['step']).format(',.0f')}"
          f"   (loader/step {paired_ratio(rates['loader'], rates['step']).format(',.0f')})")
    rss2 = " + ".join(f"{w['Rss'] / MiB:.1f}" for w in two)
    pss2 = " + ".join(f"{w['Pss'] / MiB:.1f}" for w in two)
    print(f"memory     token file {size / MiB:.1f} MiB: 1 worker maps RSS {one['Rss'] / MiB:.1f} / PSS "
          f"{one['Pss'] / MiB:.1f} MiB; 2 workers RSS {rss2} / PSS {pss2} MiB (node total "
          f"{sum(w['Pss'] for w in two) / MiB:.1f} MiB); whole process PSS 1 worker {one['process_pss'] / MiB:.0f} "
          f"MiB, 2 workers {sum(w['process_pss'] for w in two) / MiB:.0f} MiB")

if __name__ == "__main__":
    main()
