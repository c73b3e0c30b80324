"""Arbitrary (non-tensor) state in a DCP checkpoint: a JSON skeleton plus a flat dict of tensors."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lmforge.train.checkpoint.safe_load import TensorRef as _TensorRef
from lmforge.train.checkpoint.safe_load import decode_skeleton, encode_skeleton
from lmforge.utils.logging import get_logger

logger = get_logger("lmforge.train.checkpoint")


def encode_state(obj: Any) -> dict[str, Any]:
    """Split an arbitrary state (nested dicts, lists, tuples, tensors, python values) into a JSON
    skeleton (train/checkpoint/safe_load.py) and a flat dict of tensors, so DCP stores it exactly: DCP alone would stringify integer
    keys and drop empty containers (an optimizer's state dict has both)."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            key = f"t{len(tensors)}"  # no dots: DCP joins nesting levels with dots
            tensors[key] = x
            return _TensorRef(key)
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, tuple):
            return tuple(walk(v) for v in x)
        return copy.deepcopy(x)

    # Encoded here, at call time: an asynchronous save then holds the state as of the call, and DCP
    # stores the bytes as one opaque item instead of traversing the structure.
    skeleton = encode_skeleton(walk(obj))
    return {"skeleton": skeleton, "tensors": tensors}


def decode_state(encoded: dict[str, Any]) -> Any:
    tensors = encoded.get("tensors", {})

    def walk(x: Any) -> Any:
        if isinstance(x, _TensorRef):
            return tensors[x.key]
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, tuple):
            return tuple(walk(v) for v in x)
        return x

    return walk(decode_skeleton(encoded["skeleton"]))


def _allocate_encoded(metadata: Any, prefix: str) -> dict[str, Any]:
    """An empty encoded state for the keys saved under ``prefix`` (tensors at their saved sizes)."""
    tensors: dict[str, torch.Tensor] = {}
    tensor_prefix = f"{prefix}.tensors."
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith(tensor_prefix) and isinstance(meta, TensorStorageMetadata):
            tensors[key[len(tensor_prefix) :]] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    return {"skeleton": None, "tensors": tensors}


def _has_key(metadata_keys: Any, prefix: str) -> bool:
    return any(k == prefix or k.startswith(prefix + ".") for k in metadata_keys)
