"""The typed TextDataLoader section (data/text_schema.py): every key checked at load, by its dotted
path, with nothing read from disk; what needs the model or the files is left for later."""

from __future__ import annotations

import pytest

from lmforge.config import validate_section
from lmforge.data.schema import TextLoader
from lmforge.errors import ConfigError

KEY = "train_dataset.dataloader"


def _typed(**loader) -> TextLoader:
    section = {
        "dataloader": {"type": "TextDataLoader", "data_path": ["missing.jsonl"], "tokenizer": "t", **loader}
    }
    return validate_section("train_dataset", section).dataloader.typed


def test_written_keys_become_typed_attributes_with_defaults() -> None:
    typed = _typed(
        data_path=["0.25", "a.jsonl", "0.75", "b.parquet"],
        tokenizer={"tokenizer_file": "tok/tokenizer.json"},  # MindSpore Transformers' mapping form
        chat_template="chatml",
        valid_data_path="v.jsonl",
    )
    assert isinstance(typed, TextLoader)  # built although no file exists: nothing is read at load
    assert typed.data_path.prefixes == ["a.jsonl", "b.parquet"] and typed.data_path.weights == [0.25, 0.75]
    assert typed.tokenizer == "tok/tokenizer.json" and typed.valid_data_path == ["v.jsonl"]
    assert typed.chat_template == "chatml" and "<|im_start|>" in typed.template
    assert (typed.pack, typed.text_key, typed.eod_pad_length, typed.shuffle, typed.shuffle_buffer) == (
        "concat",
        "text",
        128,
        False,
        10_000,
    )
    assert typed.seq_length is None and typed.eod is None and typed.pad is None


def test_every_bad_value_is_named_by_its_dotted_key_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        _typed(
            text_key="", eod_mask_loss="yes", eod=-1, validation_split=2, eod_pad_length=0, seq_length=True
        )
    text = str(info.value)
    for key, why in [
        ("text_key", "must be a non-empty string"),
        ("eod_mask_loss", "must be true or false; got 'yes'"),
        ("eod", "must be a token id (an integer >= 0); got -1"),
        ("validation_split", "must be a fraction between 0 and 1"),
        ("eod_pad_length", "must be a positive integer; got 0"),
        ("seq_length", "must be a positive integer (the model's seq_length); got True"),
    ]:
        assert f"{KEY}.{key} {why}" in text, (key, text)


def test_unknown_keys_are_named_with_the_closest_valid_key() -> None:
    with pytest.raises(ConfigError, match=rf"{KEY}\.shufle_buffer is not a TextDataLoader setting") as info:
        _typed(shufle_buffer=4)
    assert "did you mean shuffle_buffer for shufle_buffer?" in str(info.value)
    assert "Valid keys: chat_template, column_names, data_path," in str(info.value)


@pytest.mark.parametrize(
    ("loader", "match"),
    [
        ({"data_path": None}, rf"{KEY}\.data_path is required"),
        ({"tokenizer": None}, rf"{KEY}\.tokenizer is required"),
        ({"tokenizer": {"vocab": 3}}, rf"{KEY}\.tokenizer is required"),
        ({"valid_data_path": ["v"], "validation_split": 0.1}, "are both set"),
        ({"pack": "zip"}, rf"{KEY}\.pack must be 'concat'"),
        ({"shuffle_buffer": 0}, rf"{KEY}\.shuffle_buffer must be a positive number"),
        (
            {"chat_template": "{{ ''.__class__.__mro__[1].__subclasses__() }}"},
            rf"{KEY}\.chat_template: .*sandbox refuses",
        ),
    ],
)
def test_refused_sections(loader, match) -> None:
    with pytest.raises(ConfigError, match=match):
        _typed(**loader)


def test_seq_length_is_checked_against_the_model_not_at_load() -> None:
    typed = _typed(seq_length=64)
    typed.check_against_model(64, None)
    with pytest.raises(ConfigError, match=rf"{KEY}\.seq_length \(64\) must equal model\.seq_length \(32\)"):
        typed.check_against_model(32, None)
    assert _typed().sequence_length(32) == 32  # unset: the model's
    with pytest.raises(ConfigError, match=rf"{KEY}\.seq_length must be a positive integer"):
        _typed().sequence_length(None)


def test_missing_sources_are_named_by_the_key_the_file_wrote(tmp_path) -> None:
    from lmforge.data.files import missing_data_files

    (tmp_path / "here.jsonl").write_text("{}\n")
    (tmp_path / "tok.json").write_text("{}")  # present: a missing tokenizer is a message of its own
    here, absent = str(tmp_path / "here.jsonl"), str(tmp_path / "absent.jsonl")
    t = str(tmp_path / "tok.json")
    text = {"type": "TextDataLoader", "data_path": [here, absent], "tokenizer": t}
    hf_files = {"type": "HFDataLoader", "path": "json", "data_files": [here, absent], "tokenizer": t}
    hf_glob = {"type": "HFDataLoader", "path": str(tmp_path / "*.jsonl"), "tokenizer": t}
    for loader, key in [(text, "data_path"), (hf_files, "data_files")]:
        section = validate_section("train_dataset", {"dataloader": loader})
        assert missing_data_files(section) == [
            f"{KEY}.{key}: {absent!r} not found (neither the path nor {absent}.bin/.idx exists)"
        ]
    assert (
        validate_section("train_dataset", {"dataloader": hf_glob}).dataloader.typed.sources_key
        == f"{KEY}.path"
    )
