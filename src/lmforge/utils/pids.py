"""Whether a process still runs: stale temporaries and locks are recognised by their writer's pid."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True while process ``pid`` exists on this host (also when it belongs to another user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
