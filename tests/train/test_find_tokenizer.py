"""``find_tokenizer`` asks the typed dataloader where the run's tokenizer.json is, for both loader kinds."""

from __future__ import annotations

from typing import Any

from lmforge.config import load_config
from lmforge.train.builder import find_tokenizer


def test_megatron_data_finds_the_tokenizer_beside_its_weighted_prefixes(
    base_config: dict[str, Any], tmp_path
):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "tokenizer.json").write_text("{}")
    config = base_config["train_dataset"]["dataloader"]["config"]
    config.pop("data_path", None)
    config.pop("split", None)
    # A weight/prefix blend: the weight '1' is not a directory to look in, the prefix's folder is.
    config["train_data_path"] = ["1", str(tmp_path / "data" / "a_text_document")]
    assert find_tokenizer(load_config(base_config)) == tmp_path / "data" / "tokenizer.json"
    base_config["train_dataset"]["dataloader"]["tokenizer"] = {"vocab_file": str(tmp_path / "other.json")}
    (tmp_path / "other.json").write_text("{}")
    assert find_tokenizer(load_config(base_config)) == tmp_path / "other.json"  # named first, found first


def test_text_data_finds_the_tokenizer_its_section_names(base_config: dict[str, Any], tmp_path):
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    base_config["train_dataset"]["dataloader"] = {
        "type": "TextDataLoader",
        "data_path": [str(tmp_path / "a.jsonl")],
        "tokenizer": {"tokenizer_file": str(tmp_path / "tok")},  # a directory holding one
    }
    assert find_tokenizer(load_config(base_config)) == tmp_path / "tok" / "tokenizer.json"
    base_config["train_dataset"]["dataloader"]["tokenizer"] = str(tmp_path / "nowhere")
    assert find_tokenizer(load_config(base_config)) is None
