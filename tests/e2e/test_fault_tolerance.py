"""Fault tolerance end to end, through the real CLI on 2 gloo ranks (slow): a SIGKILLed rank with
torchrun restarts, SIGTERM -> checkpoint + exit 75 + REQUEUE -> `--resume`, resume after a rollback,
resharding 2 -> 1 -> 2 ranks, export, and the checks that refuse an incompatible resume.

Every run is compared with an uninterrupted reference run of the same config (one per backend,
shared by the tests of this module): same seed, so an interrupted run must end with bit-identical
weights and the same per-step losses.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers.plans import TINY_GPT2

REPO = Path(__file__).resolve().parents[2]
MAX_STEPS = 24
STRATEGIES = {"fsdp": {"backend": "fsdp", "zero_stage": 3}, "deepspeed": {"backend": "deepspeed", "zero_stage": 2},
              "ddp": {"backend": "ddp", "zero_stage": 0}}


def _config(backend: str) -> dict:
    return {
        "model": {"architecture": dict(TINY_GPT2)},
        "train": {"seq_len": 32, "global_batch_size": 8, "micro_batch_size": 2, "max_steps": MAX_STEPS,
                  "checkpoint_every": 4, "keep_checkpoints": 3, "eval_every": 8, "seed": 0,
                  "optimizer": {"lr": 3e-3}, "schedule": {"warmup_steps": 2}, "output_dir": "runs"},
        "data": {"generate_demo_corpus": True},
        "strategy": dict(STRATEGIES[backend]),
    }


def _cli(*args: object) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "orchestrate", *map(str, args)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, timeout: float = 600) -> tuple[int, str]:
    """Wait for the launcher; one that hangs is killed with all its workers (they run in sessions
    of their own) so that a failure leaves nothing behind."""
    import psutil

    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for child in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
            child.kill()
        out, _ = proc.communicate()
        pytest.fail(f"the launch hung for {timeout} s and was killed:\n{out}")
    return proc.returncode, out


def _launch(config: Path, run_dir: Path, *extra: object) -> tuple[int, str]:
    return _finish(_cli("launch", config, "--gpus", extra[0] if extra else 2, "--run-dir", run_dir, *extra[1:]))


def _weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _assert_identical(run_dir: Path, reference: Path) -> None:
    got, want = _weights(run_dir / "model"), _weights(reference / "model")
    assert got.keys() == want.keys()
    different = [k for k in want if not torch.equal(got[k], want[k])]
    assert not different, f"weights differ from the uninterrupted run: {different[:5]}"
    records, expected = _metrics(run_dir), _metrics(reference)
    assert [r["step"] for r in records] == list(range(1, MAX_STEPS + 1)), "duplicate or missing steps"
    assert [r["loss"] for r in records] == [r["loss"] for r in expected]


def _assert_close(run_dir: Path, reference: Path) -> None:
    """Another world size sums gradients in another order: equal up to float rounding, and the
    same samples in every step (the sampler's global order), hence the same losses."""
    got, want = _weights(run_dir / "model"), _weights(reference / "model")
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst < 1e-4, worst
    records = _metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, MAX_STEPS + 1))
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in _metrics(reference)], rel=1e-4)


def _roll_back(src: Path, dst: Path, step: int) -> Path:
    """A copy of a run as if it had crashed right after the checkpoint of `step`."""
    shutil.copytree(src, dst)
    root = dst / "checkpoints"
    for ckpt in root.glob("step-*"):
        if int(ckpt.name.split("-")[1]) > step:
            shutil.rmtree(ckpt)
    (root / "latest").write_text(f"step-{step:08d}\n")
    shutil.rmtree(dst / "model")
    return dst


def _wait_for_step(run_dir: Path, proc: subprocess.Popen, step: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    path = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the run ended before it could be interrupted:\n" + proc.stdout.read()
        if path.exists() and any(json.loads(x)["step"] >= step for x in path.read_text().splitlines()[-1:]):
            return
        time.sleep(0.05)
    raise TimeoutError(f"no step {step} in {path}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """backend -> (config path, run dir) of an uninterrupted 2-rank run, made on first use."""
    runs: dict[str, tuple[Path, Path]] = {}

    def get(backend: str) -> tuple[Path, Path]:
        if backend not in runs:
            base = tmp_path_factory.mktemp(f"reference-{backend}")
            config = base / f"tiny-{backend}.yaml"
            config.write_text(yaml.safe_dump(_config(backend)))
            code, out = _launch(config, base / "run")
            assert code == 0, out
            runs[backend] = (config, base / "run")
        return runs[backend]

    return get


@pytest.mark.slow
def test_sigkill_of_a_rank_with_restarts_finishes_with_identical_weights(reference, tmp_path):
    import psutil

    config, ref = reference("fsdp")
    run_dir = tmp_path / "run"
    proc = _cli("launch", config, "--gpus", 2, "--run-dir", run_dir, "--max-restarts", 2)
    _wait_for_step(run_dir, proc, 6)  # past the checkpoint of step 4
    workers = [p for p in psutil.Process(proc.pid).children(recursive=True)
               if p.name() == "orchestrate-r1"]  # worker.main.name_this_rank
    assert len(workers) == 1
    workers[0].send_signal(signal.SIGKILL)
    code, out = _finish(proc, timeout=300)
    assert code == 0, out
    restarted = list((run_dir / "logs").rglob("attempt_1/0/stdout.log"))
    assert restarted and "resumed from" in restarted[0].read_text(), "torchrun did not restart the workers"
    _assert_identical(run_dir, ref)  # steps after the checkpoint recomputed, metrics not duplicated
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "latest", "step-00000016", "step-00000020", "step-00000024"]  # keep_checkpoints: 3


@pytest.mark.slow
def test_sigterm_checkpoints_exits_75_with_requeue_marker_and_resume_is_bit_identical(reference, tmp_path):
    config, ref = reference("deepspeed")
    run_dir = tmp_path / "run"
    proc = _cli("launch", config, "--gpus", 2, "--run-dir", run_dir)
    _wait_for_step(run_dir, proc, 5)
    proc.send_signal(signal.SIGTERM)  # to the launcher: torchrun forwards it to the workers
    code, out = _finish(proc)
    assert code == 75, out
    marker = json.loads((run_dir / "REQUEUE").read_text())
    stopped = marker["stopped_at"]
    assert marker["step"] == stopped < MAX_STEPS and marker["signal"] == "SIGTERM"
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step-{stopped:08d}"
    assert _metrics(run_dir)[-1]["step"] == stopped
    assert not (run_dir / "model").exists()

    code, out = _launch(config, run_dir, 2, "--resume")
    assert code == 0, out
    assert f"from step {stopped}" in out and "with its own plan" in out
    assert not (run_dir / "REQUEUE").exists()
    _assert_identical(run_dir, ref)


@pytest.mark.slow
def test_ddp_resumed_after_a_crash_is_bit_identical(reference, tmp_path):
    config, ref = reference("ddp")
    run_dir = _roll_back(ref, tmp_path / "run", 16)
    code, out = _launch(config, run_dir, 2, "--resume")
    assert code == 0, out
    _assert_identical(run_dir, ref)


def _state_bytes(value) -> object:
    """A checkpoint state with every tensor as its raw bytes (dtype and shape kept): equal only when
    byte-identical (torch.equal calls -0.0 and 0.0 equal)."""
    if isinstance(value, torch.Tensor):
        flat = value.detach().contiguous().cpu().reshape(-1)
        return (str(value.dtype), tuple(value.shape), flat.view(torch.uint8).numpy().tobytes())
    if isinstance(value, dict):
        return {k: _state_bytes(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_state_bytes(v) for v in value]
    return value


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and every process under it at once, as the OOM killer or a lost node does."""
    import psutil

    tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    for p in tree:
        p.kill()
    psutil.wait_procs(tree, timeout=30)
    proc.communicate()


SIGNAL_SEED = 38


@pytest.mark.slow
def test_signals_at_random_moments_then_resume_give_byte_identical_model_and_optimizer(reference, tmp_path):
    """A SIGTERM to the launcher at a seeded random moment (a step, an evaluation or a checkpoint
    write under way), `--resume`, a SIGKILL of every process of that launch at another, `--resume`
    again: the final model file and the last checkpoint's model and optimizer state are
    byte-identical to the uninterrupted run's, and every step's loss is the same."""
    config, ref = reference("ddp")
    rng = random.Random(SIGNAL_SEED)
    run_dir = tmp_path / "run"

    proc = _cli("launch", config, "--gpus", 2, "--run-dir", run_dir)
    _wait_for_step(run_dir, proc, rng.randint(1, 8))
    time.sleep(rng.uniform(0, 0.5))
    proc.send_signal(signal.SIGTERM)
    code, out = _finish(proc)
    assert code == 75, out
    stopped = json.loads((run_dir / "REQUEUE").read_text())["stopped_at"]

    proc = _cli("launch", config, "--gpus", 2, "--run-dir", run_dir, "--resume")
    _wait_for_step(run_dir, proc, stopped + rng.randint(1, MAX_STEPS - stopped - 4))
    time.sleep(rng.uniform(0, 0.5))
    _kill_tree(proc)

    code, out = _launch(config, run_dir, 2, "--resume")
    assert code == 0, out
    resumed = re.search(r"from step (\d+)", out)
    assert resumed and stopped <= int(resumed.group(1)) < MAX_STEPS, out  # a resume, not a fresh start
    assert (run_dir / "model" / "model.safetensors").read_bytes() == (ref / "model" / "model.safetensors").read_bytes()
    _assert_identical(run_dir, ref)
    last = f"step-{MAX_STEPS:08d}"
    states = sorted(p.relative_to(ref / "checkpoints" / last) for p in (ref / "checkpoints" / last).rglob("*.pt"))
    assert states, "the checkpoint holds no torch state"
    for name in states:
        got, want = (torch.load(root / "checkpoints" / last / name, map_location="cpu", weights_only=False)
                     for root in (run_dir, ref))
        assert "optimizer" not in want or want["optimizer"]["state"], name
        assert _state_bytes(got) == _state_bytes(want), f"{name} differs from the uninterrupted run's"


@pytest.fixture(scope="module")
def on_one_rank(reference, tmp_path_factory):
    """backend -> a copy of the 2-rank reference rolled back to step 16 and resumed on 1 rank."""
    runs: dict[str, tuple[Path, Path, int, str]] = {}

    def get(backend: str) -> tuple[Path, Path, int, str]:
        if backend not in runs:
            config, ref = reference(backend)
            one = _roll_back(ref, tmp_path_factory.mktemp(f"one-{backend}") / "run", 16)
            runs[backend] = (config, one, *_launch(config, one, 1, "--resume"))  # re-planned for 1 rank
        return runs[backend]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["fsdp", "deepspeed"])
def test_two_rank_checkpoint_resumes_on_one_rank(backend, reference, on_one_rank):
    _, one, code, out = on_one_rank(backend)
    assert code == 0, out
    assert "with a new plan" in out
    assert json.loads((one / "checkpoints" / "step-00000024" / "meta.json").read_text())["world_size"] == 1
    _assert_close(one, reference(backend)[1])
    if backend == "deepspeed":  # ZeRO partitions of another DP size went through a universal checkpoint
        assert (one / "checkpoints" / "step-00000016" / "universal").is_dir()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["fsdp", "deepspeed"])
def test_one_rank_checkpoint_resumes_on_two_ranks(backend, reference, on_one_rank, tmp_path):
    config, one, code, out = on_one_rank(backend)
    assert code == 0, out
    two = _roll_back(one, tmp_path / "two", 20)  # step 20 was written by the 1-rank run
    assert json.loads((two / "checkpoints" / "step-00000020" / "meta.json").read_text())["world_size"] == 1
    code, out = _launch(config, two, 2, "--resume")
    assert code == 0, out
    _assert_close(two, reference(backend)[1])


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["fsdp", "deepspeed", "ddp"])
def test_export_writes_the_trained_model_from_any_checkpoint(backend, reference, tmp_path):
    from transformers import AutoModelForCausalLM, GenerationConfig

    from orchestrate.export import export_checkpoint

    _, ref = reference(backend)
    code, out = _finish(_cli("export", ref, "--out", tmp_path / "latest"))
    assert code == 0, out
    # Both the run's model/ and the export carry what save_pretrained writes, generation config included.
    assert GenerationConfig.from_pretrained(tmp_path / "latest").to_dict() == \
        GenerationConfig.from_pretrained(ref / "model").to_dict()
    exported, trained = _weights(tmp_path / "latest"), _weights(ref / "model")
    assert exported.keys() == trained.keys()
    assert all(torch.equal(exported[k], trained[k]) for k in trained)  # fp32: the weights exactly
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "latest")
    ids = torch.tensor([list(b"The cat sees the dog.")])
    with torch.no_grad():
        assert model(input_ids=ids, labels=ids).loss.item() < 5.0  # trained, not the initial model
    export_checkpoint(ref, tmp_path / "step16", step=16)
    earlier = _weights(tmp_path / "step16")
    assert not torch.equal(earlier["transformer.wte.weight"], trained["transformer.wte.weight"])


@pytest.mark.slow
def test_incompatible_resumes_are_refused_with_what_differs(reference, tmp_path):
    config, ref = reference("fsdp")
    run_dir = _roll_back(ref, tmp_path / "run", 16)
    cases = [(["--set", "train.seq_len=16"], "train.seq_len"),
             (["--set", "strategy.backend=ddp", "--set", "strategy.zero_stage=0"], "strategy.backend"),
             (["--set", "model.architecture.n_layer=3"], "num_layers 2 -> 3"),
             (["--set", "train.seed=1"], "train.seed: 0 when the checkpoint was written, 1 now"),
             (["--set", "train.optimizer.name=adamw8bit"], "train.optimizer.name")]
    for extra, named in cases:
        code, out = _launch(config, run_dir, 2, "--resume", *extra)
        assert code == 2 and named in out, (extra, out)
    code, out = _launch(config, run_dir, 2)  # a new launch must not take over a checkpointed run
    assert code == 2 and "--resume" in out, out


@pytest.mark.slow
def test_a_resume_applies_a_changed_learning_rate_from_the_next_step_and_says_so(reference, tmp_path):
    config, ref = reference("ddp")
    run_dir = _roll_back(ref, tmp_path / "run", 16)
    code, out = _launch(config, run_dir, 2, "--resume", "--set", "train.optimizer.lr=0.03")
    assert code == 0, out
    assert "changed since the checkpoint, in effect from step 17:\n  train.optimizer.lr: 0.003 -> 0.03" in out, out
    resumed, uninterrupted = _metrics(run_dir), _metrics(ref)
    assert [r["lr"] for r in resumed[:16]] == [r["lr"] for r in uninterrupted[:16]]
    # The same schedule, ten times the base rate (loading the checkpoint had brought 0.003 back).
    assert [r["lr"] for r in resumed[16:]] == pytest.approx([10 * r["lr"] for r in uninterrupted[16:]], rel=1e-9)


@pytest.mark.slow
def test_data_edited_in_place_is_refused_by_the_launcher_before_any_worker(reference, tmp_path):
    config, ref = reference("ddp")
    run_dir = _roll_back(ref, tmp_path / "run", 16)
    corpus = run_dir / "data" / "demo_corpus.txt"
    text = corpus.read_text()
    corpus.write_text("X" + text[1:])  # the same size: the same number of blocks, other tokens
    before = (run_dir / "metrics.jsonl").read_text()
    code, out = _launch(config, run_dir, 2, "--resume")
    assert code == 2, out
    assert "the data changed since the checkpoint" in out and "the training data (its contents" in out, out
    assert "Traceback" not in out and "training ddp" not in out, out  # one message; no worker started
    assert (run_dir / "metrics.jsonl").read_text() == before
