"""scripts/: the per-node launcher on 2 "nodes" of 1 process (c10d rendezvous on 127.0.0.1), the
SLURM batch script with stand-ins for srun and scontrol, and SIGTERM to the launcher.

What is tested for SLURM: the batch script's own logic (head node, node count, rendezvous, srun
line, signal forwarding) with a fake ``srun`` that starts the given command once per node on this
machine, and a fake ``scontrol``. Real SLURM is not available here.
"""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from .helpers import job_config, kill_group, losses, worker_env

REPO = Path(__file__).resolve().parents[3]
LAUNCHER = REPO / "scripts" / "lmforge-torchrun.sh"
SLURM = REPO / "scripts" / "slurm" / "lmforge.slurm"


def free_port() -> int:
    """A free port below the kernel's ephemeral range, for a rendezvous that torchrun binds later.

    A port the kernel handed out (bind to 0) may be handed out again, to any process's connection,
    before torchrun binds it seconds later: on a machine busy with other distributed tests the
    rendezvous then fails. Ports below the range are only ever taken by an explicit bind.
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    for port in random.sample(range(max(low - 12_000, 1024), max(low, 1025)), 200) if low > 2048 else []:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_env(**extra: str) -> dict[str, str]:
    import sys

    return worker_env(PYTHON=sys.executable, TORCHRUN_ARGS="--monitor-interval=0.2", **extra)


def run_nodes(nnodes: int, args: list[str], timeout: float = 180, **extra: str) -> list[str]:
    port = free_port()
    env = launcher_env(
        NNODES=str(nnodes), NPROC_PER_NODE="1", RDZV_ENDPOINT=f"127.0.0.1:{port}", RDZV_ID="t", **extra
    )
    procs = [
        subprocess.Popen(
            [str(LAUNCHER), *args],
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group, so a timeout can end all of it
        )
        for _ in range(nnodes)
    ]
    deadline = time.monotonic() + timeout
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=max(deadline - time.monotonic(), 1))[0])
    except subprocess.TimeoutExpired:
        for p in procs:  # the launcher and its torchrun and workers: the whole process group
            kill_group(p)
        raise
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    return outs


def handles_sigterm(pid: int) -> bool:
    """Whether the process catches SIGTERM (bit 14 of SigCgt in /proc/PID/status)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next((line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), "0")
    return bool((int(mask, 16) >> (signal.SIGTERM - 1)) & 1)


def wait_for_steps(proc: subprocess.Popen, root: Path, steps: int, timeout: float = 180) -> None:
    """Until the job started with stdout=PIPE logged ``steps`` steps; a failure shows its output."""
    deadline = time.monotonic() + timeout
    while len(losses(root)) < steps:
        if proc.poll() is not None or time.monotonic() > deadline:
            kill_group(proc)
            try:
                out = proc.communicate(timeout=30)[0]
            except subprocess.TimeoutExpired:
                out = "(no output: the pipe stayed open)"
            pytest.fail(f"training did not start (exit status {proc.returncode}):\n{out[-4000:]}")
        time.sleep(0.2)


def test_launcher_prints_the_torchrun_line():
    env = launcher_env(NNODES="4", NPROC_PER_NODE="8", RDZV_ENDPOINT="node1:29400", LMFORGE_PRINT_ONLY="1")
    out = subprocess.run(
        [str(LAUNCHER), "train", "--config", "x.yaml"], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    line = out.stdout
    for part in ("--nnodes 4", "--nproc-per-node 8", "--rdzv-backend c10d", "--rdzv-endpoint node1:29400"):
        assert part in line
    assert line.rstrip().endswith("-m lmforge train --config x.yaml")


@pytest.mark.slow
@pytest.mark.distributed
def test_two_nodes_meet_through_the_c10d_rendezvous():
    outs = run_nodes(2, ["env"])
    table = next(o for o in outs if "world size" in o)  # printed by global rank 0, on either "node"
    assert "world size      : 2 rank(s) on 2 node(s)" in table, table
    assert "node 0:" in table and "node 1:" in table and table.count(": 1 rank(s):") == 2


@pytest.mark.slow
@pytest.mark.distributed
def test_slurm_script_with_fake_srun(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # srun: start the command once per node of the job, as SLURM would on each node.
    (bin_dir / "srun").write_text(
        "#!/usr/bin/env bash\n"
        "while [[ $1 == --* ]]; do shift; done\n"
        'pids=(); for ((i = 0; i < SLURM_JOB_NUM_NODES; i++)); do SLURM_NODEID=$i "$@" & pids+=($!); done\n'
        "trap 'kill -TERM \"${pids[@]}\"' TERM\n"
        'status=0; for p in "${pids[@]}"; do wait "$p" || status=$?; done; exit $status\n'
    )
    (bin_dir / "scontrol").write_text("#!/usr/bin/env bash\necho 127.0.0.1\necho 127.0.0.2\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    cfg = job_config(tmp_path / "job", steps=3)
    env = launcher_env(
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        CONFIG=cfg,
        SLURM_JOB_NODELIST="fake[1-2]",
        SLURM_JOB_NUM_NODES="2",
        SLURM_JOB_ID="4242",
        SLURM_SUBMIT_DIR=str(REPO),
        NPROC_PER_NODE="1",
        RDZV_ENDPOINT=f"127.0.0.1:{free_port()}",
        OMP_NUM_THREADS="1",
    )
    job = subprocess.Popen(
        ["bash", str(SLURM)],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = job.communicate(timeout=240)
    finally:
        kill_group(job)  # nothing is left running, also when the job timed out
    assert job.returncode == 0, (stdout + stderr)[-3000:]
    assert "lmforge: 2 node(s) x 1" in stdout
    assert "parallel: world=2" in stderr
    assert [s for s, _ in losses(tmp_path / "job")] == [1, 2, 3]


def start_long_job(tmp_path) -> subprocess.Popen:
    """A 2-rank job through the launcher script that trains until stopped, saving only when it stops."""
    cfg = job_config(tmp_path, steps=10_000, checkpoint={"save_interleaved_steps": 100_000})
    env = launcher_env(NPROC_PER_NODE="2", RDZV_ENDPOINT=f"127.0.0.1:{free_port()}")
    return subprocess.Popen(
        [str(LAUNCHER), "train", "--config", cfg],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


@pytest.mark.slow
@pytest.mark.distributed
def test_sigterm_to_the_launcher_saves_once_on_all_ranks_and_exits_0(tmp_path):
    proc = start_long_job(tmp_path)
    try:
        wait_for_steps(proc, tmp_path, 3)
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=120)[0]
    finally:
        kill_group(proc)  # nothing is left running, whatever happened
    assert proc.returncode == 0, out[-3000:]
    saved = sorted(p.name for p in (tmp_path / "ckpt").glob("iteration_*"))
    last_step = losses(tmp_path)[-1][0]
    assert saved == [f"iteration_{last_step:08d}"], (saved, last_step)  # one save, at the stop step
    shards = sorted(p.name for p in (tmp_path / "ckpt" / saved[0]).glob("*.distcp"))
    assert len(shards) == 2, shards  # both ranks wrote their part of the same checkpoint
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == str(last_step)
    assert out.count("Saved checkpoint of step") == 1 and "received SIGTERM" in out


@pytest.mark.slow
@pytest.mark.distributed
def test_two_nodes_restart_together_and_resume(tmp_path):
    # Rank 1 dies on attempt 0. Only its node's agent counts a restart (TORCHELASTIC_RESTART_COUNT);
    # the other node restarts its worker as a membership change with the count still 0. Both ranks
    # must still agree that this is a restart and resume from the same checkpoint.
    cfg = job_config(tmp_path, steps=5, faults=[{"kind": "kill", "step": 3, "rank": 1, "attempt": 0}])
    outs = run_nodes(2, ["train", "--config", cfg], timeout=300, MAX_RESTARTS="1")
    log = "\n".join(outs)
    assert "elastic restart 1: resuming from the latest complete checkpoint" in log and "(iteration 2)" in log
    assert "iteration_00000002 at step 2" in log
    assert [s for s, _ in losses(tmp_path)] == [1, 2, 3, 4, 5]


@pytest.mark.slow
@pytest.mark.distributed
def test_sigterm_before_the_workers_started_waits_for_them_and_stops_the_job(tmp_path):
    # Sent at once, the signal would reach nobody (torchrun has no workers yet) or kill a worker in
    # its first seconds (torchrun restarts it); the script holds it until each worker handles it.
    proc = start_long_job(tmp_path)
    try:
        # As soon as the script handles SIGTERM (its trap, set before it starts torchrun).
        deadline = time.monotonic() + 30
        while not handles_sigterm(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=150)[0]
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out[-3000:]
    # Each rank got it during start-up or once training began (whichever came first on that rank),
    # and no worker was killed by it (torchrun would report its exitcode and restart it). Rank 0's
    # summary names its own signal, or the stop another rank asked for first (a race: both are right).
    assert "received SIGTERM" in out and "exitcode" not in out, out[-3000:]
    assert re.search(r"stopped early \((received SIGTERM|stop requested on another rank)", out), out[-3000:]
    # The stop was agreed before the first step: the initial state is saved, once, by both ranks.
    saved = sorted(p.name for p in (tmp_path / "ckpt").glob("iteration_*"))
    assert saved == ["iteration_00000000"], saved
    assert len(list((tmp_path / "ckpt" / saved[0]).glob("*.distcp"))) == 2
    assert losses(tmp_path) == []
