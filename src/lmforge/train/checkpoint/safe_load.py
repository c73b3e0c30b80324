"""Reading checkpoint files without executing code from them.

A checkpoint is untrusted input: anyone can hand over a directory. Python's ``pickle`` runs any
callable a file names, so every pickle lmforge reads goes through an unpickler that admits only the
classes the format itself uses, and lmforge's own state is stored as JSON:

* DCP's ``.metadata`` is a pickle (torch writes it): :class:`SafeFileSystemReader` reads it with an
  unpickler that admits the DCP metadata classes, ``torch.Size``, dtypes and paths, nothing else.
* DCP stores non-tensor items (optimizer hyper-parameters) with ``torch.save`` and loads them with
  ``torch.load(weights_only=False)``; :class:`SafeLoadPlanner` loads them with ``weights_only=True``.
* lmforge's state "skeleton" (the structure of an optimizer, scheduler, RNG or loader state around
  its tensors) is JSON (:func:`encode_skeleton`). Skeletons of older checkpoints are pickles; they
  are decoded by an unpickler that admits only plain containers, numpy arrays and the tensor marker
  (``compat/pickled_skeleton.py``, removed in lmforge 0.3).

A file that names anything else is refused with :class:`~lmforge.errors.CheckpointError` before any
of it is used.
"""

from __future__ import annotations

import base64
import io
import json
import math
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from lmforge.errors import CheckpointError, LmforgeError

SKELETON_MAGIC = b"lmforge-json/1\n"


class TensorRef:
    """Stands for a tensor inside an encoded skeleton (the tensor itself is stored by DCP)."""

    def __init__(self, key: str) -> None:
        self.key = key

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TensorRef) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)


class UnsafeFileError(CheckpointError):
    """A checkpoint file names Python objects outside its format (possibly code to run)."""


def refuse_unsafe(what: str, module: str, name: str) -> UnsafeFileError:
    return UnsafeFileError(
        f"{what} names the Python object {module}.{name}, which is not part of the checkpoint format; "
        "lmforge refuses to load it because unpickling it could run code. Use checkpoints from a source "
        "you trust, written by lmforge or torch.distributed.checkpoint."
    )


# ---------------------------------------------------------------------------------------------
# DCP .metadata
# ---------------------------------------------------------------------------------------------

_DCP_MODULES = {"torch.distributed.checkpoint.metadata": dcp_metadata}
_DCP_EXTRA = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, what: str) -> None:
        super().__init__(file)
        self.what = what

    def find_class(self, module: str, name: str) -> Any:
        if module in _DCP_MODULES:
            obj = getattr(_DCP_MODULES[module], name, None)
            if isinstance(obj, type):  # the format's dataclasses and enums
                return obj
        if (module, name) in _DCP_EXTRA:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise refuse_unsafe(self.what, module, name)


def read_dcp_metadata(path: str | Path) -> Any:
    """The DCP ``Metadata`` of checkpoint directory ``path``, read without running code."""
    file = Path(path) / ".metadata"
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f, str(file)).load()
    except UnsafeFileError:
        raise
    except Exception as exc:  # truncated, empty or foreign
        raise CheckpointError(
            f"Cannot read the DCP metadata {file}: {type(exc).__name__}: {exc}. The checkpoint is incomplete "
            "or corrupt; use another iteration (or the previous one named by latest_checkpointed_iteration.txt)."
        ) from exc
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CheckpointError(f"{file} is not a DCP metadata file (it holds a {type(metadata).__name__}).")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with :func:`read_dcp_metadata` instead of ``pickle.load``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("rank") is not None:
            raise CheckpointError("Per-rank DCP metadata files are not an lmforge checkpoint format.")
        metadata = read_dcp_metadata(self.path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def first_failure(exc: BaseException) -> BaseException:
    """The underlying exception of DCP's ``CheckpointException`` (which wraps every rank's failure)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        return inner[0] if isinstance(inner, tuple) else inner
    return exc


def load_dcp(state_dict: dict[str, Any], path: str | Path, *, no_dist: bool) -> None:
    """``dcp.load`` through the safe reader and planner, with a missing, truncated or hostile file
    reported as a :class:`~lmforge.errors.CheckpointError` naming the checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(
            state_dict,
            storage_reader=SafeFileSystemReader(str(path)),
            planner=SafeLoadPlanner(),
            no_dist=no_dist,
        )
    except (CheckpointException, Exception) as exc:
        if isinstance(exc, LmforgeError):
            raise
        inner = first_failure(exc)
        if isinstance(inner, LmforgeError):
            raise inner from None
        detail = str(inner).strip().splitlines()[-1] if str(inner).strip() else "no message"
        short = short_shards(path)
        found = (
            f"{'; '.join(short)}. A shard file is truncated"
            if short
            else "A shard file is missing, truncated or corrupt"
        )
        raise CheckpointError(
            f"Cannot read checkpoint {path}: {type(inner).__name__}: {detail}. {found}; use another iteration "
            "of the save_path, or re-create the checkpoint."
        ) from None


def short_shards(path: str | Path) -> list[str]:
    """Which shard files of ``path`` end before the bytes its ``.metadata`` places in them (a truncated
    copy: DCP then fails with a bare ``EOFError``), as ``NAME: N bytes, the index needs M``; [] when
    none or when the metadata cannot be read (its own error is reported then)."""
    try:
        metadata = read_dcp_metadata(path)
    except LmforgeError:
        return []
    needed: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        name = str(getattr(info, "relative_path", ""))
        end = int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0))
        if name:
            needed[name] = max(needed.get(name, 0), end)
    short = []
    for name, end in sorted(needed.items()):
        file = Path(path) / name
        size = file.stat().st_size if file.is_file() else None
        if size is None:
            short.append(f"{name}: missing, the index needs {end:,} bytes of it")
        elif size < end:
            short.append(f"{name}: {size:,} bytes, the index needs {end:,}")
    return short


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, reading non-tensor items with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            reason = [line for line in str(exc).splitlines() if "WeightsUnpickler error" in line]
            raise UnsafeFileError(
                f"Checkpoint item {read_item.dest_index.fqn!r} holds Python objects outside the checkpoint format "
                f"({(reason or [str(exc)])[0].strip()}); lmforge refuses to load it because unpickling it could "
                "run code. Use checkpoints from a source you trust."
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


# ---------------------------------------------------------------------------------------------
# lmforge's state skeleton: JSON with tagged types
# ---------------------------------------------------------------------------------------------

_NUMERIC_KINDS = "biufc"


def _to_json(x: Any) -> Any:
    if x is None or isinstance(x, (bool, str)):
        return x
    if isinstance(x, int):
        return int(x)
    if isinstance(x, float):
        return float(x) if math.isfinite(x) else {"__float": repr(float(x))}
    if isinstance(x, TensorRef):
        return {"__tensor": x.key}
    if isinstance(x, list):
        return [_to_json(v) for v in x]
    if isinstance(x, tuple):
        return {"__tuple": [_to_json(v) for v in x]}
    if isinstance(x, dict):
        return {"__dict": [[_to_json(k), _to_json(v)] for k, v in x.items()]}
    if isinstance(x, bytes):
        return {"__bytes": base64.b64encode(x).decode("ascii")}
    if isinstance(x, torch.dtype):
        return {"__dtype": str(x).removeprefix("torch.")}
    if isinstance(x, np.ndarray) and x.dtype.kind in _NUMERIC_KINDS:
        data = base64.b64encode(np.ascontiguousarray(x).tobytes()).decode("ascii")
        return {"__ndarray": {"dtype": x.dtype.str, "shape": list(x.shape), "data": data}}
    if isinstance(x, np.generic):
        return _to_json(x.item())
    raise TypeError(
        f"cannot store a {type(x).__module__}.{type(x).__qualname__} in a checkpoint state; state dicts "
        "may hold tensors, numbers, strings, bytes, None, numpy arrays and lists/tuples/dicts of them"
    )


def _from_json(x: Any) -> Any:
    if isinstance(x, list):
        return [_from_json(v) for v in x]
    if not isinstance(x, dict):
        return x
    if len(x) != 1:
        raise ValueError(f"unexpected object with keys {sorted(x)[:5]}")
    ((tag, value),) = x.items()
    if tag == "__tensor":
        return TensorRef(str(value))
    if tag == "__tuple":
        return tuple(_from_json(v) for v in value)
    if tag == "__dict":
        out = {}
        for k, v in value:
            k = _from_json(k)
            out[k if not isinstance(k, list) else tuple(k)] = _from_json(v)
        return out
    if tag == "__float":
        return float(value)
    if tag == "__bytes":
        return base64.b64decode(value)
    if tag == "__dtype":
        dtype = getattr(torch, str(value), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {value!r}")
        return dtype
    if tag == "__ndarray":
        dtype = np.dtype(str(value["dtype"]))
        if dtype.kind not in _NUMERIC_KINDS:
            raise ValueError(f"non-numeric array dtype {value['dtype']!r}")
        flat = np.frombuffer(base64.b64decode(value["data"]), dtype=dtype)
        return flat.reshape([int(n) for n in value["shape"]]).copy()
    raise ValueError(f"unknown tag {tag!r}")


def encode_skeleton(skeleton: Any) -> bytes:
    """``skeleton`` (containers, scalars, :class:`TensorRef`) as JSON bytes."""
    return SKELETON_MAGIC + json.dumps(_to_json(skeleton), separators=(",", ":")).encode("utf-8")


def decode_skeleton(data: Any, where: str = "checkpoint state") -> Any:
    """The skeleton :func:`encode_skeleton` wrote, or an older pickled one, read without running code."""
    if isinstance(data, io.BytesIO):
        data = data.getvalue()
    if not isinstance(data, (bytes, bytearray)):
        raise CheckpointError(f"The {where} is not an encoded state (it holds a {type(data).__name__}).")
    data = bytes(data)
    try:
        if data.startswith(SKELETON_MAGIC):
            return _from_json(json.loads(data[len(SKELETON_MAGIC) :].decode("utf-8")))
        # Compatibility: pickled by an older lmforge (train/checkpoint/compat, removed in lmforge 0.3).
        from lmforge.train.checkpoint.compat.pickled_skeleton import decode_pickled_skeleton

        return decode_pickled_skeleton(data)
    except UnsafeFileError:
        raise
    except Exception as exc:
        raise CheckpointError(
            f"The {where} is corrupt ({type(exc).__name__}: {exc}); use another checkpoint iteration."
        ) from exc
