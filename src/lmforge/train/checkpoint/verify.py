"""Per-file checksums of a checkpoint: recorded at save, verified before anything is loaded.

A save records the size and SHA-256 of every file of the iteration directory in ``checksums.json``
(written into the hidden ``.partial`` directory before it is renamed into place, so it is published
atomically with the rest). Each rank hashes the shard files it wrote itself (in the background thread
of an asynchronous save); rank 0 adds ``.metadata``, ``common.json`` and ``config.yaml`` and writes
the record. SHA-256 runs at ~1 GB/s on a core with SHA instructions; on load the files are split
between the ranks, so each reads ``1/world`` of the checkpoint once more. ``lmforge checkpoint
inspect`` checks every file in one process (``check_all``) with the same rule (``check_file``) and
reports damage with the same error (``damaged_error``).

Why: a shard whose bytes were overwritten (same size) loads without complaint and its NaN/garbage
weights only show as skipped steps; a checkpoint with a missing or altered ``common.json`` would
load with defaults. Checkpoints written before this record existed (``format`` ``lmforge-dcp/1``)
load with a warning that they cannot be verified.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lmforge.errors import CheckpointError
from lmforge.utils.logging import get_logger

logger = get_logger("lmforge.train.checkpoint")

CHECKSUM_FILE = "checksums.json"
ALGORITHM = "sha256"
_CHUNK = 16 << 20


def file_digest(path: Path) -> dict[str, Any]:
    """``{"size": bytes, "sha256": hex}`` of one file (read in chunks; hashlib releases the GIL)."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return {"size": size, ALGORITHM: digest.hexdigest()}


def rank_file_stem(prefix: str | None, rank: int, world: int) -> str:
    """The start of the names of the shard files rank ``rank`` writes (``manager._PrefixedWriter``)."""
    return f"{prefix}-{rank:07d}-{world:07d}_" if prefix else f"{rank:07d}-{world:07d}_"


def digest_rank_files(directory: Path, stem: str) -> dict[str, dict[str, Any]]:
    """Digests of the shard files of one rank in ``directory`` (name -> digest)."""
    return {p.name: file_digest(p) for p in sorted(directory.glob(f"{stem}*.distcp")) if p.is_file()}


def write_checksums(directory: Path, shard_digests: dict[str, dict[str, Any]]) -> None:
    """Rank 0: add the digests of every other file of ``directory`` and write ``checksums.json``."""
    files = dict(shard_digests)
    for p in sorted(directory.iterdir()):
        if p.is_file() and p.name != CHECKSUM_FILE and p.name not in files:
            files[p.name] = file_digest(p)
    record = {"algorithm": ALGORITHM, "files": files}
    with open(directory / CHECKSUM_FILE, "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def read_checksums(directory: Path) -> dict[str, dict[str, Any]] | None:
    """The recorded digests (name -> digest), or None when the checkpoint has no record."""
    path = directory / CHECKSUM_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        record = exc
    files = record.get("files") if isinstance(record, dict) else None
    valid = (
        isinstance(record, dict)
        and record.get("algorithm") == ALGORITHM
        and isinstance(files, dict)
        and all(
            isinstance(name, str)
            and "/" not in name
            and isinstance(d, dict)
            and isinstance(d.get("size"), int)
            and isinstance(d.get(ALGORITHM), str)
            for name, d in files.items()
        )
    )
    if not valid:
        raise CheckpointError(
            f"{path} is not the checksum record lmforge writes (a JSON object with algorithm {ALGORITHM!r} and "
            "a size and digest per file); the checkpoint is damaged. Use another iteration of the save_path."
        )
    return files


@dataclass(frozen=True)
class FileCheck:
    """One file of a checkpoint against its record: what was written (``recorded_*``) and what is on disk
    (``size`` None: the file is missing; ``digest`` None: not hashed because the size already differs)."""

    name: str
    recorded_size: int
    recorded_digest: str
    size: int | None
    digest: str | None

    @property
    def ok(self) -> bool:
        return self.size == self.recorded_size and self.digest == self.recorded_digest

    @property
    def problem(self) -> str | None:
        """What is wrong with the file, in the words of the load error; None when it is intact."""
        if self.size is None:
            return f"{self.name} is missing"
        if self.size != self.recorded_size:
            return f"{self.name} has {self.size} bytes, {self.recorded_size} were written"
        if self.digest != self.recorded_digest:
            return (
                f"{self.name} has other bytes than were written ({ALGORITHM} differs: {self.recorded_digest} "
                f"recorded, {self.digest} found)"
            )
        return None


def check_file(directory: Path, name: str, want: dict[str, Any]) -> FileCheck:
    """``name`` of ``directory`` against its recorded size and digest ``want`` (hashed only when the size
    matches: a file of another size is damaged without reading it)."""
    path = directory / name
    size = path.stat().st_size if path.is_file() else None
    digest = file_digest(path)[ALGORITHM] if size == want["size"] else None
    return FileCheck(name, want["size"], want[ALGORITHM], size, digest)


def check_all(
    directory: Path,
    files: dict[str, dict[str, Any]],
    *,
    on_checked: Callable[[FileCheck], None] | None = None,
    workers: int | None = None,
) -> list[FileCheck]:
    """Every recorded file of ``directory`` in this one process (``lmforge checkpoint inspect``), in name
    order, hashed on ``workers`` threads (file reads and hashlib release the GIL; default: up to 4 as the
    CPUs allow); ``on_checked`` sees each result as soon as it and the ones before it are done."""
    names = sorted(files)
    workers = workers or max(1, min(4, os.cpu_count() or 1, len(names)))
    checks = []
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for check in pool.map(lambda name: check_file(directory, name, files[name]), names):
            if on_checked is not None:
                on_checked(check)
            checks.append(check)
    return checks


def read_record(directory: Path, *, required: bool) -> tuple[dict[str, dict[str, Any]] | None, str | None]:
    """(the recorded digests or None, what is wrong with the record or None). ``required``: the
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
    return CheckpointError(
        f"Checkpoint {directory} is damaged: {'; '.join(problems[:5])}"
        f"{f' (and {len(problems) - 5} more)' if len(problems) > 5 else ''}. It was not loaded. Use another "
        "iteration of the save_path (its latest_checkpointed_iteration.txt names the newest), or re-create it."
    )


def verify_checkpoint(directory: Path, *, required: bool) -> None:
    """Refuse a checkpoint whose files differ from its record: a collective under a process group
    (every rank checks its share of the files, all ranks raise the same error).

    ``required``: the checkpoint's format promises a record, so a missing one is damage too.
    """
    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    files, record_problem = read_record(directory, required=required)
    problems = [record_problem] if record_problem else []
    if files is None and not problems and rank == 0:
        logger.warning(
            "Checkpoint %s has no %s (it was written before lmforge recorded checksums): its files cannot "
            "be verified.",
            directory,
            CHECKSUM_FILE,
        )
    elif files is not None:
        checks = (check_file(directory, name, files[name]) for name in sorted(files)[rank::world])
        problems = [c.problem for c in checks if c.problem is not None]
    if distributed:
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, problems)
        problems = sorted({p for rank_problems in gathered for p in rank_problems})
    if problems:
        raise damaged_error(directory, problems)
