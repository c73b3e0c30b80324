"""``lmforge env``: what a rank sees — world, ranks per node, devices, backend, versions.

lmforge env [--json] [--no-collective] [--timeout SECONDS]
torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:PORT -m lmforge env

Under torchrun every rank joins the process group (the same start-up as ``lmforge train``), all
ranks' views are gathered, and rank 0 prints one table: a rank that cannot join, a node with the
wrong number of ranks, or a missing device shows up here before a long job is queued.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
from typing import Any

ENV_KEYS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "CUDA_VISIBLE_DEVICES",
    "OMP_NUM_THREADS",
    "SLURM_JOB_ID",
    "SLURM_NODEID",
)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "env",
        help="print what this process (or every rank under torchrun) sees: world, nodes, devices, versions",
        description=(
            "Print the distributed environment of this process: rank, world size, ranks per node, devices, "
            "backend and versions. Under torchrun every rank joins the process group and rank 0 prints the "
            "view of all ranks."
        ),
    )
    parser.add_argument(
        "--json", action="store_true", help="print JSON (one object; under torchrun from rank 0)"
    )
    parser.add_argument(
        "--no-collective",
        action="store_true",
        help="do not join the process group; each rank prints only its own view",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="how long to wait for every rank to join (default 300)",
    )
    parser.set_defaults(func=run)


def rank_view() -> dict[str, Any]:
    """This process's view, without touching the process group."""
    import torch

    import lmforge
    from lmforge.utils import malloc
    from lmforge.utils.elastic import launch_env

    launch = launch_env()  # RANK=abc, WORLD_SIZE without MASTER_ADDR, ...: a clear error, exit 2
    cuda = torch.cuda.is_available()
    devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []
    local_rank = launch.local_rank
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "rank": launch.rank,
        "local_rank": local_rank,
        "world_size": launch.world_size,
        "local_world_size": launch.local_world_size,
        "node_rank": launch.node_rank,
        "device": f"cuda:{local_rank}" if cuda else "cpu",
        "visible_devices": devices,
        "cpu_threads": torch.get_num_threads(),
        "allocator": malloc.status,
        "backend": "nccl" if cuda else "gloo",
        "versions": {
            "lmforge": lmforge.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        },
        "env": {k: os.environ[k] for k in ENV_KEYS if k in os.environ},
    }


def gather_views(view: dict[str, Any], timeout_s: float) -> list[dict[str, Any]]:
    """Every rank's view (on every rank), after joining the process group as ``lmforge train`` does."""
    import torch.distributed as dist

    from lmforge.utils.elastic import init_process_group

    init_process_group(view["backend"], view["rank"], view["world_size"], timeout_s)
    try:
        if view["backend"] == "nccl":
            import torch

            torch.cuda.set_device(view["local_rank"])
        views: list[Any] = [None] * view["world_size"]
        dist.all_gather_object(views, view)
        return views
    finally:
        dist.destroy_process_group()


def summarize(views: list[dict[str, Any]]) -> dict[str, Any]:
    by_node: dict[str, list[int]] = {}
    for v in views:
        by_node.setdefault(f"{v['node_rank']}:{v['host']}", []).append(v["rank"])
    versions = {json.dumps(v["versions"], sort_keys=True) for v in views}
    return {
        "world_size": len(views),
        "nodes": len(by_node),
        "ranks_per_node": {node: sorted(ranks) for node, ranks in sorted(by_node.items())},
        "backend": views[0]["backend"],
        "same_versions_everywhere": len(versions) == 1,
        "ranks": sorted(views, key=lambda v: v["rank"]),
    }


def format_table(summary: dict[str, Any]) -> str:
    first = summary["ranks"][0]
    lines = [
        f"world size      : {summary['world_size']} rank(s) on {summary['nodes']} node(s)",
        f"backend         : {summary['backend']}",
        "versions        : " + ", ".join(f"{k} {v}" for k, v in first["versions"].items() if v),
        f"allocator       : {first['allocator']}",
    ]
    if not summary["same_versions_everywhere"]:
        lines.append("WARNING         : the ranks run different versions (see --json)")
    for node, ranks in summary["ranks_per_node"].items():
        lines.append(f"node {node:<11}: {len(ranks)} rank(s): {', '.join(map(str, ranks))}")
    lines.append("")
    lines.append(
        f"{'rank':>4} {'local':>5} {'node':>4}  {'host':<20} {'device':<8} {'threads':>7}  visible devices"
    )
    for v in summary["ranks"]:
        devices = ", ".join(v["visible_devices"]) or "-"
        lines.append(
            f"{v['rank']:>4} {v['local_rank']:>5} {v['node_rank']:>4}  {v['host'][:20]:<20} "
            f"{v['device']:<8} {v['cpu_threads']:>7}  {devices}"
        )
    env = first["env"]
    if env:
        lines.append("")
        lines.append("rank 0 environment: " + " ".join(f"{k}={v}" for k, v in env.items()))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import math

    from lmforge.config.sections_parallel import MAX_WAIT_S as MAX_TIMEOUT_S
    from lmforge.errors import ConfigError

    # Checked on every rank and world size, so that a value that would fail under torchrun (timedelta of
    # NaN is a ValueError; 0 or less gives up at once) fails the same way on one process.
    if not (math.isfinite(args.timeout) and 0 < args.timeout <= MAX_TIMEOUT_S):
        raise ConfigError(
            f"--timeout {args.timeout:g}: expected the seconds to wait for every rank to join, a number in "
            f"(0, {MAX_TIMEOUT_S:g}] (default 300)."
        )
    view = rank_view()
    distributed = view["world_size"] > 1 and not args.no_collective
    views = gather_views(view, args.timeout) if distributed else [view]
    if distributed and view["rank"] != 0:
        return 0
    summary = summarize(views)
    sys.stdout.write((json.dumps(summary, indent=2) if args.json else format_table(summary)) + "\n")
    sys.stdout.flush()
    return 0
