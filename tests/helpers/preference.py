"""examples/preference's generated pairs and its runs through the real launcher on 2 CPU ranks
(shared by tests/methods/preference/test_preference_e2e.py and bench/preference_learning.py)."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import yaml

from tests.e2e.test_fault_tolerance import _launch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "preference"


class PreferenceRuns:
    """run(name, method, steps, train=..., data=..., **preference) -> the run directory, trained once per
    name (loss kto: on the pairs' answers labelled, chosen desirable)."""

    def __init__(self, root: Path, pairs: int = 400, held_out: int = 40, seed: int = 0):
        self.root = root
        make = runpy.run_path(str(EXAMPLE / "make_pairs.py"))
        train, held = make["make"](pairs, held_out, seed)
        for name, rows in (("pairs.jsonl", train), ("held_out.jsonl", held), ("answers.jsonl", make["unpaired"](train)),
                           ("held_out_answers.jsonl", make["unpaired"](held))):
            (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        self.done: dict[str, Path] = {}

    def __call__(self, name: str, method: str = "full", steps: int = 40, train: dict | None = None,
                 data: dict | None = None, **preference) -> Path:
        if name in self.done:
            return self.done[name]
        config = yaml.safe_load((EXAMPLE / "model.yaml").read_text())
        config["train"].update(method=method, max_steps=steps, output_dir=str(self.root),
                               checkpoint_every=steps // 2, eval_every=steps // 2, **(train or {}))
        if method != "full":
            config["train"]["optimizer"]["lr"] = 1e-2  # adapters start at zero: a larger step
        kto = preference.get("loss") == "kto"  # labelled answers, not pairs
        config["data"].update(train_files=[str(self.root / ("answers.jsonl" if kto else "pairs.jsonl"))],
                              validation_files=[str(self.root / ("held_out_answers.jsonl" if kto else "held_out.jsonl"))],
                              cache_dir=str(self.root / "cache"), **(data or {}))
        config["preference"].update(preference)
        if preference.get("loss") in ("orpo", "kto"):  # the example's rpo_alpha is for the pairwise losses
            config["preference"].pop("rpo_alpha", None)
        path = self.root / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        code, out = _launch(path, self.root / name)
        if code != 0:
            raise RuntimeError(f"{name} failed ({code}): {out[-3000:]}")
        self.done[name] = self.root / name
        return self.done[name]
