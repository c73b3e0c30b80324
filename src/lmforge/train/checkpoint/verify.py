"""Per-file checksums of a checkpoint: recorded at save, verified before anything is loaded.

A save records the size and SHA-256 of every file of the iteration directory in ``checksums.json``
(written into the hidden ``.partial`` directory before it is renamed into place, so it is published
atomically with the rest). A file of at most ``BLOCK_SIZE`` bytes is recorded by one digest of its
bytes, ``{"size": N, "sha256": HEX}``; a larger one by one digest per consecutive block,
``{"size": N, "block_size": B, "blocks": [HEX, ...]}`` (the last block may be shorter). SHA-256 of one
stream is sequential, so a whole-file digest of a large file can only be checked on one thread; block
digests can be checked on several at once (torch DCP writes one file per rank, so a one-process resume
of a 7B model's training state is one ~84 GB file). Each rank hashes the shard files it wrote itself
(on one thread: the background thread of an asynchronous save, where more threads would take CPU from
the training step it runs beside); rank 0 adds ``.metadata``, ``common.json`` and ``config.yaml`` and
writes the record.

On load every rank checks a share of the blocks (the split depends on the record alone, so all ranks
agree on it), each on ``verify_threads()`` threads: the CPUs of the process divided between the ranks of
its node, at most ``MAX_THREADS``. SHA-256 runs at ~1-2 GB/s per core with SHA instructions. A file of
another size is damaged without reading it. ``lmforge checkpoint inspect`` checks every block in one
process (``check_all``) with the same rule and reports damage with the same error (``damaged_error``),
naming the file and, for a block record, the byte range that differs. A block that cannot be read (an
I/O error) is damage too, so that every rank reaches the collective that shares the results.

Why: a shard whose bytes were overwritten (same size) loads without complaint and its NaN/garbage
weights only show as skipped steps; a checkpoint with a missing or altered ``common.json`` would
load with defaults. Checkpoints written before this record existed (``format`` ``lmforge-dcp/1``)
load with a warning that they cannot be verified; those of ``lmforge-dcp/2`` hold whole-file digests
only and are checked as before. Block records came with ``lmforge-dcp/3``: an lmforge that knows only
``/1`` and ``/2`` refuses such a checkpoint by its format (``resolve.py``), and would refuse the
record too (its entries lack ``sha256``) rather than skip the check.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import os
import re
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch.distributed as dist

from lmforge.errors import CheckpointError
from lmforge.utils.logging import get_logger

logger = get_logger("lmforge.train.checkpoint")

CHECKSUM_FILE = "checksums.json"
ALGORITHM = "sha256"
# 128 MiB: ~0.1 s of SHA-256 on one core, so the tail of a parallel check (the last block still being
# hashed while the other threads are idle) stays short, and a 1 GiB shard still splits 8 ways; large
# enough that the record stays small (~600 digests, ~45 KB of JSON, for an 84 GB file) and that each
# block is long sequential reads. Files up to one block keep the whole-file record of lmforge-dcp/2.
BLOCK_SIZE = 128 << 20
# More threads than this outrun what storage delivers (8 cores of SHA-256 is 8-16 GB/s).
MAX_THREADS = 8
_CHUNK = 16 << 20  # bytes read per call: large enough for hashlib to release the GIL, small in memory
_DIGEST = re.compile(r"[0-9a-f]{64}")
_WHOLE_KEYS = frozenset({"size", ALGORITHM})
_BLOCK_KEYS = frozenset({"size", "block_size", "blocks"})


# -- recording -----------------------------------------------------------------------------------


def _sha256_next(f: BinaryIO, limit: int, buffer: memoryview) -> tuple[str, int]:
    """(SHA-256 of the next ``limit`` bytes of ``f``, or of fewer at its end; how many were read)."""
    digest = hashlib.sha256()
    read = 0
    while read < limit:
        n = f.readinto(buffer[: min(len(buffer), limit - read)])
        if not n:
            break
        digest.update(buffer[:n])
        read += n
    return digest.hexdigest(), read


def file_record(path: Path, block_size: int | None = None) -> dict[str, Any]:
    """The record of one file, read once front to back on this thread: ``{"size", "sha256"}`` for a file of
    at most ``block_size`` bytes (default ``BLOCK_SIZE``), ``{"size", "block_size", "blocks"}`` above."""
    block_size = block_size or BLOCK_SIZE
    buffer = memoryview(bytearray(min(_CHUNK, block_size)))
    digests: list[str] = []
    size = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            digest, n = _sha256_next(f, block_size, buffer)
            if n or not digests:  # an empty file is one empty block
                digests.append(digest)
            size += n
            if n < block_size:
                break
    if len(digests) == 1:
        return {"size": size, ALGORITHM: digests[0]}
    return {"size": size, "block_size": block_size, "blocks": digests}


def record_files(
    paths: list[Path], block_size: int | None = None, *, workers: int | None = None
) -> dict[str, dict[str, Any]]:
    """Records of ``paths`` (name -> ``file_record``), several files at once on ``workers`` threads
    (default ``verify_threads()``); each file is still read front to back on one thread."""
    if not paths:
        return {}
    workers = max(1, min(workers or verify_threads(), len(paths)))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lmforge-record") as pool:
        records = pool.map(lambda p: file_record(p, block_size), paths)
        return {p.name: record for p, record in zip(paths, records)}


def rank_file_stem(prefix: str | None, rank: int, world: int) -> str:
    """The start of the names of the shard files rank ``rank`` writes (``manager._PrefixedWriter``)."""
    return f"{prefix}-{rank:07d}-{world:07d}_" if prefix else f"{rank:07d}-{world:07d}_"


def digest_rank_files(directory: Path, stem: str, block_size: int | None = None) -> dict[str, dict[str, Any]]:
    """Records of the shard files of one rank in ``directory`` (name -> record)."""
    return {
        p.name: file_record(p, block_size) for p in sorted(directory.glob(f"{stem}*.distcp")) if p.is_file()
    }


def write_checksums(
    directory: Path, shard_digests: dict[str, dict[str, Any]], block_size: int | None = None
) -> None:
    """Rank 0: add the records of every other file of ``directory`` and write ``checksums.json``."""
    files = dict(shard_digests)
    for p in sorted(directory.iterdir()):
        if p.is_file() and p.name != CHECKSUM_FILE and p.name not in files:
            files[p.name] = file_record(p, block_size)
    record = {"algorithm": ALGORITHM, "files": files}
    with open(directory / CHECKSUM_FILE, "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


# -- reading the record --------------------------------------------------------------------------


def _block_count(size: int, block_size: int) -> int:
    return -(-size // block_size)


def _is_digest(value: Any) -> bool:
    return isinstance(value, str) and _DIGEST.fullmatch(value) is not None


def entry_problem(entry: Any) -> str | None:
    """What is wrong with one file's entry of the record; None when it is one lmforge writes."""
    if not isinstance(entry, dict):
        return "is not a JSON object"
    size = entry.get("size")
    if type(size) is not int or size < 0:  # not true, 2.0, "2"
        return f"has size {size!r}, not a non-negative integer"
    keys = set(entry)
    if keys == _WHOLE_KEYS:
        return (
            None
            if _is_digest(entry[ALGORITHM])
            else f"has {ALGORITHM} {entry[ALGORITHM]!r}, not 64 hex digits"
        )
    if keys != _BLOCK_KEYS:
        return f"has the keys {sorted(keys)}"
    block_size, blocks = entry["block_size"], entry["blocks"]
    if type(block_size) is not int or block_size <= 0:
        return f"has block_size {block_size!r}, not a positive integer"
    if size <= block_size:  # so that every recorded file has a block to check, and one record per file
        return (
            f"has blocks for {size} bytes, not more than one block of {block_size} (recorded by {ALGORITHM})"
        )
    if not isinstance(blocks, list) or not all(_is_digest(b) for b in blocks):
        return "has blocks that are not a list of digests of 64 hex digits"
    if len(blocks) != _block_count(size, block_size):
        return (
            f"has {len(blocks)} block digests for {size} bytes in blocks of {block_size} "
            f"({_block_count(size, block_size)} expected)"
        )
    return None


def _record_problem(record: Any) -> str | None:
    """What is wrong with the parsed ``checksums.json``; None when it is a record lmforge writes."""
    if isinstance(record, Exception):
        return f"it is not JSON ({record})"
    if not isinstance(record, dict) or set(record) != {"algorithm", "files"}:
        return "it is not an object of the two keys algorithm and files"
    if record["algorithm"] != ALGORITHM:
        return f"its algorithm is {record['algorithm']!r}"
    if not isinstance(record["files"], dict):
        return "its files is not an object"
    for name, entry in record["files"].items():
        if not name or "/" in name:
            return f"it names the file {name!r}, which is not a file of this directory"
        problem = entry_problem(entry)
        if problem is not None:
            return f"the entry of {name!r} {problem}"
    return None


def read_checksums(directory: Path) -> dict[str, dict[str, Any]] | None:
    """The recorded files (name -> record), or None when the checkpoint has no record."""
    path = directory / CHECKSUM_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        record = exc
    problem = _record_problem(record)
    if problem is not None:
        raise CheckpointError(
            f"{path} is not the checksum record lmforge writes: {problem}. lmforge writes "
            f'{{"algorithm": "{ALGORITHM}", "files": {{NAME: ENTRY}}}}, each ENTRY {{"size": N, "{ALGORITHM}": HEX}} '
            'or, for a file larger than one block, {"size": N, "block_size": B, "blocks": [HEX, ...]} with one '
            "digest per B bytes (HEX: 64 lowercase hex digits). The checkpoint is damaged; use another "
            "iteration of the save_path."
        )
    return record["files"]


# -- checking ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    """A byte range of a recorded file and its recorded digest (a whole-file record is one block)."""

    name: str
    index: int
    count: int  # blocks of the file
    offset: int
    length: int
    recorded: str


def blocks_of(name: str, want: dict[str, Any]) -> list[Block]:
    """The blocks of file ``name`` as its (validated) record ``want`` describes them."""
    size = want["size"]
    if ALGORITHM in want:
        return [Block(name, 0, 1, 0, size, want[ALGORITHM])]
    step, digests = want["block_size"], want["blocks"]
    return [
        Block(name, i, len(digests), i * step, min(step, size - i * step), digest)
        for i, digest in enumerate(digests)
    ]


def all_blocks(files: dict[str, dict[str, Any]]) -> list[Block]:
    """Every block of every recorded file, in name order."""
    return [block for name in sorted(files) for block in blocks_of(name, files[name])]


def share_of(blocks: list[Block], rank: int, world: int) -> list[Block]:
    """The blocks ``rank`` of ``world`` checks, in name order: largest first, each to the rank with the
    fewest bytes so far. It depends on the record alone, so every rank computes the same split."""
    if world == 1:
        return blocks
    ranks = [(0, r) for r in range(world)]
    mine = []
    for block in sorted(blocks, key=lambda b: (-b.length, b.name, b.index)):
        load, r = heapq.heappop(ranks)
        heapq.heappush(ranks, (load + block.length, r))
        if r == rank:
            mine.append(block)
    return sorted(mine, key=lambda b: (b.name, b.index))


@dataclass(frozen=True)
class BlockMismatch:
    """A block whose bytes on disk hash to another digest than was recorded."""

    index: int
    count: int
    offset: int
    length: int
    recorded: str
    found: str

    @property
    def where(self) -> str:
        return _where(self.offset, self.length, self.index, self.count)


def _where(offset: int, length: int, index: int, count: int) -> str:
    """A block's byte range, in the words of the error (``bytes A-B (block i of n)``)."""
    return f"bytes {offset}-{offset + length - 1} (block {index + 1} of {count})"


@dataclass(frozen=True)
class FileCheck:
    """One file of a checkpoint against its record: what was written (``recorded_size``) and what is on
    disk (``size`` None: the file is missing); ``mismatches``: the blocks that hash to other digests (none
    are hashed when the size already differs); ``unreadable``: the error of a block that could not be read.
    Under a process group a rank's check covers its share of the blocks."""

    name: str
    recorded_size: int
    size: int | None
    mismatches: tuple[BlockMismatch, ...] = ()
    unreadable: str | None = None

    @property
    def ok(self) -> bool:
        return self.size == self.recorded_size and not self.mismatches and self.unreadable is None

    @property
    def problem(self) -> str | None:
        """What is wrong with the file, in the words of the load error; None when it is intact."""
        if self.size is None:
            return f"{self.name} is missing"
        if self.size != self.recorded_size:
            return f"{self.name} has {self.size} bytes, {self.recorded_size} were written"
        if self.unreadable is not None:
            return f"{self.name} could not be read ({self.unreadable})"
        if not self.mismatches:
            return None
        first = self.mismatches[0]
        differs = f"{ALGORITHM} differs: {first.recorded} recorded, {first.found} found"
        if first.count == 1:
            return f"{self.name} has other bytes than were written ({differs})"
        if len(self.mismatches) == 1:
            return f"{self.name} has other bytes than were written in {first.where} ({differs})"
        return (
            f"{self.name} has other bytes than were written in {len(self.mismatches)} of its {first.count} "
            f"blocks, the first in {first.where} ({differs})"
        )


def verify_threads() -> int:
    """Threads one process hashes with: its CPUs shared with the other ranks of its node (on load every
    local rank verifies at once; ``LOCAL_WORLD_SIZE`` is set by torchrun), at most ``MAX_THREADS``, at
    least 1. A process bound to some CPUs counts those; a binding per rank makes this conservative."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local_ranks = 1
    return max(1, min(MAX_THREADS, cpus // local_ranks))


def _sha256_of(path: Path, block: Block) -> str:
    """SHA-256 of ``block``'s bytes of ``path`` (its own file handle: threads read independently)."""
    buffer = memoryview(bytearray(max(1, min(_CHUNK, block.length))))
    with open(path, "rb", buffering=0) as f:
        f.seek(block.offset)
        return _sha256_next(f, block.length, buffer)[0]


def _size_on_disk(path: Path) -> int | None:
    return path.stat().st_size if path.is_file() else None


def check_blocks(
    directory: Path,
    files: dict[str, dict[str, Any]],
    blocks: list[Block],
    *,
    workers: int | None = None,
    on_block: Callable[[Block], None] | None = None,
) -> list[FileCheck]:
    """The files of ``blocks`` (records in ``files``) against their record, in name order: sizes first (a
    file of another size is damaged without reading it), then ``blocks`` of the files of the right size
    hashed on ``workers`` threads (default ``verify_threads()``; file reads and hashlib release the GIL).

    ``on_block`` (progress) sees each block of ``blocks`` once it is settled: once hashed (an unreadable
    block is settled too), on the worker thread that hashed it or on this one, so it must be thread-safe;
    at once, for the blocks of a file of another size, which are not read. Every call has been made
    when this returns (the pool is shut down first). An error it raises on a worker thread is logged by
    ``concurrent.futures`` and does not change the result of the check."""
    names = sorted({b.name for b in blocks})
    sizes = {name: _size_on_disk(directory / name) for name in names}
    todo = [b for b in blocks if sizes[b.name] == files[b.name]["size"]]
    if on_block is not None:
        for block in blocks:
            if sizes[block.name] != files[block.name]["size"]:
                on_block(block)
    workers = max(1, min(workers or verify_threads(), len(todo)))
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lmforge-verify")
    try:
        pending: dict[str, list[tuple[Block, Future]]] = {name: [] for name in names}
        for block in todo:  # in name order, so files finish roughly in the order they are reported
            future = pool.submit(_sha256_of, directory / block.name, block)
            if on_block is not None:
                # A done-callback rather than a call inside the task: an error of the progress (a closed
                # stderr is an OSError) can never pass for an unreadable block.
                future.add_done_callback(lambda _, block=block: on_block(block))
            pending[block.name].append((block, future))
        return [_file_check(name, files[name]["size"], sizes[name], pending[name]) for name in names]
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # on an error, drop the blocks not yet started


def _file_check(
    name: str, recorded_size: int, size: int | None, hashed: list[tuple[Block, Future]]
) -> FileCheck:
    """One file's check from its hashed blocks (waiting for each). A block that cannot be read (a disk's
    I/O error) makes the file damaged rather than raising, so that every rank still reaches the collective
    that shares the results and all raise the same error."""
    mismatches = []
    unreadable = None
    for block, future in hashed:
        try:
            found = future.result()
        except OSError as exc:
            where = (
                _where(block.offset, block.length, block.index, block.count)
                if block.count > 1
                else "reading it"
            )
            unreadable = unreadable or f"{where}: {type(exc).__name__}: {exc}"
            continue
        if found != block.recorded:
            mismatches.append(
                BlockMismatch(block.index, block.count, block.offset, block.length, block.recorded, found)
            )
    return FileCheck(name, recorded_size, size, tuple(mismatches), unreadable)


def check_file(directory: Path, name: str, want: dict[str, Any], *, workers: int | None = None) -> FileCheck:
    """``name`` of ``directory`` against its record ``want``, its blocks hashed on ``workers`` threads."""
    return check_blocks(directory, {name: want}, blocks_of(name, want), workers=workers)[0]


def check_all(
    directory: Path,
    files: dict[str, dict[str, Any]],
    *,
    on_block: Callable[[Block], None] | None = None,
    workers: int | None = None,
) -> list[FileCheck]:
    """Every recorded file of ``directory`` in this one process (``lmforge checkpoint inspect``), in name
    order, the blocks of all files hashed on one pool of ``workers`` threads (default ``verify_threads()``);
    ``on_block`` sees each block once it is settled (``check_blocks``)."""
    return check_blocks(directory, files, all_blocks(files), workers=workers, on_block=on_block)


def merge_checks(checks: Iterable[FileCheck]) -> list[FileCheck]:
    """The checks of several ranks (each of its share of the blocks) as one per file, in name order."""
    by_name: dict[str, list[FileCheck]] = {}
    for check in checks:
        by_name.setdefault(check.name, []).append(check)
    merged = []
    for name in sorted(by_name):
        parts = by_name[name]
        wrong_size = next((c for c in parts if c.size != c.recorded_size), None)
        if wrong_size is not None:
            merged.append(wrong_size)
            continue
        mismatches = tuple(sorted({m for c in parts for m in c.mismatches}, key=lambda m: m.index))
        unreadable = next((c.unreadable for c in parts if c.unreadable is not None), None)
        merged.append(FileCheck(name, parts[0].recorded_size, parts[0].size, mismatches, unreadable))
    return merged


def read_record(directory: Path, *, required: bool) -> tuple[dict[str, dict[str, Any]] | None, str | None]:
    """(the recorded files or None, what is wrong with the record or None). ``required``: the
    checkpoint's format promises a record (every format but ``lmforge-dcp/1``), so a missing one is
    damage; without the promise a missing record is no problem, only nothing to verify against."""
    try:
        files = read_checksums(directory)
    except CheckpointError as exc:
        return None, str(exc)
    if files is None and required:
        return None, f"{CHECKSUM_FILE} is missing (every checkpoint in this format has one)"
    return files, None


def damaged_error(directory: Path, problems: list[str]) -> CheckpointError:
    """The one error of a checkpoint whose files differ from their record (load and inspect)."""
    problems = [p.rstrip(".") for p in problems]  # a record's own error ends in a full stop
    return CheckpointError(
        f"Checkpoint {directory} is damaged: {'; '.join(problems[:5])}"
        f"{f' (and {len(problems) - 5} more)' if len(problems) > 5 else ''}. It was not loaded. Use another "
        "iteration of the save_path (its latest_checkpointed_iteration.txt names the newest), or re-create it."
    )


def verify_checkpoint(directory: Path, *, required: bool) -> None:
    """Refuse a checkpoint whose files differ from its record: a collective under a process group
    (every rank checks its share of the blocks on ``verify_threads()`` threads, all ranks raise the same
    error).

    ``required``: the checkpoint's format promises a record, so a missing one is damage too.
    """
    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    files, record_problem = read_record(directory, required=required)
    problems = [record_problem] if record_problem else []
    checks: list[FileCheck] = []
    if files is None and not problems and rank == 0:
        logger.warning(
            "Checkpoint %s has no %s (it was written before lmforge recorded checksums): its files cannot "
            "be verified.",
            directory,
            CHECKSUM_FILE,
        )
    elif files is not None:
        checks = check_blocks(directory, files, share_of(all_blocks(files), rank, world))
    if distributed:
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, (problems, checks))
        problems = sorted({p for rank_problems, _ in gathered for p in rank_problems})
        checks = merge_checks(c for _, rank_checks in gathered for c in rank_checks)
    problems += [c.problem for c in checks if c.problem is not None]
    if problems:
        raise damaged_error(directory, problems)
