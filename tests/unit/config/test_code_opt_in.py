"""No code named by a config runs without its one opt-in, `model.trust_remote_code: true`: not
`model.module` / `data.module` (imported and called by `plan`, `config`, `launch` and the workers),
not the `auto_map` code of a tokenizer or model directory, and not after a "y" at transformers'
own trust prompt. Each case carries a harmless payload that writes a marker file when it runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from orchestrate.cli import cli
from orchestrate.config.load import config_from_dict
from orchestrate.errors import UserError
from tests.helpers.plans import TINY_GPT2

SWITCH = "model.trust_remote_code"


def _write(tmp_path: Path, config: dict) -> Path:
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _module_config(marker: Path, **data: object) -> dict:
    return {"model": {"module": "os:system", "kwargs": {"command": f"touch {marker}"}},
            "data": dict(data), "train": {"seq_len": 1, "global_batch_size": 8}}


@pytest.mark.parametrize("command", ["plan", "config", "launch"])
def test_a_module_from_the_config_is_not_imported_or_called_without_the_opt_in(tmp_path: Path, command: str):
    marker = tmp_path / "ran"
    config = _write(tmp_path, _module_config(marker, module="os:system", kwargs={"command": f"touch {marker}"}))
    extra = {"plan": [], "config": ["--out", str(tmp_path / "out")],
             "launch": ["--dry-run", "--run-dir", str(tmp_path / "run")]}[command]
    result = CliRunner().invoke(cli, [command, "--gpus", "2", str(config), *extra])
    assert result.exit_code == 2, result.output
    assert not marker.exists(), "os.system ran"
    assert SWITCH in result.output and "model.module" in result.output and "Traceback" not in result.output


def test_data_module_is_gated_by_the_same_switch(tmp_path: Path):
    from orchestrate.methods.custom.data import load_dataset

    marker = tmp_path / "ran"
    config = config_from_dict({"model": {"module": "tests.helpers.custom_modules:ResMLP"},
                               "data": {"module": "os:system", "kwargs": {"command": f"touch {marker}"}},
                               "train": {"seq_len": 1, "global_batch_size": 8}}, tmp_path)
    with pytest.raises(UserError) as err:
        load_dataset(config)
    assert not marker.exists()
    assert [p.where for p in err.value.problems] == ["data.module"] and SWITCH in str(err.value)


def test_with_the_switch_the_module_is_used(tmp_path: Path):
    from orchestrate.methods.custom.module import module_factory

    config = config_from_dict({"model": {"module": "tests.helpers.custom_modules:ResMLP", "trust_remote_code": True},
                               "data": {"module": "tests.helpers.custom_modules:rule"},
                               "train": {"seq_len": 1, "global_batch_size": 8}}, tmp_path)
    assert module_factory(config).__name__ == "ResMLP"


def _tokenizer_with_custom_code(directory: Path, marker: Path) -> Path:
    """A working tokenizer whose tokenizer_config.json maps AutoTokenizer to a class in the
    directory's own Python file (what a Hub repo with custom code looks like)."""
    from orchestrate.data.tokenizer import byte_tokenizer_fast

    byte_tokenizer_fast().save_pretrained(str(directory))
    config_path = directory / "tokenizer_config.json"
    settings = json.loads(config_path.read_text())
    settings.update(tokenizer_class="MarkerTokenizerFast", auto_map={"AutoTokenizer": [None, "marker_tok.MarkerTokenizerFast"]})
    config_path.write_text(json.dumps(settings))
    (directory / "marker_tok.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
        "from transformers import PreTrainedTokenizerFast\n\n\n"
        "class MarkerTokenizerFast(PreTrainedTokenizerFast):\n    pass\n")
    return directory


def test_a_tokenizer_with_auto_map_code_is_refused_even_after_a_yes_at_the_prompt(tmp_path: Path, monkeypatch):
    marker = tmp_path / "ran"
    tok = _tokenizer_with_custom_code(tmp_path / "tok", marker)
    # Left to itself, transformers asks "Do you wish to run the custom code? [y/N]" at a TTY.
    monkeypatch.setattr("builtins.input", lambda *a: "y")
    config = _write(tmp_path, {"model": {"architecture": dict(TINY_GPT2)}, "train": {"seq_len": 32, "global_batch_size": 8},
                               "data": {"generate_demo_corpus": True, "tokenizer": str(tok),
                                        "cache_dir": str(tmp_path / "cache")}})
    result = CliRunner().invoke(cli, ["prepare", str(config)])
    assert result.exit_code == 2, result.output
    assert not marker.exists(), "the tokenizer's own code ran"
    assert SWITCH in result.output and "data.tokenizer" in result.output and "Traceback" not in result.output


def test_a_model_directory_with_auto_map_code_is_refused_naming_the_switch(tmp_path: Path, monkeypatch):
    marker = tmp_path / "ran"
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "marker", "auto_map": {
        "AutoConfig": "marker_cfg.MarkerConfig", "AutoModelForCausalLM": "marker_cfg.MarkerModel"}}))
    (model / "marker_cfg.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n")
    monkeypatch.setattr("builtins.input", lambda *a: "y")
    config = _write(tmp_path, {"model": {"name_or_path": str(model)}, "train": {"seq_len": 32, "global_batch_size": 8}})
    result = CliRunner().invoke(cli, ["plan", "--gpus", "2", str(config)])
    assert result.exit_code == 2, result.output
    assert not marker.exists(), "the model directory's code ran"
    assert SWITCH in result.output and "Traceback" not in result.output
