"""The frozen base of a small LoRA checkpoint (train/checkpoint/lora.py) is recorded and checked with
checksums.json's records (verify.py): a large base file per block, checked on several threads, damage named
by file; records of whole files (every record before block records) still pass and fail as before; an
lmforge checkpoint's own verified records are taken instead of hashing the base again. Blocks are 1 KiB
here so that every test stays fast."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from lmforge.errors import CheckpointError
from lmforge.train.checkpoint import (
    Checkpointable,
    CheckpointManager,
    lora,
    resolve_checkpoint,
)
from lmforge.train.checkpoint.lora import base_record, check_base, fingerprint
from lmforge.train.checkpoint.verify import CHECKSUM_FILE, read_checksums

from .tiny import TinyLM

BLOCK = 1024
WEIGHTS = "model-00001-of-00001.safetensors"


def _hf_base(directory: Path) -> Path:
    """A directory with the files of a Hugging Face base (their bytes are what is checked, not parsed)."""
    directory.mkdir()
    data = torch.randint(
        0, 256, (5 * BLOCK + 17,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    (directory / WEIGHTS).write_bytes(data.numpy().tobytes())
    (directory / "config.json").write_text('{"model_type": "llama"}')
    return directory


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def _hf_record(base: Path, files: dict) -> dict:
    return {"kind": "hf", "path": str(base), "files": files}


def test_a_big_base_file_is_recorded_per_block_and_refused_when_one_block_changed(tmp_path):
    base = _hf_base(tmp_path / "base")
    record = _hf_record(base, fingerprint(base, "hf", block_size=BLOCK))
    assert len(record["files"][WEIGHTS]["blocks"]) == 6 and "sha256" in record["files"]["config.json"]
    json.dumps(record)  # it goes into common.json
    check_base(record, tmp_path / "lora")
    _flip(base / WEIGHTS, 3 * BLOCK + 5)  # block 4 of 6
    with pytest.raises(CheckpointError, match="weight files changed since") as err:
        check_base(record, tmp_path / "lora")
    assert f"added/removed: {WEIGHTS})" in str(err.value) and str(base) in str(err.value)


def test_a_whole_file_record_of_an_earlier_lmforge_still_passes_and_fails(tmp_path):
    base = _hf_base(tmp_path / "base")
    files = {
        p.name: {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
        for p in base.iterdir()
    }
    record = _hf_record(base, files)
    check_base(record, tmp_path / "lora")
    _flip(base / WEIGHTS, 2 * BLOCK)
    with pytest.raises(CheckpointError, match=f"added/removed: {WEIGHTS}\\)"):
        check_base(record, tmp_path / "lora")
    (base / WEIGHTS).write_bytes((base / WEIGHTS).read_bytes()[:-1])  # another size: refused unread
    with pytest.raises(CheckpointError, match=f"added/removed: {WEIGHTS}\\)"):
        check_base(record, tmp_path / "lora")


def test_files_added_to_or_removed_from_the_base_are_named(tmp_path):
    base = _hf_base(tmp_path / "base")
    record = _hf_record(base, fingerprint(base, "hf", block_size=BLOCK))
    (base / "config.json").unlink()
    (base / "extra.safetensors").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="added/removed: config.json, extra.safetensors\\)"):
        check_base(record, tmp_path / "lora")


@pytest.mark.parametrize(
    ("entry", "why"),
    [
        ({"size": 3, "sha256": "0" * 63}, "not 64 hex digits"),
        ({"size": 3 * BLOCK, "block_size": BLOCK, "blocks": ["0" * 64] * 2}, "2 block digests"),
        ({"size": -1, "sha256": "0" * 64}, "not a non-negative integer"),
    ],
)
def test_a_malformed_file_record_is_refused_as_corrupt(tmp_path, entry, why):
    base = _hf_base(tmp_path / "base")
    record = _hf_record(base, {**fingerprint(base, "hf"), WEIGHTS: entry})
    with pytest.raises(CheckpointError, match="is not a record lmforge writes") as err:
        check_base(record, tmp_path / "lora")
    assert why in str(err.value) and f"the entry of {WEIGHTS!r}" in str(err.value)


def _save(path: Path, seed: int) -> None:
    torch.manual_seed(seed)
    manager = CheckpointManager(path, no_save_optim=True, save_max=0)
    assert manager.save(Checkpointable(model=TinyLM()), step=0)
    manager.close()


def test_an_lmforge_base_takes_its_own_verified_records_without_hashing(tmp_path, monkeypatch):
    _save(tmp_path / "base", 3)
    header = resolve_checkpoint(tmp_path / "base")

    def no_hashing(*_, **__):
        raise AssertionError("the base was hashed again")

    monkeypatch.setattr(lora, "record_files", no_hashing)
    record = base_record(header, seed=0)
    checksums = read_checksums(header.path)
    names = sorted(p.name for p in header.path.iterdir() if p.suffix == ".distcp" or p.name == ".metadata")
    assert record["kind"] == "dcp" and sorted(record["files"]) == names
    assert all(record["files"][name] == checksums[name] for name in names)
    monkeypatch.undo()
    check_base(record, tmp_path / "lora")
    _save(tmp_path / "base", 5)  # re-saved with other weights (and a new checksums.json)
    with pytest.raises(CheckpointError, match="weight files changed since"):
        check_base(record, tmp_path / "lora")


def test_an_lmforge_base_without_checksums_is_hashed(tmp_path):
    _save(tmp_path / "base", 3)
    header = resolve_checkpoint(tmp_path / "base")
    (header.path / CHECKSUM_FILE).unlink()  # as in a checkpoint of lmforge-dcp/1
    record = base_record(header, seed=0)
    shard = next(header.path.glob("*.distcp"))
    assert record["files"][shard.name] == {
        "size": shard.stat().st_size,
        "sha256": hashlib.sha256(shard.read_bytes()).hexdigest(),
    }
    check_base(record, tmp_path / "lora")


def test_an_lmforge_base_being_loaded_is_hashed_once_by_the_load_not_twice(tmp_path, monkeypatch):
    _save(tmp_path / "base", 3)
    record = base_record(resolve_checkpoint(tmp_path / "base"), seed=0)
    hashed: list[str] = []
    real_check_blocks = lora.check_blocks

    def counting(directory, files, blocks, **kwargs):
        hashed.append(str(directory))
        return real_check_blocks(directory, files, blocks, **kwargs)

    monkeypatch.setattr(lora, "check_blocks", counting)
    check_base(record, tmp_path / "lora", verified_by_load=True)  # the record is the base's own: no read
    assert hashed == []
    check_base(record, tmp_path / "lora")  # no load follows: the base is read here
    assert hashed == [record["path"]]
    # Bytes damaged under an unchanged record: the load that follows refuses them.
    shard = next(Path(record["path"]).glob("*.distcp"))
    _flip(shard, shard.stat().st_size // 2)
    with pytest.raises(CheckpointError, match="damaged"):
        lora.restore_base(record, TinyLM(), tmp_path / "lora", hf_loader=None)
    # A base re-saved since (a new record) is checked here and refused as another base.
    _save(tmp_path / "base", 5)
    with pytest.raises(CheckpointError, match="weight files changed since"):
        lora.restore_base(record, TinyLM(), tmp_path / "lora", hf_loader=None)
