"""Hang detection: a stalled rank makes the whole job exit, naming the rank and its phase.

A rank that stops making progress (a deadlock, a stuck file system, a lost peer) would otherwise
hold every other rank in its next collective until someone kills the job. Each rank publishes its
current *phase* ("step 12: forward, backward, optimizer", "after step 12: callbacks and checkpoint
save", ...) to the process group's store; a watchdog thread exits the process when one phase lasts
longer than ``parallelism.process_group_timeout``. Before exiting it reads every rank's phase, so the
message names the rank(s) that stalled and where — also on the ranks that were only waiting for
them. torchrun (``--max-restarts``) then restarts the job, which resumes from its newest checkpoint
(``checkpoint.auto_resume``).

Phases that wait for the other ranks on purpose (the stop agreement between steps) are marked
*waiting*: a rank in such a phase blames the ranks that are not.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

from lmforge.train.callbacks.base import TrainerCallback
from lmforge.utils.logging import get_logger

logger = get_logger("lmforge.train.watchdog")

EXIT_HANG = 3  # torchrun restarts on any non-zero status; this one says "hang" in its logs
_KEY = "lmforge/phase/{rank}"


class HangWatchdog(TrainerCallback):
    order = 1  # begin hooks early (the phase starts before other callbacks run)

    def __init__(self, timeout_s: float, rank: int, world_size: int, store: Any = None) -> None:
        self.timeout_s = float(timeout_s)
        self.rank, self.world_size, self.store = rank, world_size, store
        self.phase = "start-up"
        self.waiting = False
        self.since = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- phases (the trainer's hooks) ---------------------------------------------------------

    def enter(self, phase: str, waiting: bool = False) -> None:
        self.phase, self.waiting, self.since = phase, waiting, time.monotonic()
        if self.store is not None:
            # A store that is gone is not reported here: the collective that follows reports the failure.
            # Nor is it tried again (torchrun's agent hosts it: once the launcher died, every try
            # would print torch's warning and stack again while the ranks stop).
            try:
                self.store.set(
                    _KEY.format(rank=self.rank),
                    json.dumps({"phase": phase, "waiting": waiting, "t": time.time()}),
                )
            except Exception:
                self.store = None

    def on_train_begin(self, args: Any, state: Any, **kwargs: Any) -> None:
        self.enter(
            f"before step {state.global_step + 1}: first stop agreement (waits for all ranks)", waiting=True
        )
        self._thread = threading.Thread(target=self._watch, name="lmforge-hang-watchdog", daemon=True)
        self._thread.start()

    def on_step_begin(self, args: Any, state: Any, **kwargs: Any) -> None:
        self.enter(f"step {state.global_step + 1}: data, forward, backward, optimizer")

    def on_step_end(self, args: Any, state: Any, **kwargs: Any) -> None:
        self.enter(f"after step {state.global_step}: callbacks (logging, evaluation, checkpoint save)")

    def on_train_end(self, args: Any, state: Any, **kwargs: Any) -> None:
        self.enter("train end: final checkpoint save, summary")

    def on_end(self, args: Any, state: Any, **kwargs: Any) -> None:
        self._stop.set()

    # -- the watch ----------------------------------------------------------------------------

    def _watch(self) -> None:
        interval = min(2.0, max(self.timeout_s / 20, 0.05))
        while not self._stop.wait(interval):
            stalled = time.monotonic() - self.since
            if stalled > self.timeout_s:
                message = self.diagnose(stalled)
                if self.rank == 0:
                    logger.error(message)  # stderr and train.log
                else:  # other ranks log nothing (utils/logging.py); this must reach the job's log
                    print(f"lmforge train: error: {message}", file=sys.stderr, flush=True)
                for handler in logger.handlers + getattr(logger.parent, "handlers", []):
                    handler.flush()
                os._exit(EXIT_HANG)

    def peer_phases(self) -> dict[int, dict[str, Any]]:
        """Every rank's last published phase that the store holds (best effort, never blocks)."""
        out: dict[int, dict[str, Any]] = {}
        if self.store is None:
            return out
        for r in range(self.world_size):
            key = _KEY.format(rank=r)
            try:
                if self.store.check([key]):
                    out[r] = json.loads(self.store.get(key))
            except Exception:
                break
        return out

    def diagnose(self, stalled: float, failure: str | None = None) -> str:
        limit = f"parallelism.process_group_timeout = {self.timeout_s:g} s"
        phases = self.peer_phases()
        now = time.time()
        culprits = {r: p for r, p in phases.items() if not p.get("waiting") and r != self.rank}
        missing = [r for r in range(self.world_size) if r not in phases and r != self.rank]
        what = f"failed ({failure})" if failure else f"made no progress for {stalled:.0f} s ({limit})"
        head = f"rank {self.rank} {what} in phase '{self.phase}'."
        if self.waiting and (culprits or missing):
            blamed = [
                f"rank {r} in '{p['phase']}' for {now - p['t']:.0f} s" for r, p in sorted(culprits.items())
            ]
            blamed += [f"rank {r} (no phase reported)" for r in missing]
            head += (
                " It was waiting for " + "; ".join(blamed[:8]) + ("; ..." if len(blamed) > 8 else "") + "."
            )
        elif not self.waiting and failure is None:
            head += f" Rank {self.rank} itself is stalled here."
        others = [f"{r}: {p['phase']}" for r, p in sorted(phases.items()) if r != self.rank]
        if others and not (self.waiting and culprits):
            head += " Other ranks: " + "; ".join(others[:8]) + ("; ..." if len(others) > 8 else "") + "."
        return (
            head + " The job exits so that torchrun (--max-restarts) can restart it; the restart resumes "
            "from the newest complete checkpoint (checkpoint.auto_resume)."
        )


class StopAgreementMarker(TrainerCallback):
    """Marks the end of a step's callbacks: from here the rank waits in the stop agreement."""

    order = 99  # after every other on_step_end callback

    def __init__(self, watchdog: HangWatchdog) -> None:
        self.watchdog = watchdog

    def on_step_end(self, args: Any, state: Any, **kwargs: Any) -> None:
        self.watchdog.enter(
            f"after step {state.global_step}: stop agreement (waits for all ranks)", waiting=True
        )


def hang_watchdog(timeout_s: float, rank: int, world_size: int) -> list[TrainerCallback]:
    """The watchdog callbacks of a distributed run (none on one process: nothing can wait there)."""
    if world_size <= 1:
        return []
    from torch.distributed.distributed_c10d import _get_default_store

    try:
        store = _get_default_store()
    except Exception:
        store = None
    dog = HangWatchdog(timeout_s, rank, world_size, store)
    return [dog, StopAgreementMarker(dog)]


def active_watchdog(trainer: Any) -> HangWatchdog | None:
    for cb in getattr(getattr(trainer, "callbacks", None), "callbacks", []):
        if isinstance(cb, HangWatchdog):
            return cb
    return None
