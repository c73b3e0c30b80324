"""A tokenizer without an end-of-document token: each command's error says how *its* user names one
(it used to say "name it with --eod-token" everywhere, a flag only `data preprocess` has)."""

from __future__ import annotations

import json

import pytest

from lmforge.errors import DataError
from lmforge.utils.tokenizer import find_eod_id, load_tokenizer


def _tokenizer_without_eod(directory):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "<unk>": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    return directory / "tokenizer.json"


def test_the_default_hint_names_the_file_that_sets_it_and_that_file_works(tmp_path):
    path = _tokenizer_without_eod(tmp_path / "tok")
    tok = load_tokenizer(path)
    with pytest.raises(DataError) as info:
        find_eod_id(tok, path)
    assert '"eos_token" in a tokenizer_config.json next to the tokenizer.json' in str(info.value)
    assert "--eod-token" not in str(info.value)
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "b"}))
    assert find_eod_id(tok, path) == 1  # the hint is what it says


def test_a_caller_names_its_own_option(tmp_path):
    path = _tokenizer_without_eod(tmp_path / "tok")
    with pytest.raises(DataError, match=r"; name it with --eod-token\.$"):
        find_eod_id(load_tokenizer(path), path, hint="name it with --eod-token")


def test_preprocess_keeps_its_flag_as_the_hint(tmp_path, capsys):
    from lmforge.cli import main

    path = _tokenizer_without_eod(tmp_path / "tok")
    (tmp_path / "in.jsonl").write_text('{"text": "a b"}\n')
    argv = ["data", "preprocess", "--input", str(tmp_path / "in.jsonl"), "--tokenizer", str(path)]
    assert main([*argv, "--output-prefix", str(tmp_path / "o"), "--append-eod", "--no-progress"]) == 2
    assert "name it with --eod-token" in capsys.readouterr().err
