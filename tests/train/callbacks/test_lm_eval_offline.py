"""Offline ``eval --tasks``: a registry task's YAML is found without the harness's index, and only
``datasets``' own "not there" refuses (train/callbacks/lm_eval_offline.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmforge.train.callbacks.lm_eval_offline import _cached, _task_config, is_missing_download

pytest.importorskip("lm_eval")


def _tree(root: Path) -> Path:
    (root / "a").mkdir(parents=True)
    (root / "b").mkdir()
    (root / "a" / "_template_yaml").write_text("dataset_path: org/shared\noutput_type: multiple_choice\n")
    (root / "a" / "first.yaml").write_text("include: _template_yaml\ntask: 'dup'\ndataset_name: one\n")
    (root / "b" / "second.yaml").write_text("task: dup\ndataset_path: org/other\n")
    (root / "b" / "group.yaml").write_text("group: grp\ntask: [dup]\n")
    (root / "b" / "python.yaml").write_text("task: pyt\nclass: !function tasks.Custom\n")
    (root / "b" / "broken.yaml").write_text("task: broken\n  : [\n")
    return root


@pytest.mark.slow  # the first import of lm_eval
def test_the_task_yaml_is_the_one_the_harness_would_index(tmp_path):
    root = _tree(tmp_path / "tasks")
    config = _task_config("dup", root)  # a duplicate name: the first file in path order, as the harness
    assert config is not None and config["dataset_path"] == "org/shared" and config["dataset_name"] == "one"
    # A group, a Python task, an unparsable file and an unknown name are left to the harness.
    assert [_task_config(name, root) for name in ("grp", "pyt", "broken", "nowhere")] == [None] * 4


@pytest.mark.slow  # a text search of the harness's ~14,000 task files
def test_a_shipped_task_is_found_with_its_dataset():
    import lm_eval.tasks

    root = Path(lm_eval.tasks.__file__).parent
    yaml_text = (root / "arc" / "arc_easy.yaml").read_text()
    config = _task_config("arc_easy", root)
    assert config is not None and f"dataset_path: {config['dataset_path']}" in yaml_text
    assert f"dataset_name: {config['dataset_name']}" in yaml_text


def test_a_local_dataset_is_cached_and_a_refused_download_is_recognised(tmp_path):
    data = tmp_path / "items.jsonl"
    data.write_text(json.dumps({"q": "a", "a": 1}) + "\n")
    config = {"dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}}}
    assert _cached(config) is True
    assert _cached({**config, "dataset_kwargs": ["not", "a", "mapping"]}) is None
    try:
        raise RuntimeError("loading failed") from ConnectionError("Couldn't reach 'org/x' on the Hub")
    except RuntimeError as exc:
        assert is_missing_download(exc)
    assert not is_missing_download(ValueError("split 'test' not found"))
