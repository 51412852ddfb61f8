"""Write the labelled CSVs examples/bert-classifier.yaml trains on (no download).

Each row is a short sentence of filler words plus one topic word; the label is the topic of that
word (animal, food or vehicle): a rule a small BERT learns in about a hundred steps, so validation
accuracy shows whether training works. Usage:

    python examples/make_labelled_csv.py [OUT_DIR]     # default examples/data -> train.csv, val.csv
"""

from __future__ import annotations

import csv
import random
import sys
from pathlib import Path

FILLER = "the a one this that sees has likes near under over big small red blue old new".split()
TOPICS = {"animal": "zebra koala".split(),
          "food": "pizza mango".split(),
          "vehicle": "truck canoe".split()}


def write(path: Path, rows: int, seed: int) -> None:
    rng = random.Random(seed)
    labels = sorted(TOPICS)
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["text", "label"])
        for i in range(rows):
            label = labels[i % len(labels)]
            words = [rng.choice(FILLER) for _ in range(rng.randint(3, 8))]
            words.insert(rng.randrange(len(words) + 1), rng.choice(TOPICS[label]))
            out.writerow([" ".join(words), label])


def main(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    write(out_dir / "train.csv", 600, seed=1)
    write(out_dir / "val.csv", 96, seed=2)
    print(f"wrote {out_dir / 'train.csv'} (600 rows) and {out_dir / 'val.csv'} (96 rows)")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "data")
