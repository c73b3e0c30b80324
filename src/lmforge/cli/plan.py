"""``lmforge plan --config FILE --gpus N --gpu-memory 80GiB [--nodes K]``: layouts that fit, fastest first.

Prints the layouts (dp replicate/shard, tp, pp, cp, ep, recompute, micro-batch) whose estimated
per-GPU memory (the same code as ``lmforge check``) fits, ranked by an estimated step time (FLOPs,
communication volume over documented bandwidths, pipeline bubbles; see
:mod:`lmforge.tools.planner`), then the YAML ``parallelism`` / ``recompute`` blocks of the best few.
When nothing fits it says so and shows the layouts that come closest.
"""

from __future__ import annotations

import argparse
from typing import Any

from lmforge.cli.options import add_set_option


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan",
        help="list the parallel layouts that fit N GPUs, fastest first",
        description=(
            "List the layouts that fit the given GPUs, ranked by an estimated step time (FLOPs, communication "
            "volume, pipeline bubbles), and print the YAML parallelism/recompute blocks of the best few. "
            "Memory figures use the same estimate as `lmforge check`."
        ),
    )
    p.add_argument("--config", required=True, metavar="FILE", help="the train.yaml")
    add_set_option(p, "training.global_batch_size=1024")
    p.add_argument("--gpus", required=True, type=int, help="number of GPUs")
    p.add_argument("--gpu-memory", required=True, help="memory per GPU, e.g. 80GiB")
    p.add_argument("--nodes", type=int, default=None, help="number of nodes (default: GPUs / 8)")
    p.add_argument("--gpu-tflops", type=float, default=989.0, help="dense bf16 TFLOP/s per GPU (default 989)")
    p.add_argument(
        "--efficiency", type=float, default=0.5, help="fraction of peak FLOP/s reached (default 0.5)"
    )
    p.add_argument(
        "--intra-node-gbps", type=float, default=200.0, help="GB/s per GPU inside a node (default 200)"
    )
    p.add_argument(
        "--inter-node-gbps", type=float, default=25.0, help="GB/s per GPU between nodes (default 25)"
    )
    p.add_argument(
        "--latency-us", type=float, default=20.0, help="µs per critical-path collective (default 20)"
    )
    p.add_argument("--top", type=int, default=10, help="layouts listed (default 10); YAML for the best 3")
    p.set_defaults(func=run)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


# flag -> (attribute, lowest value, whether the lowest is allowed, highest allowed, what it is)
_HARDWARE_FLAGS = (
    (
        "--gpu-tflops",
        "gpu_tflops",
        0.0,
        False,
        None,
        "a number > 0 (dense bf16 TFLOP/s per GPU; default 989)",
    ),
    (
        "--efficiency",
        "efficiency",
        0.0,
        False,
        1.0,
        "a number in (0, 1] (the fraction of peak FLOP/s reached; default 0.5)",
    ),
    (
        "--intra-node-gbps",
        "intra_node_gbps",
        0.0,
        False,
        None,
        "a number > 0 (GB/s per GPU inside a node; default 200)",
    ),
    (
        "--inter-node-gbps",
        "inter_node_gbps",
        0.0,
        False,
        None,
        "a number > 0 (GB/s per GPU between nodes; default 25)",
    ),
    (
        "--latency-us",
        "latency_us",
        0.0,
        True,
        None,
        "a number >= 0 (µs per critical-path collective; default 20)",
    ),
)


def _check_hardware_flags(args: argparse.Namespace) -> None:
    """The step-time model divides by the rates and adds the latency: a zero rate would divide by zero, and a
    negative or NaN value would rank the layouts by nonsense, so each is refused naming its flag."""
    import math

    from lmforge.errors import ConfigError

    for flag, attr, low, low_ok, high, what in _HARDWARE_FLAGS:
        v = getattr(args, attr)
        if not math.isfinite(v) or v < low or (v == low and not low_ok) or (high is not None and v > high):
            raise ConfigError(f"{flag} {v:g}: expected {what}.")
    if args.top < 1:
        raise ConfigError(f"--top {args.top}: expected the number of layouts to list, >= 1 (default 10).")


def run(args: argparse.Namespace) -> int:
    from lmforge.config import load_config
    from lmforge.errors import ConfigError
    from lmforge.tools.memory import format_bytes
    from lmforge.tools.planner import Hardware, parse_memory, plan

    if args.gpus < 1:
        raise ConfigError(f"--gpus must be a positive integer, got {args.gpus}.")
    if args.nodes is not None and args.nodes < 1:
        raise ConfigError(
            f"--nodes must be a positive integer (or left out for --gpus / 8), got {args.nodes}."
        )
    nodes = args.nodes if args.nodes is not None else max(1, -(-args.gpus // 8))
    if args.gpus % nodes:
        raise ConfigError(
            f"--nodes {nodes} must divide --gpus {args.gpus} (the same number of GPUs on every node)."
        )
    _check_hardware_flags(args)
    hw = Hardware(
        gpus=args.gpus,
        gpu_memory=parse_memory(args.gpu_memory),
        nodes=nodes,
        gpu_tflops=args.gpu_tflops,
        efficiency=args.efficiency,
        intra_node_gbps=args.intra_node_gbps,
        inter_node_gbps=args.inter_node_gbps,
        latency_us=args.latency_us,
    )
    cfg = load_config(args.config, args.overrides)
    fits, misses, facts = plan(cfg, hw)
    gbs = int(cfg.training.global_batch_size)
    if not fits and not misses:
        raise ConfigError(
            f"no parallel layout of --gpus {hw.gpus} ({hw.nodes} node(s)) can run this model at "
            f"training.global_batch_size {gbs}: a layout needs data_parallel x local_batch_size (1, 2 or 4) "
            f"to divide the global batch, tensor_parallel to divide the attention heads "
            f"({facts.num_heads}) and pipeline_parallel to split the layers ({facts.num_layers}), "
            "with cp <= 8 and tp <= 8 and the GPUs per node. Give a --gpus that factors so, or a larger "
            "global batch (--set training.global_batch_size=N)."
        )
    print(
        f"lmforge plan: {args.config}: {_count(facts.total_params)} parameters, {facts.num_layers} layers, "
        f"seq {facts.seq_length}, global batch {gbs}; {hw.gpus} GPUs x {format_bytes(hw.gpu_memory)} on {hw.nodes} "
        f"node(s); {hw.gpu_tflops:g} TFLOP/s x {hw.efficiency:g}, {hw.intra_node_gbps:g} GB/s in a node, "
        f"{hw.inter_node_gbps:g} GB/s between nodes"
    )
    header = f"{'#':>3}  {'tp':>2} {'pp':>3} {'cp':>2} {'ep':>3} {'dp_shard':>8} {'dp_repl':>7} {'recompute':>9} {'lbs':>3}  {'memory/GPU':>11}  {'step (s)':>9}  where the time goes"
    if not fits:
        print(f"no layout fits {format_bytes(hw.gpu_memory)} per GPU. Closest (smallest memory first):")
        rows = misses[: args.top]
    else:
        print(f"{len(fits)} layout(s) fit; fastest first:")
        rows = fits[: args.top]
    print(header)
    for i, p in enumerate(rows, 1):
        lay = p.layout
        parts = ", ".join(f"{k} {v:.3g}" for k, v in p.parts.items() if v > 0.0005 * p.step_time)
        print(
            f"{i:>3}  {lay.tp:>2} {lay.pp:>3} {lay.cp:>2} {lay.ep:>3} {lay.dp_shard:>8} {lay.dp_replicate:>7} "
            f"{lay.recompute:>9} {lay.local_batch_size:>3}  {format_bytes(p.memory):>11}  {p.step_time:>9.3g}  {parts}"
        )
    if fits:
        for i, p in enumerate(fits[:3], 1):
            print(f"\n# layout {i}: {format_bytes(p.memory)} per GPU, ~{p.step_time:.3g} s per step")
            print(p.layout.yaml(facts.num_layers))
    return 0
