"""The rows that ``training.epochs`` counts in text data (data/epochs.py), kept beside the data so that
the training split is tokenized for the count once, not again at every launch and on every process.

Counting packs the training split's token counts, which needs the whole split tokenized: as long as
the loader's own pass over the data. It runs before anything is built (the steps must be known for
the lr schedule), hence on every process of a job and again at every ``check``, ``train`` and restart.

* **Key**: everything the count depends on, so that a hit is exact: each data file's identity
  (absolute path, size, modification and change times in ns, inode), the tokenizer.json's bytes
  (SHA-256), every field of the loader settings (the format with its chat template, seq_length,
  packing, validation split, shuffle window, blend weights, ...), the passes, the data-parallel size,
  the seed when ``shuffle`` uses it, and the counting code itself (the source of lmforge's text-data
  modules and the tokenizers and jinja2 versions). The entry stores the whole key and is used only
  when it equals the key of now.
* **Where**: ``<directory of the first data file>/cache/text_epoch_rows/<sha256 of the key>.json``,
  beside the data as the Megatron loader's index cache (``cache/GPTDataset_indices``), so ``check``,
  ``train`` and every restart share it whatever their output_dir.
* **Once per job**: the processes of a job start together; each takes an exclusive lock
  (``flock`` on ``cache/text_epoch_rows/.lock``) before looking: the first counts and writes the
  entry (temporary file and rename), the others wait for it and read it.
* **Not cached**: a data file modified less than ``FRESH_S`` seconds before the count (a file's
  times have a coarse granularity, so a same-size rewrite within it would keep its identity; every
  process then counts at once, unlocked, as without a cache) or changed while it was counted. An unwritable directory, or a filesystem without locks, only costs
  the count again (a log line says so); the count itself never depends on the cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmforge.utils.logging import get_logger

from .text_schema import KEY
from .text_sources import is_saved_dataset, resolve_files

log = get_logger("lmforge.data")

CACHE_SUBDIR = os.path.join("cache", "text_epoch_rows")
LOCK_FILE = ".lock"
FRESH_S = 2.0
_VERSION = 1


def cached_rows(settings: Any, count: Callable[[], list[int]], **counted: Any) -> list[int]:
    """``count()`` (the rows of each data-parallel rank), or its earlier result for the same key.

    ``settings``: the loader's ``TextLoaderSettings``; ``counted``: what else the count depends on
    (passes, data-parallel size, seed)."""
    files = _data_files(settings)
    key = _key(settings, files, counted)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode("utf-8")).hexdigest()
    directory = Path(os.path.dirname(os.path.abspath(files[0]))) / CACHE_SUBDIR
    entry = directory / f"{digest}.json"
    rows = _read(entry, key)
    if rows is not None:
        return rows
    if _fresh(key["files"], time.time_ns()):
        return count()  # not cached, so not locked either: every process counts at once, as without a cache
    try:
        directory.mkdir(parents=True, exist_ok=True)
        lock = open(directory / LOCK_FILE, "a")  # noqa: SIM115 (held open for the lock's lifetime)
    except OSError as exc:
        log.info("training.epochs: the row count cannot be cached in %s (%s); counting.", directory, exc)
        return count()
    with lock:
        _lock(lock, directory)
        rows = _read(entry, key)  # another process of the job may have counted while this one waited
        if rows is not None:
            return rows
        rows = count()
        if _unchanged(files, key["files"]):  # else the identity does not name this result
            _write(entry, key, rows)
    return rows


def _data_files(settings: Any) -> list[str]:
    """Every file the training sources read (a saved dataset's directory: all its files)."""
    files = []
    for path in settings.paths:
        for f in resolve_files(path, f"{KEY}.data_path"):
            if is_saved_dataset(f):
                files += sorted(os.path.join(d, n) for d, _, names in os.walk(f) for n in names)
            else:
                files.append(f)
    return files


def _identities(files: list[str]) -> list[list[Any]]:
    out = []
    for f in files:
        st = os.stat(f)
        out.append([os.path.abspath(f), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino])
    return out


def _unchanged(files: list[str], identities: list[list[Any]]) -> bool:
    """Whether the data files still have the identities they had before the count."""
    try:
        return _identities(files) == identities
    except OSError:  # one was removed meanwhile
        return False


def _fresh(identities: list[list[Any]], now_ns: int) -> bool:
    """Whether a file was modified within FRESH_S of ``now_ns`` (its identity could still change
    without its times doing so)."""
    return any(now_ns - max(mtime, ctime) < FRESH_S * 1e9 for _, _, mtime, ctime, _ in identities)


def _key(settings: Any, files: list[str], counted: dict[str, Any]) -> dict[str, Any]:
    from lmforge.utils.tokenizer import tokenizer_file

    with open(tokenizer_file(settings.tokenizer), "rb") as f:
        tokenizer = hashlib.sha256(f.read()).hexdigest()
    return {
        "what": "rows of training.epochs passes over the training split (lmforge data/epochs.py)",
        "version": _VERSION,
        "files": _identities(files),
        "tokenizer_sha256": tokenizer,
        "settings": json.loads(json.dumps(dataclasses.asdict(settings), default=str)),
        "counted": counted,
        "code": _code_identity(),
    }


def _code_identity() -> dict[str, str]:
    """The counting code: lmforge's modules that read, format, tokenize and pack text rows, and the
    libraries that tokenize and render chat templates."""
    here = Path(__file__).parent
    sources = sorted([*here.glob("text_*.py"), here / "epochs.py", here.parent / "utils" / "tokenizer.py"])
    code = hashlib.sha256()
    for path in sources:
        code.update(path.name.encode() + b"\0" + path.read_bytes())
    return {"sources": code.hexdigest(), **{lib: _version(lib) for lib in ("tokenizers", "jinja2")}}


def _version(distribution: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return "absent"


def _lock(lock: Any, directory: Path) -> None:
    try:
        import fcntl

        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
    except (ImportError, OSError) as exc:  # no locks here: each process counts (still exact)
        log.info("training.epochs: cannot lock %s (%s); processes may count at once.", directory, exc)


def _read(entry: Path, key: dict[str, Any]) -> list[int] | None:
    try:
        record = json.loads(entry.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None  # absent or damaged: counted again
    if not isinstance(record, dict) or record.get("key") != key or not isinstance(record.get("rows"), list):
        return None
    rows = record["rows"]
    if not all(type(r) is int and r >= 0 for r in rows) or len(rows) != key["counted"].get("dp_size"):
        return None
    return rows


def _write(entry: Path, key: dict[str, Any], rows: list[int]) -> None:
    tmp = entry.with_name(f"{entry.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps({"key": key, "rows": rows}, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, entry)
    except OSError as exc:
        log.info("training.epochs: cannot write the row count to %s (%s).", entry, exc)
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
