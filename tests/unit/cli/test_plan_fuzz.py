"""Property: whatever YAML and `--set` overrides `orchestrate plan` gets, it exits 0 or 2 with no
traceback, in bounded time and memory. Cases are mutations of the tiny GPT-2
demo's config: wrong types, huge and negative numbers, unicode, deep nesting, aliases."""

from __future__ import annotations

import math
import resource
import traceback
from pathlib import Path

import pytest
import yaml

hypothesis = pytest.importorskip("hypothesis")
from click.testing import CliRunner  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from orchestrate.cli import cli  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
BASE = yaml.safe_load((ROOT / "examples" / "tiny-gpt2.yaml").read_text())
BASE.pop("data", None)  # planning needs no data section
KEYS = ["model.architecture.n_embd", "model.architecture.n_layer", "model.architecture.n_head",
        "model.architecture.n_positions", "model.architecture.vocab_size", "model.architecture.model_type",
        "model.trust_remote_code", "model.name_or_path", "model", "train", "train.seq_len",
        "train.global_batch_size", "train.micro_batch_size", "train.precision", "train.activation_checkpointing",
        "train.optimizer.lr", "train.optimizer.betas", "train.optimizer.eps", "train.optimizer.weight_decay",
        "train.schedule.warmup_steps", "train.schedule.min_lr_ratio", "train.max_steps", "train.seed",
        "train.grad_clip", "train.output_dir", "data.num_proc", "data.tokenizer", "data.train_files",
        "strategy.backend", "strategy.zero_stage", "strategy.offload", "strategy.offload_params",
        "strategy.nvme_path", "strategy.gpu_memory_headroom", "strategy.cpu_memory_headroom", "bogus.key"]

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, 2, 3, 4, 7, 64, 256, 2**31 - 1, 2**31, 2**63, -1]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
    st.sampled_from(["auto", "bf16", "fp16", "deepspeed", "fsdp", "ddp", "cpu", "nvme", "yes", "on", "1e-3", "é✓🙂"]),
)
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=12)


def _set(data: dict, dotted: str, value) -> None:
    parts = dotted.split(".")
    for part in parts[:-1]:
        if not isinstance(data.get(part), dict):
            data[part] = {}
        data = data[part]
    data[parts[-1]] = value


def _yaml_scalar(value) -> str:
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return ".nan" if math.isnan(value) else ("-.inf" if value < 0 else ".inf")
    return yaml.safe_dump(value, default_flow_style=True, allow_unicode=True).strip().removesuffix("...").strip()


RAW_TAILS = st.sampled_from([
    "", "x: &a [1, 2]\ny: *a\n", "x: &a [*a]\n", "train:\n  seq_len: 8\n", "\t- broken: [\n", "x: !!python/object:os.system {}\n",
    "x: " + "[" * 200 + "]" * 200 + "\n", "x: {a: &b {c: 1}, d: *b, <<: *b}\n", "? [1, 2]\n: 3\n", "x: 0x1F\n",
    "# caf\udce9\n",  # a lone surrogate: written as the invalid UTF-8 byte 0xe9 (surrogateescape)
])


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """One plan first: the imports (transformers, the planner) must not count against the deadline."""
    path = tmp_path_factory.mktemp("warm") / "model.yaml"
    path.write_text(yaml.safe_dump(BASE))
    result = CliRunner().invoke(cli, ["plan", str(path), "--profile", "rtx3070"])
    assert result.exit_code == 0, result.output


@settings(max_examples=150, deadline=3000, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(mutations=st.lists(st.tuples(st.sampled_from(KEYS), values), max_size=4),
       overrides=st.lists(st.tuples(st.sampled_from(KEYS), values), max_size=3),
       tail=RAW_TAILS)
def test_plan_exits_0_or_2_without_a_traceback(warm, tmp_path_factory, mutations, overrides, tail):
    data = yaml.safe_load(yaml.safe_dump(BASE))
    for key, value in mutations:
        _set(data, key, value)
    path = tmp_path_factory.mktemp("fuzz") / "model.yaml"
    path.write_bytes((yaml.safe_dump(data, allow_unicode=True) + tail).encode("utf-8", errors="surrogateescape"))
    args = ["plan", str(path), "--profile", "rtx3070"]
    for key, value in overrides:
        args += ["--set", f"{key}={_yaml_scalar(value)}"]
    result = CliRunner().invoke(cli, args)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        trace = "".join(traceback.format_exception(result.exception))[-4000:]
        pytest.fail(f"{args}\n{path.read_text()[:2000]}\n{trace}")
    assert result.exit_code in (0, 2), (args, result.output[-2000:])
    assert "Traceback" not in result.output


def test_memory_stayed_bounded():
    # ru_maxrss is this process's peak (KiB on Linux): the fuzz cases above ran in it.
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss < 4 * 2**20, "peak RSS above 4 GiB"
