"""Publishing a ``.bin``/``.idx`` pair over an existing one so that a crash at any point leaves a
complete pair: the new one, or the previous one restored by the next writer of that prefix.

Order (every step a rename, the directory fsynced at the end):

1. the previous ``PREFIX.idx`` -> ``PREFIX.idx.old``, then ``PREFIX.bin`` -> ``PREFIX.bin.old``;
2. the new ``.bin`` into place, then the new ``.idx`` — its presence is the commit point;
3. the ``.old`` pair removed.

:func:`recover_publish`: with an ``.old`` file present, a ``PREFIX.idx`` means step 2 completed (the
leftovers are removed); no ``PREFIX.idx`` means it did not (the ``.old`` files are put back, over a
new ``.bin`` that came without its index). :func:`remove_stale_temporaries` deletes the
``*.tmp-PID`` files of writers that are no longer running (a SIGKILL gives no chance to clean up).
"""

from __future__ import annotations

import glob
import os

from lmforge.utils.atomic import fsync_dir
from lmforge.utils.logging import get_logger
from lmforge.utils.pids import pid_alive

logger = get_logger("lmforge.data")


def _old(path: str) -> str:
    return f"{path}.old"


def publish_pair(tmp_bin: str, tmp_idx: str, bin_file: str, idx_file: str) -> None:
    for live in (idx_file, bin_file):
        if os.path.exists(live):
            os.replace(live, _old(live))
    os.replace(tmp_bin, bin_file)
    os.replace(tmp_idx, idx_file)
    for live in (bin_file, idx_file):
        if os.path.exists(_old(live)):
            os.remove(_old(live))
    fsync_dir(os.path.dirname(bin_file) or ".")


def recover_publish(bin_file: str, idx_file: str) -> None:
    """Finish or undo a publish that a crash interrupted (see the module docstring)."""
    old = [p for p in (bin_file, idx_file) if os.path.exists(_old(p))]
    if not old:
        return
    if os.path.exists(idx_file):
        for live in old:
            os.remove(_old(live))
        logger.warning(
            "%s: removed the previous pair left by an interrupted publish (the new one is complete).",
            idx_file,
        )
    else:
        for live in old:
            os.replace(_old(live), live)
        logger.warning(
            "%s: a publish was interrupted before its index was in place; the previous dataset was restored.",
            idx_file,
        )
    fsync_dir(os.path.dirname(bin_file) or ".")


def remove_stale_temporaries(*paths: str) -> list[str]:
    """Delete ``{path}.tmp-PID`` files whose writer process is gone; returns what was removed."""
    removed = []
    for path in paths:
        for tmp in glob.glob(f"{glob.escape(path)}.tmp-*"):
            pid = tmp.rsplit(".tmp-", 1)[1]
            if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
                os.remove(tmp)
                removed.append(tmp)
    if removed:
        logger.warning(
            "Removed %d temporary file(s) of an interrupted writer: %s", len(removed), ", ".join(removed)
        )
    return removed
