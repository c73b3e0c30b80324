"""State skeletons pickled by an older lmforge (before JSON skeletons) still decode, through the
compatibility reader (train/checkpoint/compat, removed in lmforge 0.3), and the read is logged."""

from __future__ import annotations

import logging
import pickle
from collections import OrderedDict

import numpy as np
import pytest
import torch

import lmforge.train.checkpoint as checkpoint_package
from lmforge.train.checkpoint.safe_load import TensorRef, decode_skeleton


class _OldTensorRef:
    """What the older lmforge pickled for a tensor: ``lmforge.train.checkpoint._TensorRef(key)``."""

    def __init__(self, key: str) -> None:
        self.key = key


_OldTensorRef.__module__ = "lmforge.train.checkpoint"
_OldTensorRef.__qualname__ = _OldTensorRef.__name__ = "_TensorRef"


def test_an_old_pickled_skeleton_decodes_with_its_tensor_markers(monkeypatch, caplog):
    monkeypatch.setattr(checkpoint_package, "_TensorRef", _OldTensorRef, raising=False)
    old = {
        "state": {0: {"exp_avg": _OldTensorRef("t0"), "step": 3}},
        "rng": ("MT19937", np.arange(4, dtype=np.uint32), 2, 0.5),
        "names": OrderedDict(a=1),
        "kinds": {"x", "y"},
        "dtype": torch.bfloat16,
    }
    data = pickle.dumps(old)  # the default protocol, as the older lmforge pickled
    assert not data.startswith(b"lmforge-json/")
    monkeypatch.setattr("lmforge.train.checkpoint.compat.pickled_skeleton._logged", False)
    with caplog.at_level(logging.INFO, logger="lmforge.train.checkpoint"):
        back = decode_skeleton(data)
    assert back["state"][0]["exp_avg"] == TensorRef("t0") and back["state"][0]["step"] == 3
    assert back["rng"][0] == "MT19937" and back["rng"][1].tolist() == [0, 1, 2, 3]
    assert back["names"] == {"a": 1} and back["kinds"] == {"x", "y"} and back["dtype"] is torch.bfloat16
    assert "pickled by an older lmforge" in caplog.text and "removed in lmforge 0.3" in caplog.text


def test_the_old_reader_still_refuses_other_globals(monkeypatch):
    from lmforge.train.checkpoint.safe_load import UnsafeFileError

    with pytest.raises(UnsafeFileError, match="pickled by an older lmforge"):
        decode_skeleton(pickle.dumps({"f": print}))
