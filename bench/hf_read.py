"""Per-rank Hugging Face reads (``load_hf_weights``) against a whole-tensor read, side by side.

    .venv/bin/python bench/hf_read.py [--rounds N] [--no-write]

A 34M-parameter Qwen3 exported with ``save_hf_pretrained`` (fp32, 50MB shards) is loaded
* on one process: ``load_hf_weights`` (row runs read with ``get_slice``) vs the whole-tensor path
  (``read_safetensors_dir`` + the adapter's ``from_hf`` + ``load_state_dict``), into the same model;
* on 2 gloo ranks with FSDP: each rank's ``load_hf_weights`` (bytes read counted) vs each rank reading
  the whole directory (what every rank did when each read the model itself).

Each round runs ours then the peer; times are medians, the ratio is the median of the per-round
ratios. The table replaces the "## HF weights read per rank" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from benchdoc import write_section
from interop import EXPORT_MODEL, machine
from lmforge.config import validate_section
from lmforge.models import build_model, hf_read, load_hf_weights, save_hf_pretrained
from lmforge.models.hf_io import hf_state_dict

SECTION = "## HF weights read per rank"


def _whole(model, path: Path) -> None:
    model.load_state_dict(hf_state_dict(path, model.config), strict=False)


def _counting() -> list[int]:
    read = [0]
    real = hf_read.read_slice

    def counting(handle, name, index):
        values = real(handle, name, index)
        read[0] += values.nbytes
        return values

    hf_read.read_slice = counting
    return read


def one_process(path: Path, rounds: int) -> tuple[float, float, float]:
    model = build_model(validate_section("model", EXPORT_MODEL))
    ours, peer, ratios = [], [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        load_hf_weights(model, path)
        t1 = time.perf_counter()
        _whole(model, path)
        t2 = time.perf_counter()
        ours.append(t1 - t0)
        peer.append(t2 - t1)
        ratios.append((t1 - t0) / (t2 - t1))
    return statistics.median(ours), statistics.median(peer), statistics.median(ratios)


def _rank(rank: int, world: int, init: str, path: str, rounds: int, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    model = build_model(validate_section("model", EXPORT_MODEL))
    for layer in model.decoder.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    plain = build_model(validate_section("model", EXPORT_MODEL))
    read = _counting()
    ours, peer = [], []
    for _ in range(rounds):
        dist.barrier()
        read[0] = 0
        t0 = time.perf_counter()
        load_hf_weights(model, Path(path))
        t1 = time.perf_counter()
        _whole(plain, Path(path))
        t2 = time.perf_counter()
        ours.append(t1 - t0)
        peer.append(t2 - t1)
    Path(out, f"rank{rank}.json").write_text(json.dumps({"ours": ours, "peer": peer, "read": read[0]}))
    dist.destroy_process_group()


def two_ranks(path: Path, rounds: int, tmp: Path) -> tuple[float, float, float, float]:
    init = tempfile.mktemp(dir=tmp)
    mp.start_processes(_rank, args=(2, init, str(path), rounds, str(tmp)), nprocs=2, start_method="spawn")
    results = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]
    ours = [max(r["ours"][i] for r in results) for i in range(rounds)]
    peer = [max(r["peer"][i] for r in results) for i in range(rounds)]
    total = sum(f.stat().st_size for f in path.glob("model-*.safetensors"))
    share = max(r["read"] for r in results) / total
    ratio = statistics.median(o / p for o, p in zip(ours, peer))
    return statistics.median(ours), statistics.median(peer), ratio, share


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="lmforge-bench-hfread-") as tmp:
        path = Path(tmp) / "hf"
        torch.manual_seed(0)
        save_hf_pretrained(build_model(validate_section("model", EXPORT_MODEL)), path, max_shard_size="50MB")
        single = one_process(path, args.rounds)
        fsdp = two_ranks(path, args.rounds, Path(tmp))
    body = f"""{SECTION}

`bench/hf_read.py` ({args.rounds} rounds, ours then the peer in each; times are medians (2 ranks: the
slower rank), the ratio is the median of the per-round ratios; commit {commit}). Machine: {machine()}.
Load average at start: {load:.1f} (shared machine: absolute numbers are noisy, the ratio is the result).
Model: 34M-parameter Qwen3, fp32, exported with `save_hf_pretrained` in 50MB shards (files in the page cache).

| what | ours | peer | ours | peer | ratio |
|---|---|---|---:|---:|---:|
| 1 process | `load_hf_weights` (row runs, `get_slice`) | whole tensors (`read_safetensors_dir` + `from_hf` + `load_state_dict`) | {single[0]:.2f} s | {single[1]:.2f} s | {single[2]:.2f}x time |
| 2 gloo ranks, FSDP | `load_hf_weights` per rank | every rank reads the whole directory | {fsdp[0]:.2f} s | {fsdp[1]:.2f} s | {fsdp[2]:.2f}x time |

Bytes read by the busiest FSDP rank: {fsdp[3]:.1%} of the files (the norms are replicated, the rest is
half). The byte count per rank is also asserted exactly in tests/end_to_end/interop/test_hf_load_sharded.py.

Reading: each run of consecutive rows is read with `get_slice` straight into the local shard (one
copy); the whole-tensor path also concatenates the fused tensors (`torch.cat`) before copying them.
A first version that gathered the rows through a sorted copy took 6.1x the whole-tensor time on one
process; it was replaced before this table.
"""
    print(body)
    if not args.no_write:
        write_section(SECTION, body)


if __name__ == "__main__":
    main()
