"""State skeletons that lmforge pickled before it wrote them as JSON (``safe_load.encode_skeleton``).

Such a pickle is read by an unpickler that admits only the globals those skeletons could name (plain
containers, numpy arrays, dtypes and the tensor marker): a pickle naming anything else is refused before
any of it runs. Removed in lmforge 0.3, with the rest of this package.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from lmforge.train.checkpoint.safe_load import TensorRef, refuse_unsafe
from lmforge.utils.logging import get_logger

logger = get_logger("lmforge.train.checkpoint")

_OLD_GLOBALS = {
    ("lmforge.train.checkpoint", "_TensorRef"): TensorRef,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("collections", "OrderedDict"): dict,
}
_NUMPY_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
}
_logged = False


class _PickledSkeletonUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _OLD_GLOBALS:
            return _OLD_GLOBALS[(module, name)]
        if (module, name) in _NUMPY_GLOBALS:
            return super().find_class(module, name)
        if module == "numpy.dtypes" and name.endswith("DType") and name != "ObjectDType":
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise refuse_unsafe("A checkpoint state skeleton (pickled by an older lmforge)", module, name)


def decode_pickled_skeleton(data: bytes) -> Any:
    """The skeleton an older lmforge pickled, read without running code (refused if it names other globals)."""
    global _logged
    skeleton = _PickledSkeletonUnpickler(io.BytesIO(data)).load()
    if not _logged:  # once per process: a checkpoint holds several skeletons
        _logged = True
        logger.info(
            "Checkpoint state skeletons pickled by an older lmforge (before JSON skeletons) read through the "
            "compatibility reader (train/checkpoint/compat, removed in lmforge 0.3); a new save writes JSON."
        )
    return skeleton
