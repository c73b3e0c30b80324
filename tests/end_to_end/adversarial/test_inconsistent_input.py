"""Class 3: indexes, checkpoints and configs are checked for consistency before use."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import yaml

from lmforge.data import IndexedDatasetWriter
from lmforge.data.indexed import HEADER_SIZE

from .conftest import rerecord_checksums, snapshot

ITER = "iteration_00000002"


# -- Megatron indexes ----------------------------------------------------------------------------


def _dataset(prefix, docs=5):
    with IndexedDatasetWriter(prefix, np.int32) as w:
        for i in range(docs):
            w.add_document([1 + i, 2 + i, 3 + i, 0])
    return prefix


def _patch_idx(prefix, section, index, value):
    """Overwrite one entry of the .idx arrays: lengths (int32), pointers (int64) or doc index (int64)."""
    path = f"{prefix}.idx"
    with open(path, "rb") as f:
        data = bytearray(f.read())
    count = int(np.frombuffer(bytes(data[18:26]), "<u8")[0])
    offsets = {
        "lengths": (HEADER_SIZE, "<i4"),
        "pointers": (HEADER_SIZE + 4 * count, "<i8"),
        "docs": (HEADER_SIZE + 12 * count, "<i8"),
    }
    start, dtype = offsets[section]
    item = np.dtype(dtype).itemsize
    data[start + item * index : start + item * (index + 1)] = np.array([value], dtype).tobytes()
    with open(path, "wb") as f:
        f.write(bytes(data))


@pytest.mark.parametrize(
    ("section", "index", "value", "needle"),
    [
        ("pointers", 2, 10_000, "outside the"),
        ("pointers", 2, -16, "outside the"),
        ("pointers", 1, 6, "outside the"),  # not a multiple of the 4-byte token size
        ("lengths", 3, -2, "claims -2 tokens"),
        ("lengths", 0, 1_000_000, "outside the"),
        ("docs", 2, 0, "decreases at document"),
    ],
    ids=[
        "pointer-past-end",
        "negative-pointer",
        "misaligned-pointer",
        "negative-length",
        "long-length",
        "doc-index",
    ],
)
def test_lying_index_is_refused(cli, tmp_path, section, index, value, needle):
    prefix = _dataset(tmp_path / "d")
    _patch_idx(prefix, section, index, value)
    before = snapshot(tmp_path)
    code, _, err = cli("data", "inspect", prefix)
    assert code == 2 and needle in err and "Rebuild" in err and "Traceback" not in err
    assert snapshot(tmp_path) == before


def test_training_on_a_lying_index_is_refused(run_copy, cli):
    prefix = run_copy / "data" / "docs"
    _patch_idx(prefix, "pointers", 5, 10**9)
    code, _, err = cli("train", "--config", run_copy / "train.yaml", "--set", "training.steps=1")
    assert code == 2 and "outside the" in err and "docs.idx" in err


def test_negative_token_ids_are_refused(run_copy, cli):
    prefix = run_copy / "data" / "neg"
    _dataset(prefix, docs=100)
    raw = np.fromfile(f"{prefix}.bin", np.int32)
    raw[3] = -7
    raw.tofile(f"{prefix}.bin")
    code, _, err = cli(
        "train",
        "--config",
        run_copy / "train.yaml",
        "--set",
        "training.steps=1",
        "--set",
        f"train_dataset.dataloader.config.data_path=['{prefix}']",
    )
    assert code == 2 and "negative token id -7" in err


# -- checkpoints ----------------------------------------------------------------------------------


def _resume(cli, run, *sets):
    args = ["train", "--config", run / "train.yaml", "--set", f"checkpoint.load_path={run / 'ckpt'}"]
    for s in sets:
        args += ["--set", s]
    return cli(*args)


@pytest.mark.parametrize(
    ("layers", "needle"), [(1, "parameter(s) the model does not have"), (3, "are missing from it")]
)
def test_checkpoint_into_a_model_with_other_layers_is_refused(run_copy, cli, layers, needle):
    before = snapshot(run_copy / "ckpt")
    code, _, err = _resume(cli, run_copy, f"model.num_hidden_layers={layers}", "training.steps=3")
    assert code == 2 and needle in err and "checkpoint.partial_load" in err
    assert snapshot(run_copy / "ckpt") == before


def test_partial_load_needs_no_load_optim(run_copy, cli):
    code, _, err = _resume(cli, run_copy, "model.num_hidden_layers=1", "checkpoint.partial_load=true")
    assert code == 2 and "no_load_optim: true" in err


def test_partial_load_lists_what_it_skips(run_copy, cli, tmp_path):
    code, _, err = _resume(
        cli,
        run_copy,
        "model.num_hidden_layers=1",
        "checkpoint.partial_load=true",
        "checkpoint.no_load_optim=true",
        "training.steps=1",
        f"checkpoint.save_path={tmp_path / 'new'}",
    )
    assert code == 0, err
    log = (run_copy / "run" / "train.log").read_text()
    assert "checkpoint.partial_load: loading" in log and "decoder.layers.1." in log


def _damage(run, what):
    it = run / "ckpt" / ITER
    shard = next(it.glob("*.distcp"))
    if what == "common-garbage":
        (it / "common.json").write_text("{not json")
    elif what == "common-not-object":
        (it / "common.json").write_text("[1, 2]")
    elif what == "common-bad-step":
        common = json.loads((it / "common.json").read_text())
        (it / "common.json").write_text(json.dumps({**common, "global_step": "two"}))
    elif what == "tracker-garbage":
        (run / "ckpt" / "latest_checkpointed_iteration.txt").write_bytes(b"\xff\xfe two")
    elif what == "tracker-missing-iteration":
        (run / "ckpt" / "latest_checkpointed_iteration.txt").write_text("7\n")
    elif what == "shard-missing":
        shard.unlink()
    elif what == "shard-truncated":
        shard.write_bytes(shard.read_bytes()[:100])
    elif what == "metadata-empty":
        (it / ".metadata").write_bytes(b"")
    elif what == "metadata-garbage":
        (it / ".metadata").write_bytes(b"\x80\x04garbage")


DAMAGE = {
    "common-garbage": "is not the JSON object",
    "common-not-object": "is not the JSON object",
    "common-bad-step": "global_step must be a non-negative integer",
    "tracker-garbage": "should hold one iteration number",
    "tracker-missing-iteration": "names iteration 7",
    "shard-missing": "Cannot read checkpoint",
    "shard-truncated": "Cannot read checkpoint",
    "metadata-empty": "Cannot read the DCP metadata",
    "metadata-garbage": "Cannot read the DCP metadata",
}


# What the checksum record says first about damaged files (train/checkpoint/verify.py).
FILE_DAMAGE = {
    "shard-missing": "distcp is missing",
    "shard-truncated": " were written",
    "metadata-empty": ".metadata has 0 bytes",
    "metadata-garbage": ".metadata has",
}


@pytest.mark.parametrize("rerecorded", [False, True], ids=["as-damaged", "checksums-rerecorded"])
@pytest.mark.parametrize("what", list(DAMAGE))
def test_damaged_checkpoint_is_a_clear_error(run_copy, cli, what, rerecorded):
    _damage(run_copy, what)
    if rerecorded:  # the record rewritten to match: the readers behind it must still refuse clearly
        rerecord_checksums(run_copy / "ckpt" / ITER)
    before = snapshot(run_copy / "ckpt")
    code, _, err = _resume(cli, run_copy, "training.steps=3")
    needle = DAMAGE[what] if rerecorded else FILE_DAMAGE.get(what, DAMAGE[what])
    assert code == 2 and needle in err and "Traceback" not in err, err
    assert snapshot(run_copy / "ckpt") == before


@pytest.mark.parametrize("what", ["common-garbage", "shard-truncated", "metadata-garbage"])
def test_damaged_checkpoint_in_inspect_and_generate(run_copy, cli, what):
    _damage(run_copy, what)
    code, _, err = cli(
        "generate", "--checkpoint", run_copy / "ckpt", "--prompt", "t1", "--max-new-tokens", "1"
    )
    assert code == 2 and FILE_DAMAGE.get(what, DAMAGE[what]) in err
    code, _, err = cli("checkpoint", "inspect", run_copy / "ckpt")  # verifies the checksums first
    assert code == 2 and FILE_DAMAGE.get(what, DAMAGE[what]) in err
    if what != "shard-truncated":  # without them it reads metadata and small items only
        code, _, err = cli("checkpoint", "inspect", "--no-verify", run_copy / "ckpt")
        assert code == 2 and DAMAGE[what] in err


# -- configs: `check` refuses what `train` refuses --------------------------------------------------


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("train_dataset.dataloader.config.eod=64", "eod"),
        ("train_dataset.dataloader.config.seq_length=8", "must equal model.seq_length"),
        ("train_dataset.dataloader.config.split='-90,10,0'", "non-negative numbers"),
        ("train_dataset.dataloader.config.data_path=['nan', 'a', '1', 'b']", "must be > 0 and finite"),
        ("train_dataset.dataloader.config.data_path=['inf', 'a', '1', 'b']", "must be > 0 and finite"),
    ],
    ids=["eod-outside-vocab", "seq-length-mismatch", "negative-split", "nan-blend", "inf-blend"],
)
def test_check_refuses_what_train_refuses(run_copy, cli, override, needle):
    code, out, err = cli("check", "--config", run_copy / "train.yaml", "--set", override)
    assert code == 2 and needle in err, out + err
    code, _, err = cli("train", "--config", run_copy / "train.yaml", "--set", override)
    assert code == 2 and needle in err


@pytest.mark.parametrize(
    "command",
    [
        ["train", "--config", "{cfg}", "--device", "gpu"],
        ["generate", "--checkpoint", "{ckpt}", "--prompt", "t1", "--device", "cdua"],
        ["eval", "--checkpoint", "{ckpt}", "--config", "{cfg}", "--device", "tpu"],
    ],
    ids=["train", "generate", "eval"],
)
def test_unknown_device_is_refused(run_copy, cli, command):
    fill = {"cfg": run_copy / "train.yaml", "ckpt": run_copy / "ckpt"}
    before = snapshot(run_copy)
    code, _, err = cli(*[a.format(**fill) for a in command])
    assert code == 2 and "is not a device lmforge runs on" in err
    assert snapshot(run_copy) == before


def test_yaml_keys_unchanged_by_a_refused_check(run_copy, cli):
    text = (run_copy / "train.yaml").read_text()
    cli("check", "--config", run_copy / "train.yaml", "--set", "train_dataset.dataloader.config.eod=64")
    assert (run_copy / "train.yaml").read_text() == text and yaml.safe_load(text)
    shutil.rmtree(run_copy / "run")
