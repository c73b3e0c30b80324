"""``lmforge checkpoint inspect``: what a checkpoint directory holds, and whether its files are intact,
without building a model.

Verification is the load path's own (``verify.py``: the record, the per-file check and the damage error
are the ones ``load_checkpoint`` uses), done on every file in this one process. It is on by default:
inspect is what a user asks before trusting a checkpoint with a long job, and the cost is one read of the
checkpoint (about 1 GiB/s per core; the blocks of all files are hashed on up to 8 threads).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lmforge.errors import CheckpointError
from lmforge.train.checkpoint import (
    COMMON_FILE,
    CONFIG_FILE,
    TRACKER_FILE,
    CheckpointHeader,
    _allocate_encoded,
    _quiet_single_process,
    _read_metadata,
    decode_state,
    read_tracker,
    resolve_checkpoint,
)
from lmforge.train.checkpoint.files import LEGACY_FORMAT
from lmforge.train.checkpoint.safe_load import load_dcp
from lmforge.train.checkpoint.verify import (
    ALGORITHM,
    CHECKSUM_FILE,
    Block,
    FileCheck,
    check_all,
    damaged_error,
    read_record,
)

# Checkpoints at least this large get progress lines on the progress stream while they are hashed.
PROGRESS_BYTES = 512 << 20
# Seconds between two progress lines: often enough to see a one-file checkpoint of 84 GB move (10 s to a
# few minutes of hashing, by threads and disk), rarely enough that a log of it stays short.
PROGRESS_INTERVAL = 2.0


@dataclass(frozen=True)
class Inspection:
    """What ``checkpoint inspect`` prints (``text``) and, when a file is damaged or missing, the error it
    then exits with (``damage``: the load path's own message, naming every damaged file)."""

    text: str
    damage: CheckpointError | None = None


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def _read_small(path: Path, metadata: Any, prefix: str) -> Any:
    sd = {prefix: _allocate_encoded(metadata, prefix)}
    with _quiet_single_process():
        load_dcp(sd, path, no_dist=True)
    return decode_state(sd[prefix])


def inspect_checkpoint(
    path: str | os.PathLike,
    *,
    list_tensors: bool = False,
    verify: bool = True,
    progress: TextIO | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Inspection:
    """Describe the checkpoint at ``path`` and (``verify``) check every file against its ``checksums.json``
    first; ``progress`` gets the bytes hashed so far every ``PROGRESS_INTERVAL`` seconds of ``clock`` and a
    final line while a large checkpoint is hashed. A damaged checkpoint is described by its files only (its
    metadata cannot be trusted), with the error in ``damage``."""
    header = resolve_checkpoint(path, "DIR")
    if header is None:
        raise CheckpointError(f"{path}: no checkpoint here (the directory is missing or empty).")
    if header.kind == "hf":
        return Inspection(_describe_hf(header))
    if not verify:
        return Inspection(_describe(header, list_tensors, {}, "checksums: not verified (--no-verify)"))
    verified = _verify(header, progress, clock)
    if verified.problems:
        lines = [f"checkpoint: {header.path}", verified.note, *_file_lines(header.path, verified.statuses)]
        return Inspection("\n".join(lines), damaged_error(header.path, verified.problems))
    return Inspection(_describe(header, list_tensors, verified.statuses, verified.note))


@dataclass(frozen=True)
class _Verified:
    note: str  # the ``checksums:`` line
    statuses: dict[str, str] = field(default_factory=dict)  # file name -> OK / DAMAGED ... / MISSING ...
    problems: list[str] = field(default_factory=list)  # the load error's words, one per damaged file


def _verify(header: CheckpointHeader, progress: TextIO | None, clock: Callable[[], float]) -> _Verified:
    """Every file of ``header`` against its record, by ``verify.py``'s rule (the one a load applies)."""
    required = header.common.get("format") != LEGACY_FORMAT
    files, record_problem = read_record(header.path, required=required)
    if record_problem is not None:
        return _Verified(f"checksums: NOT VERIFIED: {record_problem}", problems=[record_problem])
    if files is None:
        return _Verified(
            f"checksums: none recorded (format {LEGACY_FORMAT}, written before lmforge recorded them): the "
            "files cannot be verified"
        )
    total = sum(d["size"] for d in files.values())
    printer = (
        HashProgress(progress, total, clock) if progress is not None and total >= PROGRESS_BYTES else None
    )
    checks = check_all(header.path, files, on_block=printer.block_checked if printer else None)
    if printer is not None:
        printer.finish(len(checks))
    statuses = {c.name: _status(c) for c in checks}
    statuses[CHECKSUM_FILE] = "the record"
    for p in header.path.iterdir():
        if p.is_file() and p.name not in statuses:
            statuses[p.name] = f"not in {CHECKSUM_FILE}: not verified"
    problems = [c.problem for c in checks if c.problem is not None]
    if problems:
        note = f"checksums: DAMAGED: {len(problems)} of {len(checks)} files differ from {CHECKSUM_FILE}"
        return _Verified(note, statuses, problems)
    return _Verified(
        f"checksums: verified: all {len(checks)} files match {CHECKSUM_FILE} ({ALGORITHM}, {_bytes(total)})",
        statuses,
    )


def _status(check: FileCheck) -> str:
    """A file's verification, expected against found."""
    if check.ok:
        return "OK"
    if check.size is None:
        return f"MISSING ({check.recorded_size} bytes recorded)"
    if check.size != check.recorded_size:
        return f"DAMAGED: {check.size} bytes found, {check.recorded_size} recorded"
    if check.unreadable is not None:
        return f"UNREADABLE: {check.unreadable}"
    first = check.mismatches[0]
    digests = f"{ALGORITHM} {first.found} found, {first.recorded} recorded"
    if first.count == 1:  # a whole-file record
        return f"DAMAGED: {digests}"
    more = len(check.mismatches) - 1
    return f"DAMAGED: {first.where}: {digests}" + (f" (and {more} more blocks)" if more else "")


class HashProgress:
    """How much of a checkpoint has been checked, on ``stream``: the bytes of the settled blocks
    (``check_blocks``' ``on_block``), so that a checkpoint of one large file moves too. A line at most
    every ``interval`` seconds of ``clock`` (``verifying checksums: 4.1 GiB of 84.0 GiB (4%), 1100 MB/s,
    ETA 1 min 12 s``) and a final one (``finish``). A plain line rather than a bar: stderr of inspect is
    often a log file or a pipe, where a redrawn bar is noise."""

    def __init__(
        self,
        stream: TextIO,
        total: int,
        clock: Callable[[], float] = time.monotonic,
        interval: float = PROGRESS_INTERVAL,
    ) -> None:
        self._stream: TextIO | None = stream
        self._total = total
        self._clock = clock
        self._interval = interval
        self._lock = threading.Lock()  # blocks are settled on the verify pool's threads
        self._started = self._last = clock()
        self.done = 0

    def block_checked(self, block: Block) -> None:
        with self._lock:
            self.done += block.length
            now = self._clock()
            if now - self._last < self._interval:
                return
            self._last = now
            elapsed = now - self._started
            self._write(
                f"verifying checksums: {self._amount()}, {_rate(self.done, elapsed)}, "
                f"ETA {_eta(self._total - self.done, self.done, elapsed)}"
            )

    def finish(self, files: int) -> None:
        """The last line: what was checked, how long it took."""
        with self._lock:
            elapsed = self._clock() - self._started
            self._write(
                f"verified {files} file{'s' if files != 1 else ''}: {self._amount()} in {elapsed:.1f} s, "
                f"{_rate(self.done, elapsed)}"
            )

    def _amount(self) -> str:
        percent = 100 * self.done // self._total if self._total else 100  # 100% only when all is done
        return f"{_bytes(self.done)} of {_bytes(self._total)} ({percent}%)"

    def _write(self, line: str) -> None:
        if self._stream is None:
            return
        try:
            self._stream.write(line + "\n")
            self._stream.flush()
        except (OSError, ValueError):  # stderr closed (a pipe whose reader left): the check goes on
            self._stream = None


def _rate(done: int, elapsed: float) -> str:
    return f"{done / elapsed / 1e6:.0f} MB/s" if elapsed > 0 else "- MB/s"


def _eta(remaining: int, done: int, elapsed: float) -> str:
    """The time left at the rate so far, as ``42 s``, ``3 min 05 s`` or ``1 h 02 min``."""
    if done <= 0 or elapsed <= 0:
        return "?"
    seconds = round(remaining * elapsed / done)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def _file_lines(directory: Path, statuses: dict[str, str]) -> list[str]:
    """The ``files:`` section: every file on disk with its size, and each one's verification (a missing
    recorded file is listed too)."""
    lines = ["files:"]
    on_disk = {f.name: f for f in directory.iterdir()}
    for name in sorted(set(on_disk) | set(statuses)):
        size = _bytes(on_disk[name].stat().st_size) if name in on_disk else "-"
        status = statuses.get(name, "")
        lines.append(f"  {name:<40} {size:>12}" + (f"  {status}" if status else ""))
    return lines


def _describe_hf(header: CheckpointHeader) -> str:
    lines = [f"checkpoint: {header.path}"]
    lines.append("kind: Hugging Face model directory (load it with checkpoint.no_load_optim: true)")
    lines.append("checksums: a Hugging Face directory records none: the files cannot be verified")
    for f in sorted(header.path.iterdir()):
        lines.append(f"  {f.name:<40} {_bytes(f.stat().st_size):>12}")
    return "\n".join(lines)


def _describe(header: CheckpointHeader, list_tensors: bool, statuses: dict[str, str], note: str) -> str:
    lines = [f"checkpoint: {header.path}"]
    root = header.path.parent
    if (root / TRACKER_FILE).is_file():
        its = sorted(p.name for p in root.glob("iteration_*") if p.is_dir())
        lines.append(f"save_path: {root} (latest: {read_tracker(root)}; on disk: {', '.join(its)})")
    common = (
        json.loads((header.path / COMMON_FILE).read_text()) if (header.path / COMMON_FILE).is_file() else {}
    )
    lines.append("common.json:")
    for k in sorted(common):
        lines.append(f"  {k:<18} {common[k]}")
    lines += _contents(header.path, list_tensors)
    lines.append(note)
    lines += _file_lines(header.path, statuses)
    if (header.path / CONFIG_FILE).is_file():
        lines.append(f"config: {header.path / CONFIG_FILE} (used by lmforge generate)")
    return "\n".join(lines)


def _contents(path: Path, list_tensors: bool) -> list[str]:
    """Each group of the DCP state (tensor counts, elements, bytes, dtypes), the trainer counters and the
    scheduler state, and with ``list_tensors`` every model tensor."""
    metadata = _read_metadata(path)
    groups: dict[str, list[tuple[str, Any]]] = defaultdict(list)
    for key, meta in metadata.state_dict_metadata.items():
        groups[key.split(".", 1)[0]].append((key, meta))
    lines = ["contents:"]
    for group in sorted(groups):
        items = groups[group]
        tensors = [(k, m) for k, m in items if isinstance(m, TensorStorageMetadata)]
        numel = sum(int(torch.Size(m.size).numel()) for _, m in tensors)
        nbytes = sum(int(torch.Size(m.size).numel()) * m.properties.dtype.itemsize for _, m in tensors)
        dtypes = sorted({str(m.properties.dtype).replace("torch.", "") for _, m in tensors})
        lines.append(
            f"  {group:<11} {len(tensors):>5} tensors {numel:>14,} elements {_bytes(nbytes):>11}"
            + (f"  ({', '.join(dtypes)})" if dtypes else "")
        )
        if group == "rng" or group == "dataloader":
            ranks = sorted({k.split(".")[1] for k, _ in items})
            lines.append(f"  {'':<11} per rank: {', '.join(ranks)}")
    if "trainer" in groups:
        state = _read_small(path, metadata, "trainer")
        keys = (
            "global_step",
            "consumed_samples",
            "epoch",
            "skipped_steps",
            "tokens_seen",
            "best_loss",
            "last_loss",
        )
        lines.append("trainer state: " + ", ".join(f"{k}={state.get(k)}" for k in keys if k in state))
    if "scheduler" in groups:
        lines.append(f"scheduler state: {_read_small(path, metadata, 'scheduler')}")
    if list_tensors and "model" in groups:
        lines.append("model tensors:")
        for key, meta in sorted(groups["model"]):
            dtype = str(meta.properties.dtype).replace("torch.", "")
            lines.append(f"  {key[len('model.') :]:<60} {list(meta.size)!s:<20} {dtype}")
    return lines
