"""``lmforge checkpoint inspect`` verifies every file of a checkpoint against its checksums.json (the load
path's own check) and names what is damaged or missing, recorded against found, with exit status 2."""

from __future__ import annotations

import hashlib
import io
import json

import pytest
import torch

from lmforge.cli import main
from lmforge.train.checkpoint import Checkpointable, CheckpointManager
from lmforge.train.checkpoint import inspect as inspect_mod
from lmforge.train.checkpoint.inspect import HashProgress, inspect_checkpoint
from lmforge.train.checkpoint.verify import (
    CHECKSUM_FILE,
    check_all,
    file_record,
    read_checksums,
    write_checksums,
)

from .tiny import TinyLM

ITER = "iteration_00000002"


@pytest.fixture
def ckpt(tmp_path):
    """A real checkpoint of a tiny model with its AdamW state, saved by the CheckpointManager."""
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randint(0, 32, (2, 8)), labels=torch.randint(0, 32, (2, 8))).loss.backward()
    opt.step()
    assert CheckpointManager(tmp_path / "ckpt").save(Checkpointable(model, opt), 2)
    return tmp_path / "ckpt"


def _inspect(capsys, *argv):
    capsys.readouterr()
    code = main(["checkpoint", "inspect", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def _shard(ckpt):
    return next((ckpt / ITER).glob("*.distcp"))


def _line(out, name):
    """The line of file ``name`` in the ``files:`` section."""
    files = out.split("\nfiles:\n", 1)[1].splitlines()
    return next(line for line in files if line.split()[0] == name)


def test_an_intact_checkpoint_is_verified_quietly(ckpt, capsys):
    code, out, err = _inspect(capsys, ckpt)
    recorded = json.loads((ckpt / ITER / CHECKSUM_FILE).read_text())["files"]
    assert code == 0 and f"verified: all {len(recorded)} files match {CHECKSUM_FILE}" in out
    assert all(_line(out, name).endswith("OK") for name in recorded)
    assert "global_step" in out and "optimizer" in out  # the description is still there
    assert err == ""  # a tiny checkpoint prints no progress


def test_one_flipped_byte_in_a_shard_is_named_with_both_digests(ckpt, capsys):
    shard = _shard(ckpt)
    data = bytearray(shard.read_bytes())
    recorded = hashlib.sha256(data).hexdigest()
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    code, out, err = _inspect(capsys, ckpt)
    assert code == 2 and "Traceback" not in err
    assert f"{shard.name} has other bytes than were written" in err and str(ckpt / ITER) in err
    found = hashlib.sha256(data).hexdigest()
    assert f"DAMAGED: sha256 {found} found, {recorded} recorded" in _line(out, shard.name)
    assert _line(out, ".metadata").endswith("OK") and _line(out, "common.json").endswith("OK")
    recorded_files = json.loads((ckpt / ITER / CHECKSUM_FILE).read_text())["files"]
    assert f"DAMAGED: 1 of {len(recorded_files)} files differ" in out


def test_damage_in_a_multi_block_shard_is_named_with_its_byte_range(ckpt, capsys):
    it = ckpt / ITER
    (it / CHECKSUM_FILE).unlink()
    write_checksums(it, {}, block_size=1024)  # as a save records a shard larger than a block
    shard = _shard(ckpt)
    recorded = json.loads((it / CHECKSUM_FILE).read_text())["files"][shard.name]
    n = len(recorded["blocks"])
    assert n > 2 and _inspect(capsys, ckpt)[0] == 0
    data = bytearray(shard.read_bytes())
    data[1024 + 5] ^= 0x01
    shard.write_bytes(bytes(data))
    code, out, err = _inspect(capsys, ckpt)
    where = f"bytes 1024-2047 (block 2 of {n})"
    assert code == 2 and f"{shard.name} has other bytes than were written in {where}" in err
    found = hashlib.sha256(data[1024:2048]).hexdigest()
    assert _line(out, shard.name).endswith(
        f"DAMAGED: {where}: sha256 {found} found, {recorded['blocks'][1]} recorded"
    )
    assert _line(out, ".metadata").endswith("OK")


def test_a_truncated_shard_is_named_with_both_sizes(ckpt, capsys):
    shard = _shard(ckpt)
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:100])
    code, out, err = _inspect(capsys, ckpt)
    assert code == 2 and f"{shard.name} has 100 bytes, {size} were written" in err
    assert f"DAMAGED: 100 bytes found, {size} recorded" in _line(out, shard.name)


def test_a_missing_shard_is_named(ckpt, capsys):
    shard = _shard(ckpt)
    size = shard.stat().st_size
    shard.unlink()
    code, out, err = _inspect(capsys, ckpt)
    assert code == 2 and f"{shard.name} is missing" in err
    assert f"MISSING ({size} bytes recorded)" in _line(out, shard.name)


def test_a_missing_record_is_damage_in_this_format(ckpt, capsys):
    (ckpt / ITER / CHECKSUM_FILE).unlink()
    code, _, err = _inspect(capsys, ckpt)
    assert code == 2 and f"{CHECKSUM_FILE} is missing" in err


def test_a_checkpoint_from_before_checksums_says_it_cannot_be_verified(ckpt, capsys):
    it = ckpt / ITER
    common = json.loads((it / "common.json").read_text())
    (it / "common.json").write_text(json.dumps({**common, "format": "lmforge-dcp/1"}))
    (it / CHECKSUM_FILE).unlink()
    code, out, _ = _inspect(capsys, ckpt)
    assert code == 0 and "none recorded (format lmforge-dcp/1" in out and "cannot be verified" in out


def test_no_verify_reads_no_shard(ckpt, capsys):
    shard = _shard(ckpt)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    code, out, _ = _inspect(capsys, ckpt, "--no-verify")
    assert code == 0 and "checksums: not verified (--no-verify)" in out


class FakeClock:
    """A clock that moves ``step`` seconds each time it is read (progress is throttled by it, no sleeping)."""

    def __init__(self, step: float = 1.0):
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def _done_bytes(line):
    """The bytes done of a progress line, in KiB (``... 3.0 KiB of 10.1 KiB (29%) ...``)."""
    amount = line.split(": ", 1)[1].split(" of ")[0]
    value, unit = amount.split()
    return float(value) * {"B": 1 / 1024, "KiB": 1, "MiB": 1024}[unit]


def test_a_large_checkpoint_ends_its_progress_with_a_line_of_everything_verified(ckpt, capsys, monkeypatch):
    monkeypatch.setattr(inspect_mod, "PROGRESS_BYTES", 0)  # every checkpoint counts as large
    code, _, err = _inspect(capsys, ckpt)
    n = len(json.loads((ckpt / ITER / CHECKSUM_FILE).read_text())["files"])
    lines = err.splitlines()
    assert code == 0 and lines[-1].startswith(f"verified {n} files: ") and "(100%) in " in lines[-1]
    assert all(line.startswith("verifying checksums: ") for line in lines[:-1])  # at most every 2 s


def test_progress_moves_within_one_multi_block_file(tmp_path):
    """A checkpoint of one large file reports the bytes hashed across its blocks, not files finished."""
    size = 10 * 1024 + 100
    (tmp_path / "big").write_bytes(bytes(range(256)) * (size // 256) + bytes(size % 256))
    files = {"big": file_record(tmp_path / "big", 1024)}
    assert len(files["big"]["blocks"]) == 11
    stream = io.StringIO()
    printer = HashProgress(stream, size, clock=FakeClock(), interval=2.0)
    (check,) = check_all(tmp_path, files, on_block=printer.block_checked, workers=2)
    printer.finish(1)
    lines = stream.getvalue().splitlines()
    *updates, last = lines
    assert check.ok and printer.done == size
    # The clock moves 1 s per block, so every other block prints; each line says more bytes than the one before.
    assert len(updates) == 5 and all(line.startswith("verifying checksums: ") for line in updates)
    done = [_done_bytes(line) for line in updates]
    assert done == sorted(done) and len(set(done)) == len(done) and done[-1] < size / 1024
    assert all(" MB/s, ETA " in line and " of 10.1 KiB (" in line for line in updates)
    assert last.startswith("verified 1 file: 10.1 KiB of 10.1 KiB (100%) in ") and last.endswith(" MB/s")


def test_a_large_checkpoint_prints_throttled_progress_through_inspect(ckpt, monkeypatch):
    it = ckpt / ITER
    (it / CHECKSUM_FILE).unlink()
    write_checksums(it, {}, block_size=1024)  # the shard in many blocks
    blocks = sum(len(r.get("blocks", [None])) for r in read_checksums(it).values())
    monkeypatch.setattr(inspect_mod, "PROGRESS_BYTES", 0)
    stream = io.StringIO()
    result = inspect_checkpoint(ckpt, progress=stream, clock=FakeClock(0.5))
    lines = stream.getvalue().splitlines()
    assert result.damage is None and lines[-1].startswith("verified ") and "(100%)" in lines[-1]
    # 0.5 s per block settled: one line per 4 blocks (2 s), never one per block.
    assert blocks // 4 - 1 <= len(lines) - 1 <= blocks // 4
    done = [_done_bytes(line) for line in lines]
    assert done == sorted(done)


def test_a_small_checkpoint_prints_no_progress(ckpt):
    stream = io.StringIO()
    assert inspect_checkpoint(ckpt, progress=stream, clock=FakeClock()).damage is None
    assert stream.getvalue() == ""


class _ClosedStream(io.StringIO):
    def write(self, text):
        raise BrokenPipeError(32, "Broken pipe")


def test_a_closed_progress_stream_does_not_pass_for_damage(ckpt, monkeypatch):
    monkeypatch.setattr(inspect_mod, "PROGRESS_BYTES", 0)
    result = inspect_checkpoint(ckpt, progress=_ClosedStream(), clock=FakeClock(10.0))
    assert result.damage is None and "checksums: verified: all " in result.text


@pytest.mark.parametrize(
    ("remaining", "eta"), [(30, "30 s"), (185, "3 min 05 s"), (3720, "1 h 02 min"), (0, "0 s")]
)
def test_the_eta_is_the_time_left_at_the_rate_so_far(remaining, eta):
    assert inspect_mod._eta(remaining * 1000, done=1000, elapsed=1.0) == eta
    assert inspect_mod._eta(100, done=0, elapsed=0.0) == "?"


def test_no_verify_on_a_truncated_shard_names_the_file_and_how_short_it_is(ckpt, capsys):
    shard = _shard(ckpt)
    shard.write_bytes(shard.read_bytes()[:64])  # the trainer state inspect reads is cut off too
    code, _, err = _inspect(capsys, ckpt, "--no-verify")
    # Before: "Cannot read checkpoint ...: EOFError: . A shard file is missing, truncated or corrupt".
    assert code == 2, err
    assert f"{shard.name}: 64 bytes, the index needs" in err and "A shard file is truncated" in err
    assert "EOFError: ." not in err
