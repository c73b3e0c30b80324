"""One run per output directory: a lock file naming the process (pid, host) that holds it.

``RunLock(dir).acquire()`` creates ``dir/.lmforge.lock`` and holds an exclusive ``flock`` on it for
the life of the run; the file records who holds it. A second run on the same directory finds the
lock taken and is refused with a message naming the first (pid, host, command, start time). A lock
file left by a run that died is stale: its ``flock`` went with the process, so the next run takes
it over (and says so). On a file system without ``flock`` support the recorded pid is checked
instead (a lock from this host whose pid is gone is stale; one from another host is respected).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from lmforge.errors import LmforgeError
from lmforge.utils.logging import get_logger
from lmforge.utils.pids import pid_alive

logger = get_logger("lmforge.utils.run_lock")

LOCK_FILE = ".lmforge.lock"

# Locks this process holds, by directory: taking one again (e.g. a caller that locks around
# Trainer.fit, which locks too) nests instead of conflicting with itself.
_HELD: dict[Path, list[RunLock]] = {}


class RunLockedError(LmforgeError):
    """Another lmforge process is using the directory."""


def _describe(info: dict[str, Any]) -> str:
    return (
        f"pid {info.get('pid', '?')} on host {info.get('host', '?')}, started {info.get('started', '?')}"
        f" ({info.get('command', '?')})"
    )


class RunLock:
    def __init__(self, directory: str | os.PathLike, what: str = "directory") -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK_FILE
        self.what = what
        self._fd: int | None = None

    def _read(self) -> dict[str, Any]:
        try:
            info = json.loads(self.path.read_text())
            return info if isinstance(info, dict) else {}
        except (OSError, ValueError):
            return {}

    def _refuse(self, info: dict[str, Any]) -> RunLockedError:
        return RunLockedError(
            f"{self.what} {str(self.directory)!r} is in use by another lmforge run ({_describe(info)}). "
            "Two runs writing the same directory would overwrite each other's checkpoints and metrics. "
            f"Wait for that run to end, or choose another directory. If that run is gone (e.g. its machine "
            f"died), delete {self.path}."
        )

    def acquire(self) -> RunLock:
        self.directory.mkdir(parents=True, exist_ok=True)
        key = self.directory.resolve()
        if key in _HELD:
            _HELD[key].append(self)
            return self
        self._acquire()
        _HELD[key] = [self]
        return self

    def _acquire(self) -> None:
        for _attempt in range(10):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise self._refuse(self._read()) from None
            except OSError:
                break
            # The holder unlinks the file when it releases: a lock on an unlinked file is no lock.
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        else:
            raise self._refuse(self._read())
        self._take(fd)

    def _take(self, fd: int) -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise self._refuse(self._read()) from None
        except OSError:
            # No flock on this file system: judge by the recorded pid and host.
            info = self._read()
            if info and not self._stale(info) and info.get("pid") != os.getpid():
                os.close(fd)
                raise self._refuse(info) from None
        previous = self._read()
        if previous and previous.get("pid") != os.getpid():
            logger.warning(
                "Taking over the stale lock %s of a run that ended without releasing it (%s).",
                self.path,
                _describe(previous),
            )
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": " ".join(sys.argv)[:300],
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        self._fd = fd

    @staticmethod
    def _stale(info: dict[str, Any]) -> bool:
        return info.get("host") == socket.gethostname() and not pid_alive(int(info.get("pid", -1)))

    def release(self) -> None:
        key = self.directory.resolve()
        holders = _HELD.get(key, [])
        if self in holders:
            holders.remove(self)
        if holders:  # an outer holder keeps the lock (and its file descriptor)
            if self._fd is not None:
                holders[0]._fd, self._fd = self._fd, None
            return
        _HELD.pop(key, None)
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            self.path.unlink()
        with contextlib.suppress(OSError):
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def lock_dirs(dirs: dict[Path, str]) -> list[RunLock]:
    """Lock every directory (path -> the key that names it), all or none."""
    locks: list[RunLock] = []
    try:
        for path, what in dirs.items():
            locks.append(RunLock(path, what).acquire())
    except BaseException:
        for lock in reversed(locks):
            lock.release()
        raise
    return locks


def run_dirs(output_dir: str | os.PathLike, save_path: str | None) -> dict[Path, str]:
    """The directories a training run writes: its output_dir and, when it saves (``save_path`` is
    ``checkpoint.save_path`` then, else None or ""), its checkpoint directory."""
    dirs = {Path(output_dir).resolve(): "output_dir"}
    if save_path:
        dirs.setdefault(Path(save_path).resolve(), "checkpoint.save_path")
    return dirs
