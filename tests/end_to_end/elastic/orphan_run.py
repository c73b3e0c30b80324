"""A stand-in launcher is SIGKILLed under a worker that ignores SIGTERM (for test_launcher_death.py).

PYTHONPATH=src:tests python -m end_to_end.elastic.orphan_run reaper DIR [poll]

``reaper`` makes itself the subreaper of what it starts (so the orphaned worker becomes its child and
its exit status can be read), starts ``launcher``, which starts ``worker`` with torchrun's variable
set; the worker arms lmforge.utils.launcher_death, notes any SIGTERM in DIR/sigterm and otherwise
ignores it. The reaper SIGKILLs the launcher and prints, as JSON, how the worker ended. With
``poll`` the worker does without prctl (as off Linux): only the watch thread notices the death.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36


def reaper(root: Path, mode: str) -> int:
    assert ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    cmd = [sys.executable, "-m", "end_to_end.elastic.orphan_run", "launcher", str(root), mode]
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    worker = int(launcher.stdout.readline())  # printed once the worker armed the watch
    # The clock starts before the kill: the worker's grace period starts when it sees its parent die,
    # which can be before this process returns from wait() (descheduled on a busy machine), and the
    # test's lower bound (at least the grace period) must hold however late this process runs.
    killed = time.monotonic()
    launcher.kill()
    launcher.wait()
    status = None
    while status is None and time.monotonic() - killed < 30:
        pid, raw = os.waitpid(-1, os.WNOHANG)
        if pid == worker:
            status = os.waitstatus_to_exitcode(raw)
        time.sleep(0.02)
    seconds = round(time.monotonic() - killed, 2)
    if status is None:
        os.kill(worker, signal.SIGKILL)
    print(json.dumps({"status": status, "seconds": seconds, "sigterm": (root / "sigterm").exists()}))
    return 0


def launcher(root: Path, mode: str) -> int:
    env = dict(os.environ, TORCHELASTIC_RUN_ID="orphan-test", LMFORGE_ORPHAN_GRACE_S="1")
    cmd = [sys.executable, "-m", "end_to_end.elastic.orphan_run", "worker", str(root), mode]
    worker = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert worker.stdout.readline().strip() == "armed"
    print(worker.pid, flush=True)
    while True:
        time.sleep(1)


def worker(root: Path, mode: str) -> int:
    from lmforge.utils import launcher_death
    from lmforge.utils.launcher_death import end_with_launcher

    if mode == "poll":
        launcher_death._set_parent_death_signal = lambda sig: False
    signal.signal(signal.SIGTERM, lambda *_: (root / "sigterm").touch())  # noted, then ignored
    assert end_with_launcher()
    print("armed", flush=True)
    while True:
        time.sleep(0.05)


if __name__ == "__main__":
    role, where, how = sys.argv[1], Path(sys.argv[2]), (sys.argv[3:] or ["prctl"])[0]
    sys.exit({"reaper": reaper, "launcher": launcher, "worker": worker}[role](where, how))
