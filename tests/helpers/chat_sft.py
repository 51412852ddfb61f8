"""The examples/chat-sft workspace built in a directory, and its runs, through the real launcher on 2 CPU
ranks (shared by tests/e2e/test_sft_e2e.py and bench/sft_learning.py): generated chats and base text, the
ChatML tokenizer `orchestrate tokenizer train` makes, the tiny base pre-trained by base.yaml, then
chat fine-tuning with model.yaml (the built-in worker) or with examples/chat-sft/own_loop.py."""

from __future__ import annotations

import json
import runpy
from dataclasses import dataclass
from pathlib import Path

from orchestrate import api
from tests.helpers.plans import cpu_hardware

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "chat-sft"


@dataclass(frozen=True)
class Workspace:
    root: Path

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def base(self) -> Path:
        return self.root / "base" / "model"

    def sets(self) -> list[str]:
        """model.yaml's paths pointed at this workspace."""
        d = self.data
        return [f"model.name_or_path={self.base}", f"data.train_files=[{d / 'chats.jsonl'}]",
                f"data.validation_files=[{d / 'held_out.jsonl'}]", f"data.tokenizer={d / 'tokenizer'}",
                f"data.cache_dir={self.root / 'cache'}", f"train.output_dir={self.root}"]


def _launch(config_name: str, sets: list[str], run_dir: Path, program: tuple[str, ...] = ()) -> None:
    config = api.load_config(EXAMPLE / config_name, sets)
    request = api.launch_request(config, cpu_hardware(2), run_dir=run_dir, program=program)
    result = api.launch(request, api.choose_transport(program=program) if program else None)
    if result.exit_code != 0:
        raise RuntimeError(f"{config_name} in {run_dir} failed ({result.exit_code}): {result.messages[-5:]}")


def build_workspace(root: Path, base_steps: int | None = None) -> Workspace:
    """Chats, tokenizer and the pre-trained base, as `make chat-sft` builds them (base_steps: fewer steps);
    a workspace whose base is there already is reused as it is."""
    ws = Workspace(root)
    if (ws.base / "model.safetensors").is_file():
        return ws
    make = runpy.run_path(str(EXAMPLE / "make_chats.py"))
    train, held_out = make["make"](600, 60, 0)
    ws.data.mkdir(parents=True, exist_ok=True)
    for name, rows in (("chats.jsonl", train), ("held_out.jsonl", held_out)):
        (ws.data / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (ws.data / "base_corpus.txt").write_text("\n".join(make["base_corpus"](4000, 0)) + "\n")
    tok_config = api.load_config(EXAMPLE / "tokenizer.yaml", [f"data.train_files=[{ws.data / 'chats.jsonl'}]",
                                                              f"data.cache_dir={root / 'cache'}"])
    api.train_tokenizer(tok_config, 640, ws.data / "tokenizer")
    base_sets = [f"data.train_files=[{ws.data / 'base_corpus.txt'}]", f"data.tokenizer={ws.data / 'tokenizer'}",
                 f"data.cache_dir={root / 'cache'}", f"train.output_dir={root}",
                 *([f"train.max_steps={base_steps}"] if base_steps else [])]
    _launch("base.yaml", base_sets, root / "base")
    return ws


def fine_tune(ws: Workspace, name: str, sets: list[str] = ()) -> Path:
    """model.yaml with the built-in worker (`sets` on top of the workspace's paths); the run directory."""
    run_dir = ws.root / name
    _launch("model.yaml", [*ws.sets(), *sets], run_dir)
    return run_dir


def own_loop(ws: Workspace, name: str, method: str, steps: int = 50, chats_per_step: int = 14, seed: int = 0) -> int:
    """examples/chat-sft/own_loop.py under model.yaml's plan (DDP, `chats_per_step` padded chats per step: 14 is
    about what model.yaml's 4 packed blocks of 128 hold, 13.6); its exact matches."""
    run_dir, result = ws.root / name, ws.root / f"{name}.json"
    program = ("python", str(EXAMPLE / "own_loop.py"), "--method", method, "--steps", str(steps), "--base",
               str(ws.base), "--data", str(ws.data), "--result", str(result), "--seed", str(seed))
    _launch("model.yaml", [*ws.sets(), f"train.method={method}", "strategy.backend=ddp", f"train.seed={seed}",
                           f"train.global_batch_size={chats_per_step}", "train.optimizer.name=adamw"], run_dir, program)
    return int(json.loads(result.read_text())["exact"])


def final_record(run_dir: Path) -> dict:
    """The last metrics.jsonl record (with eval_loss, eval_exact_match and the generations)."""
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])


def dpo_after(ws: Workspace, sft_run: Path, name: str = "dpo") -> Path:
    """examples/chat-sft/dpo.yaml on the SFT run's RUN_DIR/model, with make_preferences.py's chat pairs
    (the preferred answer ends with "!"); the run directory."""
    make = runpy.run_path(str(EXAMPLE / "make_preferences.py"))
    train, held_out = make["make"](400, 1)
    for file, rows in (("pairs.jsonl", train), ("held_out_pairs.jsonl", held_out)):
        (ws.data / file).write_text("".join(json.dumps(r) + "\n" for r in rows))
    d = ws.data
    sets = [f"model.name_or_path={sft_run / 'model'}", f"data.train_files=[{d / 'pairs.jsonl'}]",
            f"data.validation_files=[{d / 'held_out_pairs.jsonl'}]", f"data.tokenizer={d / 'tokenizer'}",
            f"data.cache_dir={ws.root / 'cache'}", f"train.output_dir={ws.root}"]
    _launch("dpo.yaml", sets, ws.root / name)
    return ws.root / name
