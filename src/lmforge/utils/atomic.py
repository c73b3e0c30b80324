"""Publishing outputs atomically: write aside, rename into place only on success.

Every file or directory lmforge produces (datasets, conversions, metrics, plots, summaries) is
written under a hidden temporary name next to its destination and renamed over it when complete,
so a failed or interrupted command leaves what existed before untouched. A rename within one
directory is atomic on POSIX file systems; ``os.replace`` replaces an existing file in one step.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from lmforge.errors import LmforgeError


class OutputPathError(LmforgeError):
    """An output path that cannot be written (a file where a directory is needed, read-only, ...)."""


def temporary_sibling(path: str | os.PathLike, tag: str = "tmp") -> Path:
    """``dir/.name.tmp-PID``: hidden, in the same directory (so the final rename is atomic)."""
    path = Path(path)
    return path.with_name(f".{path.name}.{tag}-{os.getpid()}")


def check_output_dir(path: str | os.PathLike, what: str) -> Path:
    """Refuse, with a clear message, a directory path that cannot be created or written.

    ``what`` names the option or key (e.g. ``"--to"``, ``"output_dir"``).
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputPathError(
            f"{what} {str(path)!r} is a file; it must be a directory (or a path to create)."
        )
    parent = path
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise OutputPathError(
            f"{what} {str(path)!r} cannot be created: {str(parent)!r} is a file, not a directory."
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputPathError(
            f"{what} {str(path)!r} cannot be written: {str(parent)!r} is not writable by this user. "
            "Choose a writable location."
        )
    return path


def check_output_file(path: str | os.PathLike, what: str) -> Path:
    """Refuse a file path whose directory cannot hold it, or that is a directory."""
    path = Path(path)
    if path.is_dir():
        raise OutputPathError(f"{what} {str(path)!r} is a directory; give a file name.")
    check_output_dir(path.parent if str(path.parent) else Path("."), f"the directory of {what}")
    return path


def fsync_file(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems do not support fsync on directories
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path to write; on success it replaces ``path``, on failure it is removed."""
    path = Path(path)
    tmp = temporary_sibling(path)
    try:
        yield tmp
        if tmp.exists():
            fsync_file(tmp)
            os.replace(tmp, path)
            fsync_dir(path.parent)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty temporary directory; on success it becomes ``path``, on failure it is removed.

    An existing ``path`` is moved aside, replaced and only then deleted, so at every instant one
    complete version exists (under ``path``, or under its ``.old`` name if the process dies between
    the two renames; :func:`recover_dir` puts it back).
    """
    path = Path(path)
    tmp = temporary_sibling(path)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        for dirpath, _dirs, files in os.walk(tmp):
            for name in files:
                fsync_file(os.path.join(dirpath, name))
        replace_dir(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def replace_dir(src: Path, dst: Path) -> None:
    """Rename directory ``src`` to ``dst``, replacing an existing ``dst`` (kept as ``.dst.old`` meanwhile)."""
    old = dst.with_name(f".{dst.name}.old")
    if dst.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(dst, old)
        os.replace(src, dst)
        fsync_dir(dst.parent)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dst)
        fsync_dir(dst.parent)


def recover_dir(path: str | os.PathLike) -> bool:
    """Put back ``path`` from its ``.old`` copy if a crash hit between the renames of :func:`replace_dir`."""
    path = Path(path)
    old = path.with_name(f".{path.name}.old")
    if not path.exists() and old.is_dir():
        os.replace(old, path)
        fsync_dir(path.parent)
        return True
    return False
