"""Per-file checksums of a checkpoint: recorded at save, verified before anything is loaded.

A save records the size and SHA-256 of every file of the iteration directory in ``checksums.json``
(written into the hidden ``.partial`` directory before it is renamed into place, so it is published
atomically with the rest). Each rank hashes the shard files it wrote itself (in the background thread
of an asynchronous save); rank 0 adds ``.metadata``, ``common.json`` and ``config.yaml`` and writes
the record. SHA-256 runs at ~1 GB/s on a core with SHA instructions; on load the files are split
between the ranks, so each reads ``1/world`` of the checkpoint once more.

Why: a shard whose bytes were overwritten (same size) loads without complaint and its NaN/garbage
weights only show as skipped steps; a checkpoint with a missing or altered ``common.json`` would
load with defaults. Checkpoints written before this record existed (``format`` ``lmforge-dcp/1``)
load with a warning that they cannot be verified.
"""

from __future__ import annotations

import hashlib
import json
import os
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


def _problems(directory: Path, names: list[str], files: dict[str, dict[str, Any]]) -> list[str]:
    problems = []
    for name in names:
        path = directory / name
        if not path.is_file():
            problems.append(f"{name} is missing")
            continue
        want = files[name]
        size = path.stat().st_size
        if size != want["size"]:
            problems.append(f"{name} has {size} bytes, {want['size']} were written")
        elif file_digest(path)[ALGORITHM] != want[ALGORITHM]:
            problems.append(f"{name} has other bytes than were written ({ALGORITHM} differs)")
    return problems


def verify_checkpoint(directory: Path, *, required: bool) -> None:
    """Refuse a checkpoint whose files differ from its record: a collective under a process group
    (every rank checks its share of the files, all ranks raise the same error).

    ``required``: the checkpoint's format promises a record, so a missing one is damage too.
    """
    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    problems: list[str] = []
    try:
        files = read_checksums(directory)
    except CheckpointError as exc:
        files, problems = None, [str(exc)]
    if files is None and not problems:
        if required:
            problems = [f"{CHECKSUM_FILE} is missing (every checkpoint in this format has one)"]
        elif rank == 0:
            logger.warning(
                "Checkpoint %s has no %s (it was written before lmforge recorded checksums): its files cannot "
                "be verified.",
                directory,
                CHECKSUM_FILE,
            )
    elif files is not None:
        problems = _problems(directory, sorted(files)[rank::world], files)
    if distributed:
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, problems)
        problems = sorted({p for rank_problems in gathered for p in rank_problems})
    if problems:
        raise CheckpointError(
            f"Checkpoint {directory} is damaged: {'; '.join(problems[:5])}"
            f"{f' (and {len(problems) - 5} more)' if len(problems) > 5 else ''}. It was not loaded. Use another "
            "iteration of the save_path (its latest_checkpointed_iteration.txt names the newest), or re-create it."
        )
