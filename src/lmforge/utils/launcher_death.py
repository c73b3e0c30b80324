"""A worker started by torchrun ends when its launcher dies: no orphaned training processes.

torchrun starts every worker in a session of its own (``start_new_session=True``), so a SIGKILL to
the launcher's process group (``kill -9 -PGID``, a job killer that signals one process group, a
crashed or OOM-killed torchrun) does not reach the workers. Their links to each other (gloo, NCCL)
still work, so they would train on, holding their GPUs, with nobody left to stop them. Under torchrun
each worker therefore:

- asks Linux to send it SIGTERM when its parent (the torchrun agent) dies (``prctl(PR_SET_PDEATHSIG)``;
  torchrun starts workers from its main thread, whose end is the process's end). SIGTERM is the
  usual stop: every rank stops at the same agreed step, saves one checkpoint and exits 0. One dead
  launcher on a multi-node job stops the whole job that way: its ranks' stop request is agreed by all;
- watches its parent from a daemon thread (``os.getppid()`` changes when the parent dies). Where
  prctl is missing (not Linux) the thread sends the SIGTERM itself. If the process still runs
  ``LMFORGE_ORPHAN_GRACE_S`` seconds (default 300) after its parent died (stuck in start-up waiting
  for the launcher's store, or in a collective whose peer is gone), it exits with ``EXIT_ORPHANED``.

A launcher that dies before its worker got this far (its first second) is not noticed; such a
worker fails at start-up instead, when the launcher's store does not answer
(``parallelism.process_group_timeout``). Nothing is done outside torchrun (``TORCHELASTIC_RUN_ID`` unset): a process started by hand belongs
to whoever started it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time

GRACE_ENV = "LMFORGE_ORPHAN_GRACE_S"
DEFAULT_GRACE_S = 300.0
EXIT_ORPHANED = 4  # nobody reads it (the launcher is gone); it says "orphaned" in a process list
POLL_S = 0.5
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

_armed = False


def under_torchrun() -> bool:
    return bool(os.environ.get("TORCHELASTIC_RUN_ID"))


def grace_seconds() -> float:
    """``LMFORGE_ORPHAN_GRACE_S``: a number of seconds >= 0; anything else is refused."""
    raw = os.environ.get(GRACE_ENV, "")
    if not raw.strip():
        return DEFAULT_GRACE_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:  # also NaN
        from lmforge.errors import LmforgeError

        raise LmforgeError(
            f"{GRACE_ENV}={raw!r} is not valid: give the seconds (a number >= 0, default "
            f"{DEFAULT_GRACE_S:g}) a torchrun worker may keep running after its launcher died."
        )
    return value


def end_with_launcher() -> bool:
    """Under torchrun: SIGTERM on the launcher's death, and a hard exit if that does not end this
    process within the grace period. Returns whether the watch was set up (once per process)."""
    global _armed
    if _armed or not under_torchrun():
        return False
    grace = grace_seconds()
    parent = os.getppid()
    pdeathsig = _set_parent_death_signal(signal.SIGTERM)
    _armed = True
    thread = threading.Thread(
        target=_watch, args=(parent, pdeathsig, grace), name="lmforge-launcher-watch", daemon=True
    )
    thread.start()
    return True


def _set_parent_death_signal(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _parent_gone(parent: int) -> bool:
    # Reparented (to init or a subreaper) once the parent died. (A parent of 1 from the start is not
    # taken as dead: in a container torchrun may be process 1.)
    return os.getppid() != parent


def _watch(parent: int, pdeathsig: bool, grace: float) -> None:
    while not _parent_gone(parent):
        time.sleep(POLL_S)
    died = time.monotonic()
    if not pdeathsig:  # nobody sent the SIGTERM: the usual stop, by hand
        os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(max(grace - (time.monotonic() - died), 0.0))
    with contextlib.suppress(Exception):
        print(
            f"lmforge: rank {os.environ.get('RANK', '?')} (pid {os.getpid()}): its launcher (pid {parent}) "
            f"died {grace:g} s ago and the rank has not stopped; exiting now ({GRACE_ENV} sets the wait).",
            file=sys.stderr,
            flush=True,
        )
    os._exit(EXIT_ORPHANED)
