"""Stopping a run: a rank's wish (a signal, :meth:`StopAgreement.request`), agreed by every rank before
a step, so that all ranks stop after the same step (and save it together)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from lmforge.train.parallel_seam import ParallelContext
from lmforge.utils.logging import get_logger

logger = get_logger("lmforge.train")


class StopAgreement:
    """A run's stop state. ``requested`` is this rank's wish (a signal, :meth:`request`); ``stopping``
    is what all ranks agreed at the last agreement. Only ``stopping`` may change what a rank does next."""

    def __init__(self) -> None:
        self.requested = False
        self.stopping = False
        self.reason: str | None = None
        self.signal = 0  # the number of the last stop signal this rank received (0: none)

    def request(self, reason: str) -> None:
        """Ask the run to stop: all ranks agree on it before the next step, save and stop.

        Safe inside a signal handler: it only sets flags (no logging, no I/O, no collective).
        """
        self.reason = self.reason or reason
        self.requested = True

    def stop_now(self, reason: str) -> None:
        """Stop after this step on this rank, agreed already (every rank reached the same verdict)."""
        self.reason = reason
        self.requested = self.stopping = True

    def agreed(self, ctx: ParallelContext, recovery: Any, step: int) -> bool:
        """Every rank stops at the same step, even if only one received the signal.

        Called at one fixed point of the loop, before each step, on every rank: an all-reduce (MAX)
        of [this rank wants to stop, the signal it received]. Everything a rank does differently on
        stopping (breaking out of the loop, the final save) follows the agreed value, never the local
        flag: a signal handled during a step, or right after this all-reduce, is only acted on at the
        next agreement, so no rank can enter a save's collectives while another trains on.
        """
        if self.stopping:
            return True
        votes = [1 if self.requested else 0, self.signal]
        if recovery is not None:  # recovery's rollback vote rides on the same all-reduce
            votes += recovery.vote_values()
        if ctx.distributed:
            flag = torch.tensor(votes, dtype=torch.int64, device=ctx.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            votes = [int(v) for v in flag.tolist()]
        agreed, signum = bool(votes[0]), votes[1]
        if recovery is not None:
            recovery.agree(votes[2:])
        if not agreed:
            return False
        if signum and self.signal != signum:  # the strongest signal any rank received
            self.reason = f"received {signal.Signals(signum).name} (on another rank)"
        self.reason = self.reason or "stop requested on another rank"
        self.requested = self.stopping = True
        logger.warning(
            "%s: all ranks stop after step %d (with a checkpoint of it when saving is on).",
            self.reason,
            step,
        )
        return True

    @contextlib.contextmanager
    def signals_handled(self) -> Iterator[None]:
        """SIGTERM and SIGINT request a stop while inside (main thread only); a second Ctrl-C stops at once."""
        previous = self._install_signal_handlers()
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _install_signal_handlers(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        previous = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.getsignal(sig)

            def handler(signum: int, frame: Any, _prev: Any = previous[sig]) -> None:
                if self.requested and signum == signal.SIGINT:
                    raise KeyboardInterrupt  # a second Ctrl-C stops at once
                # Flags only: the stop is agreed and logged at the next fixed point of the loop.
                self.signal = max(self.signal, int(signum))
                self.request(f"received {signal.Signals(signum).name}")

            signal.signal(sig, handler)
        return previous
