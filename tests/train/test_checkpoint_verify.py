"""checksums.json with block digests (train/checkpoint/verify.py): a file larger than a block is recorded
per block and its blocks are hashed on several threads; damage is named with its byte range, a file of
another size is caught without reading it, malformed records are refused, and whole-file records (format
lmforge-dcp/2) verify as before. Blocks are a few KiB here so that every test stays fast."""

from __future__ import annotations

import errno
import hashlib
import json
import shutil
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lmforge.errors import CheckpointError
from lmforge.train.checkpoint import (
    Checkpointable,
    CheckpointManager,
    load_checkpoint,
    resolve_checkpoint,
    verify,
)
from lmforge.train.checkpoint.verify import (
    CHECKSUM_FILE,
    all_blocks,
    check_all,
    check_file,
    file_record,
    read_checksums,
    record_files,
    share_of,
    verify_checkpoint,
    verify_threads,
    write_checksums,
)

BLOCK = 1024
DCP2 = Path(__file__).resolve().parents[1] / "fixtures" / "dcp2_checkpoint"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _write(path: Path, size: int, seed: int = 0) -> bytes:
    data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    path.write_bytes(data.numpy().tobytes())
    return path.read_bytes()


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def _recorded(directory: Path, block_size: int = BLOCK) -> dict:
    """``directory``'s files recorded as a save records them, with blocks of ``block_size``."""
    write_checksums(directory, {}, block_size)
    files = read_checksums(directory)
    assert files is not None
    return files


@pytest.mark.parametrize("size", [0, 1, BLOCK])
def test_a_file_of_at_most_one_block_keeps_the_whole_file_record(tmp_path, size):
    data = _write(tmp_path / "f", size)
    assert file_record(tmp_path / "f", BLOCK) == {"size": size, "sha256": _sha(data)}


@pytest.mark.parametrize("size", [BLOCK + 1, 3 * BLOCK, 5 * BLOCK - 7])
def test_a_larger_file_is_recorded_per_block(tmp_path, size):
    data = _write(tmp_path / "f", size)
    blocks = [_sha(data[i : i + BLOCK]) for i in range(0, size, BLOCK)]
    assert file_record(tmp_path / "f", BLOCK) == {"size": size, "block_size": BLOCK, "blocks": blocks}


@pytest.mark.parametrize("workers", [1, 3])
def test_a_multi_block_file_verifies(tmp_path, workers):
    _write(tmp_path / "big", 5 * BLOCK - 7)
    _write(tmp_path / "small", 100, seed=1)
    files = _recorded(tmp_path)
    assert len(files["big"]["blocks"]) == 5 and "sha256" in files["small"]
    assert check_file(tmp_path, "big", files["big"], workers=workers).ok
    assert [c.name for c in check_all(tmp_path, files, workers=workers) if c.ok] == ["big", "small"]
    verify_checkpoint(tmp_path, required=True)


def test_record_files_records_several_files_as_file_record_does(tmp_path):
    _write(tmp_path / "big", 3 * BLOCK + 5)
    _write(tmp_path / "small", 10, seed=1)
    paths = [tmp_path / "big", tmp_path / "small"]
    assert record_files(paths, BLOCK, workers=2) == {p.name: file_record(p, BLOCK) for p in paths}
    assert record_files([], BLOCK) == {}


def test_every_block_is_reported_once_as_it_is_settled(tmp_path):
    """``on_block`` (inspect's progress) sees each block once: hashed (from several threads), or at once
    when its file has another size and is not read."""
    _write(tmp_path / "big", 5 * BLOCK - 7)
    _write(tmp_path / "short", 3 * BLOCK, seed=1)
    files = _recorded(tmp_path)
    (tmp_path / "short").write_bytes(b"cut")
    seen, lock = [], threading.Lock()

    def on_block(block):
        with lock:
            seen.append((block.name, block.index))

    checks = check_all(tmp_path, files, on_block=on_block, workers=3)
    assert [c.ok for c in checks] == [True, False]
    assert sorted(seen) == [("big", i) for i in range(5)] + [("short", i) for i in range(3)]


def test_the_blocks_of_one_file_are_hashed_at_the_same_time(tmp_path, monkeypatch):
    _write(tmp_path / "big", 4 * BLOCK)
    files = _recorded(tmp_path)
    together = threading.Barrier(2, timeout=10)  # broken (an error) unless two blocks are hashed at once
    hash_block = verify._sha256_of

    def meet_then_hash(path, block):
        if block.index < 2:
            together.wait()
        return hash_block(path, block)

    monkeypatch.setattr(verify, "_sha256_of", meet_then_hash)
    assert check_file(tmp_path, "big", files["big"], workers=2).ok


def test_a_flipped_byte_in_one_block_is_named_with_its_byte_range(tmp_path):
    data = _write(tmp_path / "big", 5 * BLOCK - 7)
    files = _recorded(tmp_path)
    _flip(tmp_path / "big", 2 * BLOCK + 10)
    found = bytearray(data)
    found[2 * BLOCK + 10] ^= 0x01
    check = check_file(tmp_path, "big", files["big"], workers=2)
    assert not check.ok and [m.index for m in check.mismatches] == [2]
    problem = (
        f"big has other bytes than were written in bytes {2 * BLOCK}-{3 * BLOCK - 1} (block 3 of 5) (sha256 "
        f"differs: {_sha(data[2 * BLOCK : 3 * BLOCK])} recorded, {_sha(bytes(found[2 * BLOCK : 3 * BLOCK]))} found)"
    )
    assert check.problem == problem
    with pytest.raises(CheckpointError) as err:
        verify_checkpoint(tmp_path, required=True)
    assert f"Checkpoint {tmp_path} is damaged: {problem}. It was not loaded." in str(err.value)


def test_damage_in_several_blocks_counts_them_and_names_the_first(tmp_path):
    _write(tmp_path / "big", 5 * BLOCK)
    files = _recorded(tmp_path)
    _flip(tmp_path / "big", 4 * BLOCK + 1)
    _flip(tmp_path / "big", BLOCK)
    problem = check_file(tmp_path, "big", files["big"]).problem
    assert problem is not None
    assert f"in 2 of its 5 blocks, the first in bytes {BLOCK}-{2 * BLOCK - 1} (block 2 of 5)" in problem


@pytest.mark.parametrize("change", [-1, +1], ids=["truncated", "extended"])
def test_a_file_of_another_size_is_damaged_without_hashing(tmp_path, monkeypatch, change):
    data = _write(tmp_path / "big", 4 * BLOCK)
    files = _recorded(tmp_path)
    (tmp_path / "big").write_bytes(data[:-1] if change < 0 else data + b"\0")

    def no_hashing(*_):
        raise AssertionError("a file of another size was read")

    monkeypatch.setattr(verify, "_sha256_of", no_hashing)
    check = check_all(tmp_path, files)[0]
    assert check.problem == f"big has {4 * BLOCK + change} bytes, {4 * BLOCK} were written"
    (tmp_path / "big").unlink()
    assert check_all(tmp_path, files)[0].problem == "big is missing"


def test_a_read_error_is_damage_named_with_its_block_not_a_traceback(tmp_path, monkeypatch):
    _write(tmp_path / "big", 4 * BLOCK)
    _recorded(tmp_path)
    hash_block = verify._sha256_of

    def bad_sector(path, block):
        if block.index == 1:
            raise OSError(errno.EIO, "Input/output error")
        return hash_block(path, block)

    monkeypatch.setattr(verify, "_sha256_of", bad_sector)
    with pytest.raises(CheckpointError) as err:
        verify_checkpoint(tmp_path, required=True)
    assert (
        f"big could not be read (bytes {BLOCK}-{2 * BLOCK - 1} (block 2 of 4): OSError: [Errno 5] Input/output "
        "error). It was not loaded." in str(err.value)
    )


def test_a_whole_file_record_of_a_large_file_still_verifies(tmp_path, monkeypatch):
    """A file recorded by one digest (lmforge-dcp/2) is checked by it, whatever the block size now is."""
    data = _write(tmp_path / "big", 5 * BLOCK)
    files = _recorded(tmp_path, block_size=10 * BLOCK)
    assert files["big"] == {"size": 5 * BLOCK, "sha256": _sha(data)}
    monkeypatch.setattr(verify, "BLOCK_SIZE", BLOCK)
    verify_checkpoint(tmp_path, required=True)
    _flip(tmp_path / "big", 3 * BLOCK)
    found = bytearray(data)
    found[3 * BLOCK] ^= 0x01
    with pytest.raises(CheckpointError) as err:
        verify_checkpoint(tmp_path, required=True)
    assert (
        f"big has other bytes than were written (sha256 differs: {_sha(data)} recorded, {_sha(bytes(found))} found)"
        in str(err.value)
    )


def test_a_checkpoint_of_format_2_loads_and_its_damage_is_named_as_before(tmp_path):
    ckpt = tmp_path / "iteration_00000001"
    shutil.copytree(DCP2 / "iteration_00000001", ckpt)
    assert json.loads((ckpt / "common.json").read_text())["format"] == "lmforge-dcp/2"
    model = torch.nn.Linear(4, 3)
    load_checkpoint(resolve_checkpoint(ckpt), Checkpointable(model), no_load_optim=True)
    weights = json.loads((DCP2 / "weights.json").read_text())
    assert all(torch.equal(p, torch.tensor(weights[name])) for name, p in model.state_dict().items())
    shard = next(ckpt.glob("*.distcp"))
    recorded = _sha(shard.read_bytes())
    _flip(shard, 100)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(resolve_checkpoint(ckpt), Checkpointable(model), no_load_optim=True)
    assert f"{shard.name} has other bytes than were written (sha256 differs: {recorded} recorded, " in str(
        err.value
    )


_DIGEST = "0" * 64


@pytest.mark.parametrize(
    ("entry", "why"),
    [
        (
            {"size": 3 * BLOCK, "block_size": BLOCK, "blocks": [_DIGEST] * 2},
            "has 2 block digests for 3072 bytes",
        ),
        (
            {"size": 3 * BLOCK, "block_size": BLOCK, "blocks": [_DIGEST, _DIGEST, "0" * 63]},
            "not a list of digests",
        ),
        ({"size": 3 * BLOCK, "block_size": 0, "blocks": []}, "has block_size 0, not a positive integer"),
        ({"size": 3 * BLOCK, "block_size": True, "blocks": [_DIGEST] * 3072}, "has block_size True"),
        ({"size": 2.0, "sha256": _DIGEST}, "has size 2.0, not a non-negative integer"),
        ({"size": BLOCK, "block_size": BLOCK, "blocks": [_DIGEST]}, "not more than one block of 1024"),
        (
            {"size": 3 * BLOCK, "block_size": BLOCK, "blocks": [_DIGEST] * 3, "sha256": _DIGEST},
            "has the keys",
        ),
        ({"size": 3 * BLOCK, "sha256": "A" * 64}, "not 64 hex digits"),
        ({"size": 3 * BLOCK}, "has the keys ['size']"),
    ],
    ids=["count", "digest", "block-size", "bool", "float-size", "one-block", "both", "upper", "no-digest"],
)
def test_a_malformed_record_is_refused_naming_the_file_and_entry(tmp_path, entry, why):
    _write(tmp_path / "big", 3 * BLOCK)
    record = {"algorithm": "sha256", "files": {"big": entry}}
    (tmp_path / CHECKSUM_FILE).write_text(json.dumps(record))
    with pytest.raises(CheckpointError) as err:
        read_checksums(tmp_path)
    message = str(err.value)
    assert message.startswith(f"{tmp_path / CHECKSUM_FILE} is not the checksum record lmforge writes: ")
    assert "the entry of 'big' " in message and why in message and '"block_size": B' in message
    with pytest.raises(CheckpointError) as err:
        verify_checkpoint(tmp_path, required=True)
    assert f"is damaged: {message[:-1]}. It was not loaded." in str(err.value)  # one full stop, not two


def test_the_ranks_split_the_blocks_between_them_by_bytes(tmp_path):
    _write(tmp_path / "a", 7 * BLOCK + 1)
    _write(tmp_path / "b", 3 * BLOCK)
    _write(tmp_path / "c", 10)
    blocks = all_blocks(_recorded(tmp_path))
    for world in (1, 2, 3, 16):
        shares = [share_of(blocks, rank, world) for rank in range(world)]
        assert sorted((b.name, b.index) for s in shares for b in s) == [(b.name, b.index) for b in blocks]
        loads = [sum(b.length for b in s) for s in shares]
        assert max(loads) - min(loads) <= BLOCK  # no rank has more than one block more than another
        assert all(s == sorted(s, key=lambda b: (b.name, b.index)) for s in shares)


@pytest.mark.parametrize(
    ("cpus", "local", "threads"), [(2, None, 2), (64, None, 8), (64, "4", 8), (16, "8", 2), (2, "8", 1)]
)
def test_verify_threads_share_the_cpus_between_the_local_ranks(monkeypatch, cpus, local, threads):
    monkeypatch.setattr(verify.os, "sched_getaffinity", lambda _: set(range(cpus)), raising=False)
    if local is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    assert verify_threads() == threads


def test_a_saved_checkpoint_records_its_large_files_per_block_and_loads(tmp_path, monkeypatch):
    monkeypatch.setattr(verify, "BLOCK_SIZE", 4 * BLOCK)
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 64)
    manager = CheckpointManager(tmp_path / "ckpt")
    assert manager.save(Checkpointable(model, torch.optim.SGD(model.parameters(), lr=0.1)), 1)
    manager.close()
    it = tmp_path / "ckpt" / "iteration_00000001"
    shard = next(it.glob("*.distcp"))
    files = read_checksums(it)
    assert (
        files is not None
        and files[shard.name]["block_size"] == 4 * BLOCK
        and len(files[shard.name]["blocks"]) > 1
    )
    assert json.loads((it / "common.json").read_text())["format"] == "lmforge-dcp/3"
    twin = torch.nn.Linear(32, 64)
    load_checkpoint(resolve_checkpoint(it), Checkpointable(twin), no_load_optim=True)
    assert torch.equal(twin.weight, model.weight)
    _flip(shard, 5 * BLOCK)
    with pytest.raises(
        CheckpointError, match=rf"{shard.name} has other bytes than were written in bytes 4096-8191"
    ):
        load_checkpoint(resolve_checkpoint(it), Checkpointable(twin), no_load_optim=True)


def _verify_on_rank(rank: int, store: str, directory: str, results) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    try:
        verify_checkpoint(Path(directory), required=True)
        results[rank] = None
    except CheckpointError as exc:
        results[rank] = str(exc)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_check_half_the_blocks_each_and_raise_the_same_error(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    _write(ckpt / "big", 6 * BLOCK)
    _recorded(ckpt)
    _flip(ckpt / "big", 0)  # block 1: one rank finds it, both report it
    _flip(ckpt / "big", 5 * BLOCK)  # block 6: split the other way
    results = mp.Manager().dict()
    mp.spawn(_verify_on_rank, args=(str(tmp_path / "store"), str(ckpt), results), nprocs=2, join=True)
    assert results[0] == results[1] and results[0] is not None
    assert (
        "big has other bytes than were written in 2 of its 6 blocks, the first in bytes 0-1023" in results[0]
    )
