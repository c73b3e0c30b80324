"""Data is never silently rewritten: values that are not text are refused with the file and line, in
``data preprocess`` and in the TextDataLoader (its worker processes included); hostile tokenizer files
are clear errors; an interrupted preprocess leaves the previous dataset and no temporaries."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from data.test_text_loader import _batches, _section
from data.text_helpers import text_rows, write_jsonl, write_tokenizer
from lmforge.data.indexed import IndexedDataset, IndexedDatasetWriter
from lmforge.errors import DataError

REPO = Path(__file__).resolve().parents[3]

# (the JSON of the "text" field, what the message says)
HOSTILE_TEXT = {
    "null": ("null", "'text' is null"),
    "number": ("12", "'text' is a number"),
    "object": ('{"a": "w1"}', "'text' is an object"),
    "list holding null": ('["w1 ", null]', "'text' is a list holding null"),
    "list holding a list": ('["w1", ["w2"]]', "'text' is a list holding a list"),
    "lone surrogate": ('"w1 \\ud800 w2"', "'text' holds an invalid Unicode code point (U+D800"),
    "lone low surrogate": ('"\\udc00"', "(U+DC00"),
}


def _input_with(tmp_path: Path, bad_json: str) -> Path:
    good = [json.dumps({"text": "w1 w2 w3"}), json.dumps({"text": ["w4 ", "w5"]})]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join([*good, '{"text": ' + bad_json + "}", good[0]]) + "\n")
    return path


@pytest.mark.parametrize("name", list(HOSTILE_TEXT))
def test_preprocess_refuses_a_value_that_is_not_text_with_file_and_line(tmp_path, cli, name):
    bad, message = HOSTILE_TEXT[name]
    src = _input_with(tmp_path, bad)
    tok = write_tokenizer(tmp_path / "tok")
    out = tmp_path / "out" / "corpus"
    code, _, err = cli(
        "data", "preprocess", "--input", src, "--tokenizer", tok, "--output-prefix", out, "--no-progress"
    )
    assert code == 2 and "Traceback" not in err
    assert f"{src}:3: " in err and message in err
    assert (
        not list((tmp_path / "out").glob("*")) if (tmp_path / "out").exists() else True
    )  # nothing published


def test_preprocess_still_joins_a_list_of_strings(tmp_path, cli):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"text": ["w1 ", "w2"]}) + "\n" + json.dumps({"text": "w3 \u00e9"}) + "\n")
    tok = write_tokenizer(tmp_path / "tok")
    code, _, err = cli(
        "data",
        "preprocess",
        "--input",
        src,
        "--tokenizer",
        tok,
        "--output-prefix",
        tmp_path / "c",
        "--no-progress",
    )
    assert code == 0, err
    ds = IndexedDataset(tmp_path / "c_text_document")
    assert len(ds) == 2 and len(ds[0]) == 2


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2], ids=["in-process", "worker-processes"])
@pytest.mark.parametrize("name", ["null", "object", "lone surrogate"])
def test_the_text_loader_refuses_a_value_that_is_not_text_with_file_and_line(tmp_path, name, workers):
    bad, message = HOSTILE_TEXT[name]
    rows = [json.dumps(r) for r in text_rows(6)]
    rows[4] = '{"text": ' + bad + "}"
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(rows) + "\n")
    tok = write_tokenizer(tmp_path / "tok")
    with pytest.raises(DataError) as info:
        _batches(_section(str(path), tok, workers=workers), 4)
    assert f"{path}:5: " in str(info.value) and message in str(info.value)


@pytest.mark.parametrize(
    "row, message",
    [
        ({"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "w1"}]}, "'messages[0].content' is null"),
        ({"messages": [{"role": "user", "content": "w1"}, {"role": "assistant", "content": ["w2"]}]}, "'messages[1].content' is a list"),
        ({"prompt": "w1", "response": None}, "'response' is null"),
        ({"instruction": {"x": 1}, "output": "w1"}, "'instruction' is an object"),
    ],
)  # fmt: skip
def test_chat_and_prompt_fields_must_be_strings(tmp_path, row, message):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": "w1", "response": "w2"}, row])
    tok = write_tokenizer(tmp_path / "tok")
    with pytest.raises(DataError) as info:
        _batches(_section(path, tok), 2)
    assert f"{path}:2: " in str(info.value) and message in str(info.value)


HOSTILE_CONFIGS = {
    "not JSON": (b"{chat_template: ", "is not valid JSON"),
    "a list": (b"[1, 2]", "holds list, not a JSON object"),
    "not UTF-8": (b'{"eos_token": "\xff\xfe"}', "is not UTF-8 text"),
    "deep nesting": (b"[" * 100_000 + b"]" * 100_000, "cannot be read"),
    "eos is a number": (b'{"eos_token": 5}', "eos_token must be a string"),
    "template is a number": (b'{"chat_template": 5}', "chat_template must be a string"),
    "template syntax": (b'{"chat_template": "{% for %}"}', "not a valid Jinja template"),
    "template escapes the sandbox": (
        b'{"chat_template": "{{ messages.__class__.__mro__[1].__subclasses__() }}"}',
        "sandbox refuses",
    ),
}


@pytest.mark.parametrize("name", list(HOSTILE_CONFIGS))
def test_a_hostile_tokenizer_config_is_a_clear_error(tmp_path, name):
    content, message = HOSTILE_CONFIGS[name]
    tok = write_tokenizer(tmp_path / "tok")
    (tmp_path / "tok" / "tokenizer_config.json").write_bytes(content)
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2"}]}] * 4)  # fmt: skip
    with pytest.raises(DataError, match="tokenizer_config.json|chat template") as info:
        _batches(_section(path, tok), 2)
    assert message in str(info.value)


def test_preprocess_append_eod_reads_a_hostile_tokenizer_config_clearly(tmp_path, cli):
    tok = write_tokenizer(tmp_path / "tok")
    (tmp_path / "tok" / "tokenizer_config.json").write_text("[]")
    src = write_jsonl(tmp_path / "in.jsonl", text_rows(3))
    code, _, err = cli(
        "data", "preprocess", "--input", src, "--tokenizer", tok, "--output-prefix", tmp_path / "c", "--append-eod",
        "--no-progress",
    )  # fmt: skip
    assert code == 2 and "tokenizer_config.json cannot be read" in err and "Traceback" not in err


# -- interrupted preprocess --------------------------------------------------------------------


def _write_pair(prefix: Path, docs: list[list[int]]) -> None:
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for d in docs:
            writer.add_document(d)


@pytest.mark.slow
def test_sigterm_during_preprocess_leaves_the_previous_dataset_and_no_temporaries(tmp_path):
    tok = write_tokenizer(tmp_path / "tok")
    prefix = tmp_path / "c_text_document"
    _write_pair(prefix, [[5, 6, 7]])
    before = {p.name: p.read_bytes() for p in tmp_path.glob("c_text_document.*")}
    # A large input, read slowly enough that the signal arrives while the .bin is being written.
    src = tmp_path / "in.jsonl"
    with open(src, "w") as f:
        for row in text_rows(400_000):
            f.write(json.dumps(row) + "\n")
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmforge", "data", "preprocess", "--input", str(src), "--tokenizer", tok,
         "--output-prefix", str(tmp_path / "c"), "--no-progress"],
        env=env, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob("c_text_document.bin.tmp-*")) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert list(tmp_path.glob("c_text_document.bin.tmp-*")), "the writer never started"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "stopped by signal 15; nothing was published" in err
    assert not list(tmp_path.glob("*.tmp-*"))
    assert {p.name: p.read_bytes() for p in tmp_path.glob("c_text_document.*")} == before


# The second worker of the pool is still starting (an at-fork hook: OpenTelemetry's, loaded by mlflow or
# wandb, restarts its threads there; here a sleep) when the first one has done all the work and
# pool.terminate() sends it SIGTERM. It must end; a worker that had inherited the stop handler raised
# PreprocessInterrupted inside the hook (which swallows it), then waited for work forever, and so did
# terminate(): a hang that showed when the test files ran in another order.
_SLOW_SECOND_WORKER = """
import json, os, sys, time
from lmforge.data.preprocess import preprocess
forks = [0]
def count():
    forks[0] += 1
os.register_at_fork(before=count, after_in_child=lambda: time.sleep(60) if forks[0] == 2 else None)
root = sys.argv[1]
with open(os.path.join(root, "in.jsonl"), "w") as f:
    f.write("".join(json.dumps({"text": t}) + "\\n" for t in ["w1 w2", "w3", "w4 w5 w6"]))
s = preprocess(os.path.join(root, "in.jsonl"), sys.argv[2], os.path.join(root, "out"), workers=2)
print(s.documents)
"""


@pytest.mark.slow
def test_preprocess_ends_a_worker_that_is_still_starting(tmp_path):
    tok = write_tokenizer(tmp_path / "tok")
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_SECOND_WORKER, str(tmp_path), tok],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        # The run takes a second or two; a worker that ignored terminate()'s SIGTERM never ends (its
        # hook's 60 s are only there so that it does not start work), so this is the hang's bound.
        out, err = proc.communicate(timeout=50)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the process group: a stuck worker too
    assert proc.returncode == 0 and out.split() == ["3"], err[-3000:]
    assert "PreprocessInterrupted" not in err


def test_temporaries_of_a_killed_writer_are_removed_by_the_next_one(tmp_path):
    prefix = tmp_path / "c"
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    pid = int(dead.stdout)  # a process that has exited
    for suffix in (".bin", ".idx"):
        (tmp_path / f"c{suffix}.tmp-{pid}").write_bytes(b"partial")
    (tmp_path / f"c.bin.tmp-{os.getpid()}-other").write_bytes(b"not ours")  # not a writer's name: kept
    _write_pair(prefix, [[1, 2]])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["c.bin", "c.idx", f"c.bin.tmp-{os.getpid()}-other"]
    )


@pytest.mark.parametrize("crash_after", ["idx aside", "bin aside", "new bin", "new idx"])
def test_a_crash_at_any_step_of_a_publish_leaves_one_complete_pair(tmp_path, monkeypatch, crash_after):
    from lmforge.data import indexed_publish

    prefix = tmp_path / "c"
    _write_pair(prefix, [[1, 2, 3]])
    old = {s: (tmp_path / f"c{s}").read_bytes() for s in (".bin", ".idx")}
    steps = ["idx aside", "bin aside", "new bin", "new idx"]
    real, calls = os.replace, []

    def replace(src, dst):
        real(src, dst)
        calls.append(src)
        if steps[len(calls) - 1] == crash_after:
            raise KeyboardInterrupt  # stands for a kill right after this rename

    monkeypatch.setattr(indexed_publish.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        _write_pair(prefix, [[4, 5], [6]])
    monkeypatch.undo()
    for leftover in tmp_path.glob("c.*.tmp-*"):
        leftover.unlink()  # the crashed process's own temporaries (removed by the next writer if it died)
    indexed_publish.recover_publish(str(tmp_path / "c.bin"), str(tmp_path / "c.idx"))
    ds = IndexedDataset(prefix)
    if crash_after == "new idx":  # committed: the new pair
        assert [list(ds[i]) for i in range(len(ds))] == [[4, 5], [6]]
    else:
        assert {s: (tmp_path / f"c{s}").read_bytes() for s in (".bin", ".idx")} == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.bin", "c.idx"]


def test_the_text_loader_names_the_line_of_an_invalid_utf8_byte(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"text": "w1 w2"}\n{"text": "w3 \xff w4"}\n{"text": "w5"}\n')
    tok = write_tokenizer(tmp_path / "tok")
    with pytest.raises(DataError, match=rf"{path}:2 is not valid UTF-8"):
        _batches(_section(str(path), tok), 2)


@pytest.mark.parametrize(
    "content, skipped",
    [("", 0), ('{"text": ""}\n{"text": ""}\n', 2)],
    ids=["zero-length", "only-empty-texts"],
)
def test_preprocess_refuses_an_input_without_documents(tmp_path, cli, content, skipped):
    # Before: exit 0, "wrote ...: 0 documents", and an empty .bin/.idx that training refused later.
    src = tmp_path / "in.jsonl"
    src.write_text(content)
    tok = write_tokenizer(tmp_path / "tok")
    out = tmp_path / "out" / "corpus"
    code, _, err = cli(
        "data", "preprocess", "--input", src, "--tokenizer", tok, "--output-prefix", out, "--no-progress"
    )
    assert code == 2 and "Traceback" not in err, err
    assert f"--input {src} holds no document to write ({skipped} empty 'text' text(s) skipped" in err, err
    assert (
        not list((tmp_path / "out").glob("*")) if (tmp_path / "out").exists() else True
    )  # nothing published


def test_inspect_with_a_tokenizer_the_data_was_not_made_with(tmp_path, cli):
    # Before: the sample decoded to a few '<unk>'s (ids the tokenizer lacks are dropped), exit 0.
    from tokenizers import Tokenizer, models, pre_tokenizers

    with IndexedDatasetWriter(tmp_path / "docs", np.uint16) as writer:
        writer.add_document([5, 63, 7, 0])
    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "<unk>": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "small.json"))
    code, _, err = cli("data", "inspect", tmp_path / "docs", "--tokenizer", tmp_path / "small.json")
    assert code == 2 and "Traceback" not in err, err
    assert f"holds token id 63, but --tokenizer {tmp_path / 'small.json'} has 3 ids (0 .. 2)" in err, err
    code, out, err = cli("data", "inspect", tmp_path / "docs")  # the statistics alone still work
    assert code == 0 and "max token   63" in out, err
