"""Reading a Hugging Face directory into a lmforge model, each rank reading only the bytes it keeps.

A parameter of a parallel model is a ``DTensor`` whose shard (FSDP, TP, EP, HSDP, FSDP over TP's
``_StridedShard``) covers some global indices per dimension (``init._global_indices``); a pipeline stage
simply lacks the other stages' layers. The family's HF adapter says how Hugging Face tensors become
lmforge tensors, but only by whole-tensor copies: concatenations ([q; k; v], [gate; up]), expert stacks,
per-head regroupings and row reorderings, never a change of the last (input) dimension. So the adapter
is run once on *row ids* instead of weights: every HF tensor ``[*lead, cols]`` is replaced by an int64
tensor ``[*lead, 1]`` whose entries are ``(tensor number << 40) | flat row`` (a 1-D tensor: one id per
element). What comes out under each lmforge name says, row by row, which HF tensor and row the lmforge
row is a copy of. A rank selects the ids of its own shard, groups them into runs of consecutive rows
of one HF tensor and reads each run, restricted to its own columns, with safetensors'
``safe_open(...).get_slice(...)`` (which reads only those bytes from the memory-mapped file).

The row ids of a whole model are one int64 per HF row (a few MB for a 7B model), never the weights.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import torch

from lmforge.errors import CheckpointError
from lmforge.models.common.init import _as_range, _global_indices, canonical_name
from lmforge.models.common.transformer_config import TransformerConfig
from lmforge.models.hf_checks import check_unused, open_safetensors
from lmforge.models.lora import is_lora_param_name

_ROW_BITS = 40
_ROW_MASK = (1 << _ROW_BITS) - 1


def weight_files(path: Path) -> dict[str, Path]:
    """Tensor name → the safetensors file that holds it (from the index, or the single file)."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        return _indexed_files(path, index)
    single = path / "model.safetensors"
    if not single.exists():
        raise CheckpointError(
            f"{path} has neither model.safetensors nor model.safetensors.index.json; lmforge reads Hugging Face "
            "checkpoints in safetensors format only."
        )
    with contextlib.ExitStack() as stack:
        return dict.fromkeys(open_safetensors(single, stack).keys(), single)


def _indexed_files(path: Path, index: Path) -> dict[str, Path]:
    """The index's ``weight_map``: tensor names to file names that lie in ``path`` itself."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"{index} is not a safetensors index (a JSON object with a 'weight_map' object): {exc!r}"
        ) from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(
            f"{index}: 'weight_map' must be a non-empty object of tensor names to safetensors file names."
        )
    files = {}
    for name, file in weight_map.items():
        if not isinstance(file, str) or Path(file).name != file or not file.endswith(".safetensors"):
            raise CheckpointError(
                f"{index}: tensor '{name}' is placed in {file!r}; the index may name only .safetensors "
                "files of its own directory."
            )
        files[name] = path / file
    for file in sorted(set(files.values())):
        if not file.exists():
            raise CheckpointError(f"{file} is listed in the safetensors index but does not exist.")
    return files


def read_slice(handle: Any, name: str, index: tuple[slice, ...]) -> torch.Tensor:
    """The only place weight bytes are read (tests wrap it to count them)."""
    if not index:
        return handle.get_tensor(name)
    return handle.get_slice(name)[index]


class _Directory:
    """Open handles and shapes of a directory's tensors (headers only until a slice is read)."""

    def __init__(self, files: dict[str, Path], stack: contextlib.ExitStack) -> None:
        self.names = sorted(files)
        self.number = {n: i for i, n in enumerate(self.names)}
        handles = {f: open_safetensors(f, stack) for f in sorted(set(files.values()))}
        self.handle = {n: handles[files[n]] for n in self.names}
        self.shape = {}
        for n in self.names:
            try:
                self.shape[n] = tuple(self.handle[n].get_slice(n).get_shape())
            except Exception as exc:  # noqa: BLE001 (safetensors raises its own error types)
                raise CheckpointError(
                    f"{files[n]}: tensor '{n}' of the index cannot be read ({exc})."
                ) from None
        # Rows per leading index of each tensor (a run of rows never crosses one), by tensor number.
        self.inner = torch.tensor([self._inner(n) for n in self.names], dtype=torch.int64)

    def row_ids(self) -> dict[str, torch.Tensor]:
        out = {}
        for n in self.names:
            shape, base = self.shape[n], self.number[n] << _ROW_BITS
            lead = shape[:-1] if len(shape) > 1 else shape
            ids = torch.arange(int(torch.tensor(lead).prod()), dtype=torch.int64) + base
            out[n] = ids.view(*lead, 1) if len(shape) > 1 else ids.view(shape)
        return out

    def read_rows(self, ids: torch.Tensor, cols: tuple[int, int] | None, out: torch.Tensor) -> None:
        """Fill ``out`` (``[len(ids), width]``, or ``[len(ids)]`` for 1-D tensors with ``cols`` None) with
        rows ``ids`` restricted to columns ``cols``: one read per run of consecutive rows of one tensor."""
        numbers, rows = ids >> _ROW_BITS, ids & _ROW_MASK
        inner = self.inner[numbers]
        lead = rows // inner
        breaks = (ids[1:] != ids[:-1] + 1) | (lead[1:] != lead[:-1])  # a run never crosses a leading index
        starts = [0, *(breaks.nonzero().reshape(-1) + 1).tolist()]
        ends = [*starts[1:], ids.numel()]
        for s, e in zip(starts, ends):
            name = self.names[int(numbers[s])]
            out[s:e].copy_(self._run(name, int(rows[s]), e - s, cols))

    def _inner(self, name: str) -> int:
        shape = self.shape[name]
        return max(1, shape[-2] if len(shape) > 1 else (shape[0] if shape else 1))

    def _run(self, name: str, first: int, count: int, cols: tuple[int, int] | None) -> torch.Tensor:
        shape, handle = self.shape[name], self.handle[name]
        if not shape:
            return read_slice(handle, name, ()).reshape(1)
        if len(shape) == 1:
            return read_slice(handle, name, (slice(first, first + count),))
        lead, row = divmod(first, shape[-2])
        lead_index = []
        for size in reversed(shape[:-2]):
            lead, i = divmod(lead, size)
            lead_index.append(slice(i, i + 1))
        index = (*reversed(lead_index), slice(row, row + count), slice(*cols))
        return read_slice(handle, name, index).reshape(count, cols[1] - cols[0])


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _fill(directory: _Directory, name: str, target: torch.Tensor, ids: torch.Tensor) -> None:
    """Copy this rank's shard of lmforge tensor ``name`` from the rows ``ids`` say it is made of."""
    shape = tuple(target.shape)
    local = _local(target)
    if local.numel() == 0:
        return
    # Index bookkeeping stays on the CPU whatever the parameter's device (reads land on the CPU too).
    indices = [
        i.cpu() for i in _global_indices(target) or [torch.arange(n, dtype=torch.int64) for n in shape]
    ]
    if ids.dtype != torch.int64:  # a value the adapter made up (e.g. a zero default), not read from a file
        for d, index in enumerate(indices):
            ids = ids.index_select(d, index)
        local.copy_(ids)
        return
    has_cols = len(shape) >= 2
    expected = (*shape[:-1], 1) if has_cols else shape
    if tuple(ids.shape) != expected:
        raise CheckpointError(
            f"the Hugging Face adapter builds '{name}' with shape {tuple(ids.shape)} of rows, expected {expected}: "
            "it changes the last dimension, which a per-rank read cannot follow."
        )
    for d, index in enumerate(indices[:-1] if has_cols else indices):
        ids = ids.index_select(d, index)
    cols, pick = None, None
    if has_cols:
        span = _as_range(indices[-1])
        if span is None:  # not one run of columns: read the covering range, keep the columns held
            span = (int(indices[-1].min()), int(indices[-1].max()) + 1)
            pick = indices[-1] - span[0]
        cols = span
    width = () if cols is None else (cols[1] - cols[0],)
    with torch.no_grad():
        if pick is None and local.is_contiguous() and local.device.type == "cpu":
            directory.read_rows(ids.reshape(-1), cols, local.view(-1, *width))  # straight into the shard
            return
        values = torch.empty((ids.numel(), *width), dtype=local.dtype)
        directory.read_rows(ids.reshape(-1), cols, values)
        if pick is not None:
            values = values.index_select(1, pick)
        local.copy_(values.reshape(local.shape))


def _targets(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {canonical_name(n): p for n, p in model.named_parameters()}
    out.update({canonical_name(n): b for n, b in model.named_buffers() if b is not None})
    return out


def load_per_rank(model: torch.nn.Module, path: Path, cfg: TransformerConfig, from_hf: Any) -> None:
    """Fill ``model`` (plain, DTensor-sharded and/or a pruned pipeline stage) from ``path``, reading only
    the rows and columns of this rank's shards. Raises ``CheckpointError`` on every rank if any fails."""
    failure = None
    try:
        _load(model, path, cfg, from_hf)
    except (CheckpointError, OSError) as exc:
        failure = str(exc)
    _agree_on(failure)


def _agree_on(failure: str | None) -> None:
    """Every rank raises when one fails (else the others would hang in their next collective)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        failures: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(failures, failure)
        failure = next((f for f in failures if f is not None), None)
    if failure is not None:
        raise CheckpointError(failure)


def _load(model: torch.nn.Module, path: Path, cfg: TransformerConfig, from_hf: Any) -> None:
    files = weight_files(path)
    with contextlib.ExitStack() as stack:
        directory = _Directory(files, stack)
        ids = directory.row_ids()
        mapped = from_hf(ids, cfg)
        check_unused(path, ids)  # what from_hf did not take
        targets = _targets(model)
        # MTP layers and LoRA adapters (lmforge.models.lora) are not in a Hugging Face base model;
        # buffers not in the mapping are derived ones (rope tables, counters).
        params = {canonical_name(n) for n, _ in model.named_parameters()}
        missing = [
            k for k in params if k not in mapped and not k.startswith("mtp.") and not is_lora_param_name(k)
        ]
        # A pipeline stage holds only its own layers; a whole model must take every mapped tensor.
        pruned = len(getattr(getattr(model, "decoder", None), "layers", ())) < cfg.num_layers
        unexpected = [] if pruned else [k for k in mapped if k not in targets]
        if missing or unexpected:
            raise CheckpointError(
                f"{path}: tensors missing {sorted(missing)[:8]} / unexpected {unexpected[:8]} after mapping."
            )
        for name, target in targets.items():
            if name in mapped:
                _fill(directory, name, target, mapped[name])
