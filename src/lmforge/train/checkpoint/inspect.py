"""``lmforge checkpoint inspect``: what a checkpoint directory holds, without building a model."""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lmforge.train.checkpoint import (
    COMMON_FILE,
    CONFIG_FILE,
    TRACKER_FILE,
    _allocate_encoded,
    _quiet_single_process,
    _read_metadata,
    decode_state,
    read_tracker,
    resolve_checkpoint,
)
from lmforge.train.checkpoint.safe_load import load_dcp


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def _read_small(path: Path, metadata: Any, prefix: str) -> Any:
    sd = {prefix: _allocate_encoded(metadata, prefix)}
    with _quiet_single_process():
        load_dcp(sd, path, no_dist=True)
    return decode_state(sd[prefix])


def describe_checkpoint(path: str | os.PathLike, list_tensors: bool = False) -> str:
    header = resolve_checkpoint(path)
    if header is None:
        from lmforge.errors import CheckpointError

        raise CheckpointError(f"{path}: no checkpoint here (the directory is missing or empty).")
    lines = [f"checkpoint: {header.path}"]
    if header.kind == "hf":
        lines.append("kind: Hugging Face model directory (load it with checkpoint.no_load_optim: true)")
        for f in sorted(header.path.iterdir()):
            lines.append(f"  {f.name:<40} {_bytes(f.stat().st_size):>12}")
        return "\n".join(lines)
    root = header.path.parent
    if (root / TRACKER_FILE).is_file():
        its = sorted(p.name for p in root.glob("iteration_*") if p.is_dir())
        lines.append(f"save_path: {root} (latest: {read_tracker(root)}; on disk: {', '.join(its)})")
    common = (
        json.loads((header.path / COMMON_FILE).read_text()) if (header.path / COMMON_FILE).is_file() else {}
    )
    lines.append("common.json:")
    for k in sorted(common):
        lines.append(f"  {k:<18} {common[k]}")
    metadata = _read_metadata(header.path)
    groups: dict[str, list[tuple[str, Any]]] = defaultdict(list)
    for key, meta in metadata.state_dict_metadata.items():
        groups[key.split(".", 1)[0]].append((key, meta))
    lines.append("contents:")
    for group in sorted(groups):
        items = groups[group]
        tensors = [(k, m) for k, m in items if isinstance(m, TensorStorageMetadata)]
        numel = sum(int(torch.Size(m.size).numel()) for _, m in tensors)
        nbytes = sum(int(torch.Size(m.size).numel()) * m.properties.dtype.itemsize for _, m in tensors)
        dtypes = sorted({str(m.properties.dtype).replace("torch.", "") for _, m in tensors})
        lines.append(
            f"  {group:<11} {len(tensors):>5} tensors {numel:>14,} elements {_bytes(nbytes):>11}"
            + (f"  ({', '.join(dtypes)})" if dtypes else "")
        )
        if group == "rng" or group == "dataloader":
            ranks = sorted({k.split(".")[1] for k, _ in items})
            lines.append(f"  {'':<11} per rank: {', '.join(ranks)}")
    if "trainer" in groups:
        state = _read_small(header.path, metadata, "trainer")
        keys = (
            "global_step",
            "consumed_samples",
            "epoch",
            "skipped_steps",
            "tokens_seen",
            "best_loss",
            "last_loss",
        )
        lines.append("trainer state: " + ", ".join(f"{k}={state.get(k)}" for k in keys if k in state))
    if "scheduler" in groups:
        lines.append(f"scheduler state: {_read_small(header.path, metadata, 'scheduler')}")
    if list_tensors and "model" in groups:
        lines.append("model tensors:")
        for key, meta in sorted(groups["model"]):
            dtype = str(meta.properties.dtype).replace("torch.", "")
            lines.append(f"  {key[len('model.') :]:<60} {list(meta.size)!s:<20} {dtype}")
    lines.append("files:")
    for f in sorted(header.path.iterdir()):
        lines.append(f"  {f.name:<40} {_bytes(f.stat().st_size):>12}")
    if (header.path / CONFIG_FILE).is_file():
        lines.append(f"config: {header.path / CONFIG_FILE} (used by lmforge generate)")
    return "\n".join(lines)
