"""One logger for the package; rank-aware so only rank 0 prints by default."""

from __future__ import annotations

import logging
import os
import sys

_CONFIGURED = False


def get_logger(name: str = "lmforge") -> logging.Logger:
    if not name.startswith("lmforge"):
        name = f"lmforge.{name}"
    return logging.getLogger(name)


def setup_logging(
    level: int | str = logging.INFO, log_file: str | None = None, all_ranks: bool = False
) -> None:
    """Configure the ``lmforge`` logger: stderr on rank 0 (or every rank), optional text log file."""
    global _CONFIGURED
    logger = logging.getLogger("lmforge")
    rank = int(os.environ.get("RANK", "0"))
    if isinstance(level, str):
        level = getattr(logging, level.upper())
    logger.setLevel(level)
    logger.propagate = False
    for h in list(logger.handlers):  # a previous run's in this process (tests, notebooks): its file is closed
        logger.removeHandler(h)
        h.close()
    fmt = logging.Formatter(
        "%(asctime)s %(levelname)s " + (f"[rank{rank}] " if all_ranks else "") + "%(message)s",
        datefmt="%H:%M:%S",
    )
    if rank == 0 or all_ranks:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(fmt)
        logger.addHandler(h)
    if log_file and (rank == 0 or all_ranks):
        fh = logging.FileHandler(log_file)
        fh.setFormatter(fmt)
        logger.addHandler(fh)
    _CONFIGURED = True
