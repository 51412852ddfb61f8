"""The data path against the demo model's training step: loader vs step tokens/s, cold vs cached
start-up, and the memory of 1 vs 2 workers mapping the token file.

    .venv/bin/python bench/data.py                      # ~16M tokens, about a minute on 2 cores
    .venv/bin/python bench/data.py --documents 20000    # quicker

The corpus is the demo grammar (orchestrate/data/corpus.py) with --documents documents; the model,
sequence length and batch are examples/tiny-gpt2.yaml's, on 2 CPU ranks (micro-batch 8, one thread
per rank, as `orchestrate launch --gpus 2` runs them on this 2-core machine).
- cold start: tokenise into an empty cache + map + first batch (datasets.map, byte tokenizer);
- cached start: the same with the cache filled (what every later launch and every worker does);
- loader: `TrainData.micro_batch` (sampler + gather from the memory map), one rank;
- step: forward + backward + AdamW step of the demo model on those batches, one rank;
- memory: PSS of the token file's mapping in 1 and in 2 worker processes reading every block.
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

from orchestrate.config.load import load_config  # noqa: E402
from orchestrate.data.corpus import demo_corpus  # noqa: E402
from orchestrate.data.pipeline import build_data, prepare_data  # noqa: E402
from orchestrate.model.meta import load_model_config, shape_for  # noqa: E402
from tests.helpers.memory import measure_mapping_workers  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20


class _Plan:  # build_data reads config, shape and files
    def __init__(self, config):
        self.config, self.shape, self.files = config, shape_for(config), {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=100_000)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--micro", type=int, default=8)
    args = parser.parse_args()
    import datasets  # noqa: F401  (imported up front: timed start-ups measure data work, not imports)

    with tempfile.TemporaryDirectory(prefix="orchestrate-bench-") as tmp:
        corpus = Path(tmp) / "corpus.txt"
        corpus.write_text("\n\n".join(demo_corpus(0, documents=args.documents)) + "\n")
        config = load_config(ROOT / "examples" / "tiny-gpt2.yaml", [
            f"train.output_dir={tmp}/runs", f"data.train_files=[{corpus}]", "data.generate_demo_corpus=false"])
        seq_len = config.train.seq_len

        start = time.perf_counter()
        prepared = prepare_data(config)
        build_data(_Plan(config), Path(tmp), 0, 2).micro_batch(args.micro)
        cold = time.perf_counter() - start
        start = time.perf_counter()
        data = build_data(_Plan(config), Path(tmp), 0, 2)
        data.micro_batch(args.micro)
        cached = time.perf_counter() - start
        tokens = int(prepared.train.meta["tokens"])

        calls = 2000
        start = time.perf_counter()
        for _ in range(calls):
            data.micro_batch(args.micro)
        loader = calls * args.micro * seq_len / (time.perf_counter() - start)

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

        for _ in range(3):
            step(data.micro_batch(args.micro))
        start = time.perf_counter()
        for _ in range(args.steps):
            step(data.micro_batch(args.micro))
        trainer = args.steps * args.micro * seq_len / (time.perf_counter() - start)

        entry, size = prepared.train.directory, prepared.train.tokens.nbytes
        del prepared, data  # unmap here: only the measured workers may map the file
        gc.collect()
        (one,) = measure_mapping_workers(entry, 1, seq_len)
        two = measure_mapping_workers(entry, 2, seq_len)

    print(f"corpus: {args.documents:,} documents, {tokens:,} tokens ({size / MiB:.1f} MiB as uint16); "
          f"seq_len {seq_len}, micro-batch {args.micro}, rank 0 of 2")
    print(f"start-up   cold (tokenise + map + first batch) {cold:7.2f} s   cached {cached:7.3f} s   "
          f"({cold / cached:,.0f}x)")
    print(f"tokens/s   loader {loader:12,.0f}   training step {trainer:10,.0f}   (loader {loader / trainer:,.0f}x)")
    rss2 = " + ".join(f"{w['Rss'] / MiB:.1f}" for w in two)
    pss2 = " + ".join(f"{w['Pss'] / MiB:.1f}" for w in two)
    print(f"memory     token file {size / MiB:.1f} MiB: 1 worker maps RSS {one['Rss'] / MiB:.1f} / PSS "
          f"{one['Pss'] / MiB:.1f} MiB; 2 workers RSS {rss2} / PSS {pss2} MiB (node total "
          f"{sum(w['Pss'] for w in two) / MiB:.1f} MiB); whole process PSS 1 worker {one['process_pss'] / MiB:.0f} "
          f"MiB, 2 workers {sum(w['process_pss'] for w in two) / MiB:.0f} MiB")

if __name__ == "__main__":
    main()
