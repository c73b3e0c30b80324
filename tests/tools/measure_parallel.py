"""Per-rank peak memory of training steps on 2 spawned gloo ranks (FSDP, TP, PP), beside the estimate.

Each rank builds the model as the trainer does (``lmforge.train.builder``: meta model, ``parallelize``
with the recompute hook, ``to_empty``, layout-invariant init), runs one training step under the same
storage-counting dispatch mode as the single-process cases (:mod:`.measure`; a sharded tensor counts
its local shard) and reports its peak. All cases run in one spawn, in turn.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp


def estimate_parallel(raw: dict[str, Any], world: int) -> Any:
    """``lmforge check --world-size WORLD``'s estimate for ``raw`` (the code of lmforge.tools.report)."""
    from lmforge.config import load_config
    from lmforge.models import build_model, build_model_config
    from lmforge.parallel import ParallelDims, accumulation_steps
    from lmforge.tools.memory import estimate_memory, selected_recompute_parts

    cfg = load_config(raw)
    mc = build_model_config(cfg.model)
    net = build_model(cfg.model, device="meta")
    dims = ParallelDims.from_section(cfg.parallelism, world)
    lbs = int(cfg.training.local_batch_size)
    return estimate_memory(
        net,
        dims,
        compute_dtype=getattr(net, "compute_dtype", torch.float32),
        optimizer_type=str(cfg.optimizer.type),
        seq_length=mc.seq_length,
        local_batch_size=lbs,
        hidden_size=mc.hidden_size,
        num_layers=mc.num_layers,
        vocab_size=mc.vocab_size,
        accumulation_steps=accumulation_steps(int(cfg.training.global_batch_size), lbs, dims.dp),
        recompute_select=selected_recompute_parts(net, cfg.recompute, mc.num_layers),
    )


def _measure_case(rank: int, world: int, raw: dict[str, Any]) -> int:
    from torch.utils._pytree import tree_flatten

    from lmforge.config import load_config
    from lmforge.lr import ScheduleLR, build_scheduler
    from lmforge.models import build_model, build_model_config
    from lmforge.optim import build_optimizer
    from lmforge.parallel import ParallelDims, accumulation_steps, parallelize
    from lmforge.parallel.activation import apply_activation_memory
    from lmforge.train.parallel_seam import ParallelContext
    from lmforge.train.step import TrainStep

    from .measure import LiveStorageBytes

    cfg = load_config(raw)
    torch.manual_seed(0)
    mc = build_model_config(cfg.model)
    dims = ParallelDims.from_section(cfg.parallelism, world)
    mesh = dims.build_mesh("cpu")
    lbs = int(cfg.training.local_batch_size)
    accum = accumulation_steps(int(cfg.training.global_batch_size), lbs, dims.dp)

    def hook(model: torch.nn.Module) -> None:
        apply_activation_memory(model, cfg.recompute, cfg.recompute_comm, cfg.swap, mc.num_layers)

    model = build_model(cfg.model, device="meta")
    model, info = parallelize(
        model, dims, mesh, cfg.parallelism, num_microbatches=accum, apply_activation=hook
    )
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(0)
    schedule = build_scheduler(cfg.lr_scheduler, int(cfg.training.steps))
    optimizer = build_optimizer(cfg.optimizer, model, schedule, qk_clip_group=info.qk_clip_group)
    ctx = ParallelContext(rank=rank, world_size=world).placed(info)
    step = TrainStep(model, optimizer, ScheduleLR(optimizer, schedule), max_norm=1.0, ctx=ctx)
    g = torch.Generator().manual_seed(info.dp_rank)
    batches = []
    for _ in range(accum):
        ids = torch.randint(1, mc.vocab_size, (lbs, mc.seq_length), generator=g)
        batches.append({"input_ids": ids, "labels": torch.roll(ids, -1, 1)})
    tracker = LiveStorageBytes()
    held = [
        *model.parameters(),
        *model.buffers(),
        *(t for b in batches for t in b.values()),
        *tree_flatten(getattr(optimizer, "state", {}))[0],
        *tree_flatten([g.get("params", []) for g in getattr(optimizer, "param_groups", [])])[0],
    ]
    for t in held:
        if isinstance(t, torch.Tensor) and t.device.type == "cpu":
            tracker.track(t)
    with tracker:
        step(batches)
    return tracker.peak


def _worker(rank: int, world: int, init_file: str, cases: dict[str, dict], out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    path = Path(out) / f"rank{rank}.json"
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        peaks = {name: _measure_case(rank, world, raw) for name, raw in cases.items()}
        path.write_text(json.dumps({"ok": True, "peaks": peaks}))
    except BaseException as exc:  # report to the parent instead of hanging it
        path.write_text(json.dumps({"ok": False, "error": f"{exc!r}\n{traceback.format_exc()}"}))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def measure_parallel(cases: dict[str, dict], world: int = 2, timeout: float = 120.0) -> dict[str, list[int]]:
    """``{case: [peak bytes of rank 0, rank 1, ...]}`` for every case, on ``world`` spawned gloo ranks."""
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned ranks
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [
            ctx.Process(target=_worker, args=(r, world, init_file, cases, tmp), daemon=True)
            for r in range(world)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        results = []
        for r in range(world):
            f = Path(tmp) / f"rank{r}.json"
            results.append(json.loads(f.read_text()) if f.exists() else {"ok": False, "error": "no result"})
    errors = [f"rank {r}: {res['error']}" for r, res in enumerate(results) if not res["ok"]]
    if errors:
        raise AssertionError("\n".join(errors))
    return {name: [res["peaks"][name] for res in results] for name in cases}
