"""Sharded safetensors for Hugging Face directories: ``model-0000i-of-0000N.safetensors`` + index.

Written with torch's distributed-checkpoint ``HuggingFaceStorageWriter`` (one file per shard, the index
``model.safetensors.index.json`` with ``weight_map`` and ``metadata.total_size``); the split into files
is decided here so that no file exceeds ``max_shard_size`` (a tensor larger than that gets a file of
its own, as transformers does).
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import torch
from safetensors.torch import save_file

from lmforge.errors import ConfigError

INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"

# Decimal units as transformers' ``max_shard_size`` ("5GB" = 5e9 bytes); the binary ones too ("5GiB").
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(text: str | int, key: str = "--max-shard-size") -> int:
    """Bytes of ``"5GB"`` / ``"500MB"`` / ``"2GiB"`` / ``123456``."""
    if isinstance(text, int) and not isinstance(text, bool):
        size = text
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
        unit = match.group(2).upper() if match else None
        if match is None or unit not in _UNITS:
            raise ConfigError(
                f"{key} = {text!r} is not a size; give bytes or a number with a unit: KB, MB, GB, TB "
                "(powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. 5GB."
            )
        size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ConfigError(f"{key} = {text!r} must be a positive size, e.g. 5GB.")
    return size


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def plan_shards(tensors: dict[str, torch.Tensor], max_shard_size: int) -> dict[str, int]:
    """Tensor name → file number (1..N), in order, each file at most ``max_shard_size`` bytes."""
    mapping: dict[str, int] = {}
    index, used = 1, 0
    for name, tensor in tensors.items():
        size = _nbytes(tensor)
        if used and used + size > max_shard_size:
            index, used = index + 1, 0
        mapping[name] = index
        used += size
    return mapping


def _dcp_hf_writer():
    """torch's ``HuggingFaceStorageWriter`` class, or None where the installed torch lacks it."""
    try:
        from torch.distributed.checkpoint import HuggingFaceStorageWriter
    except ImportError:
        return None
    return HuggingFaceStorageWriter


def write_sharded(tensors: dict[str, torch.Tensor], path: Path, max_shard_size: int) -> list[str]:
    """Write ``tensors`` (full, contiguous, CPU) as shards + index into ``path``; the file names."""
    mapping = plan_shards(tensors, max_shard_size)
    for old in list(path.glob("model*.safetensors")) + [path / INDEX_FILE]:
        old.unlink(missing_ok=True)  # a previous export with another shard count would confuse readers
    writer_cls = _dcp_hf_writer()
    if writer_cls is not None:
        import torch.distributed.checkpoint as dcp

        # One writer process holding the full tensors (the export); no collectives, even inside a
        # process group: several ranks writing the same numbered files would overwrite each other.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(
                tensors, storage_writer=writer_cls(str(path), fqn_to_index_mapping=mapping), no_dist=True
            )
    else:
        _write_with_safetensors(tensors, path, mapping)
    index = json.loads((path / INDEX_FILE).read_text())
    return sorted(set(index["weight_map"].values()))


def _write_with_safetensors(tensors: dict[str, torch.Tensor], path: Path, mapping: dict[str, int]) -> None:
    """The same layout as the DCP writer, for a torch without ``HuggingFaceStorageWriter``."""
    count = max(mapping.values(), default=1)
    files: dict[int, dict[str, torch.Tensor]] = {}
    for name, number in mapping.items():
        files.setdefault(number, {})[name] = tensors[name]
    weight_map = {}
    for number, group in files.items():
        file = f"model-{number:05d}-of-{count:05d}.safetensors"
        save_file(group, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, file))
    total = sum(_nbytes(t) for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
