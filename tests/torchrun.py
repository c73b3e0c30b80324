"""``lmforge train`` under torchrun (gloo, CPU), blocking: the one launcher of the tests that need a job
of several ranks and read back what it wrote (tests/end_to_end/elastic/helpers.py starts jobs it signals or kills
while they run)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent


def torchrun(
    nproc: int,
    cfg: str,
    *overrides: str,
    max_restarts: int = 0,
    import_dirs: tuple[str | Path, ...] = (),
    check: bool = True,
    timeout: float = 400,
) -> subprocess.CompletedProcess:
    """Train ``cfg`` (each override a ``--set``) on ``nproc`` ranks; the finished process.

    The rendezvous is ``--standalone``: the launcher binds a port the kernel picks and holds it, so jobs
    never collide (a fixed ``--master-port`` is taken whenever another job of this or another test run
    uses it on the machine). ``import_dirs`` go on the workers' PYTHONPATH with imports from the YAML allowed (test-only callbacks named in it).
    ``check``: assert that the job succeeded (its stderr's end in the message).
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    cmd += ["--standalone"]
    if max_restarts:
        cmd += [f"--max-restarts={max_restarts}", "--monitor-interval=0.2"]
    cmd += ["-m", "lmforge", "train", "--config", cfg]
    for o in overrides:
        cmd += ["--set", o]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if import_dirs:
        paths = [str(p) for p in import_dirs] + [env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        env["LMFORGE_ALLOW_IMPORTS"] = "1"
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if check:
        assert r.returncode == 0, r.stderr[-3000:]
    return r
