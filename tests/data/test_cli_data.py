"""``lmforge data demo / preprocess / inspect`` end to end (offline)."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
import yaml

from lmforge.cli import main
from lmforge.config import load_config
from lmforge.data import IndexedDataset, build_dataloader
from lmforge.data.demo import FILES, build_demo, kjv_chapters, kjv_path
from lmforge.errors import DataError
from lmforge.utils.tokenizer import load_tokenizer

from .paths import REPO_ROOT


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    assert main(["data", "demo", "--output", str(out)]) == 0
    return out


@pytest.mark.slow
def test_demo_build_is_complete_and_real_text(demo_dir):
    for name in FILES:
        assert (demo_dir / name).is_file()
    tokenizer = load_tokenizer(demo_dir)
    assert tokenizer.get_vocab_size() == 8192
    assert tokenizer.token_to_id("<|endoftext|>") == 0
    train = IndexedDataset(demo_dir / "train")
    valid = IndexedDataset(demo_dir / "valid")
    assert train.dtype == np.uint16
    assert train.num_documents + valid.num_documents == 1189  # one document per KJV chapter
    assert 900_000 < train.num_tokens < 1_100_000
    # Every document ends in EOD = 0, and EOD appears nowhere else.
    ends = np.cumsum(train.sequence_lengths.astype(np.int64)) - 1
    tokens = np.asarray(train.get(0, 0, train.num_tokens))
    assert (tokens[ends] == 0).all() and (tokens == 0).sum() == len(ends)
    first = tokenizer.decode(train[0][:-1].tolist())
    assert first == kjv_chapters(kjv_path())[0]
    assert first.startswith("Genesis 1\n1 In the beginning God created the heaven and the earth.")


@pytest.mark.slow
def test_demo_is_reproducible_and_skips_a_complete_build(demo_dir, tmp_path, capsys):
    stages: list[str] = []  # what `lmforge data demo` prints as it goes (on stderr)
    again = build_demo(str(tmp_path / "again"), progress=stages.append)
    assert again.built
    assert [s.split(" ")[0] for s in stages] == ["reading", "training", "tokenizing", "tokenizing", "writing"]
    for name in FILES:
        assert (tmp_path / "again" / name).read_bytes() == (demo_dir / name).read_bytes(), name
    capsys.readouterr()
    assert main(["data", "demo", "--output", str(demo_dir)]) == 0
    assert "already holds a complete demo build" in capsys.readouterr().out


def test_demo_config_trains_from_the_demo_data(demo_dir, tmp_path, monkeypatch):
    """configs/demo.yaml's train_dataset section reads the demo build (paths relative to the run dir)."""
    demo_yaml = REPO_ROOT / "configs" / "demo.yaml"
    if not demo_yaml.is_file():
        pytest.skip("configs/demo.yaml is not there yet")
    config = yaml.safe_load(demo_yaml.read_text())
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "demo").symlink_to(demo_dir, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    model = config["model"]
    section = load_config(str(demo_yaml)).train_dataset  # the typed section, as the trainer passes it
    loader = build_dataloader(
        section,
        local_batch_size=config["training"]["local_batch_size"],
        vocab_size=model["vocab_size"],
        seq_length=model["seq_length"],
        seed=config["training"]["seed"],
    )
    batch = next(loader)
    assert batch["input_ids"].shape == (config["training"]["local_batch_size"], model["seq_length"])
    valid = build_dataloader(section, local_batch_size=2, phase="valid", vocab_size=model["vocab_size"])
    assert valid is not None and len(valid) > 10


def test_preprocess_gzip_jsonl_and_inspect(demo_dir, tmp_path, capsys):
    texts = ["In the beginning was the Word.", "", "And the Word was with God.", "Jesus wept."]
    src = tmp_path / "docs.jsonl.gz"
    with gzip.open(src, "wt", encoding="utf-8") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"id": i, "content": t}) + "\n")
    argv = ["data", "preprocess", "--input", str(src), "--json-key", "content", "--tokenizer", str(demo_dir)]
    argv += ["--output-prefix", str(tmp_path / "out" / "small"), "--append-eod", "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "3 documents (1 empty skipped)" in out and "tokens/s" in out
    ds = IndexedDataset(tmp_path / "out" / "small_content_document")
    tokenizer = load_tokenizer(demo_dir / "tokenizer.json")
    expected = [t for t in texts if t]
    assert ds.num_documents == 3
    for i, text in enumerate(expected):
        assert ds[i].tolist() == tokenizer.encode(text, add_special_tokens=False).ids + [0]
    # Worker processes give the same bytes.
    argv_workers = argv[:-4] + [
        "--output-prefix",
        str(tmp_path / "out" / "par"),
        "--append-eod",
        "--workers",
        "2",
    ]
    assert main(argv_workers + ["--no-progress"]) == 0
    capsys.readouterr()
    assert (tmp_path / "out" / "par_content_document.bin").read_bytes() == (
        tmp_path / "out" / "small_content_document.bin"
    ).read_bytes()
    assert (
        main(
            [
                "data",
                "inspect",
                str(tmp_path / "out" / "small_content_document"),
                "--tokenizer",
                str(demo_dir),
            ]
        )
        == 0
    )
    report = capsys.readouterr().out
    assert "documents   3" in report and "dtype       uint16" in report
    assert "'In the beginning was the Word.<|endoftext|>'" in report


def test_preprocess_errors_are_user_errors(demo_dir, tmp_path, capsys):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"text": "ok"}\n{"body": "no text key"}\n')
    argv = [
        "data",
        "preprocess",
        "--input",
        str(src),
        "--tokenizer",
        str(demo_dir),
        "--output-prefix",
        str(tmp_path / "x"),
    ]
    assert main(argv + ["--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:2 has no key 'text'" in err and "Traceback" not in err
    assert not (tmp_path / "x_text_document.bin").exists()
    assert (
        main(
            [
                "data",
                "preprocess",
                "--input",
                str(src),
                "--tokenizer",
                str(tmp_path / "none"),
                "--output-prefix",
                "y",
            ]
        )
        == 2
    )
    assert "no tokenizer at" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ('["t1", "t2"]', "bad.jsonl:2 is a JSON array, not an object"),
        ('"t1 t2"', "bad.jsonl:2 is a JSON string, not an object"),
        ("null", "bad.jsonl:2 is a JSON null, not an object"),
        ("{}", "bad.jsonl:2 has no key 'text' (it has: no keys)"),
    ],
)
def test_a_line_that_is_not_an_object_with_the_key_is_named_for_what_it_is(tmp_path, line, needle):
    from lmforge.data.preprocess import read_documents

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "t0"}\n' + line + "\n")
    with pytest.raises(DataError) as err:
        list(read_documents(str(bad), "text"))
    assert needle in str(err.value)  # before, a list read "has no key 'text' (it has: list)"


def test_a_directory_as_input_is_named_a_directory(tmp_path):
    from lmforge.data.preprocess import read_documents

    with pytest.raises(DataError, match="a directory, not a file"):  # before: "no such file"
        list(read_documents(str(tmp_path), "text"))
