"""The `data.datasets` list in model.yaml: its entries' keys, what each entry reads over the data section
(its own record format, columns, system prompt), and every mistake one error with its YAML path:
`datasets` beside `train_files` or `dataset`, a weight and a count on one entry, weights on some
entries only."""

from __future__ import annotations

import pytest
import yaml

from orchestrate.config.load import config_from_dict
from orchestrate.errors import UserError
from orchestrate.launch.rundir import resolved_config_dict
from tests.helpers.plans import TINY_GPT2


def _config(tmp_path, data: dict):
    return config_from_dict({"model": {"architecture": TINY_GPT2}, "train": {"seq_len": 32, "global_batch_size": 2},
                             "data": data}, tmp_path)


def _refused(tmp_path, data: dict):
    with pytest.raises(UserError) as err:
        _config(tmp_path, data)
    (problem,) = err.value.problems
    return problem


@pytest.mark.parametrize(("data", "where", "words"), [
    ({"train_files": ["a.jsonl"], "datasets": [{"path": "b.jsonl"}]}, "data", "`datasets` or `train_files`"),
    ({"dataset": "org/name", "datasets": [{"path": "b.jsonl"}]}, "data", "`datasets` or `dataset`"),
    ({"datasets": [{"path": "a.jsonl", "weight": 1.0, "samples": 10}]}, "data.datasets.0", "not both"),
    ({"datasets": [{"path": "a.jsonl", "weight": 2.0}, {"path": "b.jsonl"}]}, "data",
     "datasets[1] has no weight while datasets[0] has one"),
    ({"datasets": [{"path": "a.jsonl", "weight": 0}]}, "data.datasets.0.weight", "greater than 0"),
    ({"datasets": [{"path": "a.jsonl", "samples": 0}]}, "data.datasets.0.samples", "greater than or equal to 1"),
    ({"datasets": [{"path": "a.jsonl", "type": "alpaca"}]}, "data.datasets.0.type", ""),  # Axolotl's key: no such key
])
def test_each_mistake_in_the_list_is_one_problem_at_its_path(tmp_path, data, where, words):
    problem = _refused(tmp_path, data)
    assert problem.where == where and words in problem.message


def test_weights_with_exact_counts_beside_them_are_one_mix(tmp_path):
    config = _config(tmp_path, {"datasets": [{"path": "a.jsonl", "weight": 2.0}, {"path": "b.jsonl", "samples": 5},
                                             {"path": "c.jsonl", "weight": 1.0}]})
    assert [e.weight for e in config.data.datasets] == [2.0, None, 1.0]


def test_an_entry_reads_its_records_with_its_own_settings_over_the_sections(tmp_path):
    data = _config(tmp_path, {"columns": {"messages": "dialog", "role": "speaker"}, "system_prompt": "be brief",
                              "datasets": [{"path": "a.jsonl"},
                                           {"path": "b.jsonl", "record_format": "alpaca", "system_prompt": "",
                                            "columns": {"role": "from", "content": "value"}}]}).data
    assert data.for_source(None) is data and data.for_source(0).columns == data.columns
    own = data.for_source(1)
    assert own.record_format == "alpaca" and own.system_prompt is None  # "": no system prompt for this source
    assert (own.columns.messages, own.columns.role, own.columns.content) == ("dialog", "from", "value")
    assert data.for_source(0).system_prompt == "be brief" and data.record_format == "auto"


def test_the_runs_config_makes_local_paths_absolute_and_keeps_dataset_names(tmp_path):
    (tmp_path / "chat.jsonl").write_text("{}\n")
    config = _config(tmp_path, {"datasets": [{"path": "chat.jsonl"}, {"path": "shards/*.parquet"},
                                             {"path": "tatsu-lab/alpaca", "name": "default"}]})
    paths = [e["path"] for e in resolved_config_dict(config)["data"]["datasets"]]
    assert paths == [str((tmp_path / "chat.jsonl").resolve()), str((tmp_path / "shards/*.parquet").resolve()),
                     "tatsu-lab/alpaca"]
    assert yaml.safe_load(yaml.safe_dump(resolved_config_dict(config)))["data"]["datasets"][2]["name"] == "default"
