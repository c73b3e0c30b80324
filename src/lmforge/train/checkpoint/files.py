"""The files of a checkpoint directory: names, the tracker, small JSON/YAML writes, fsync."""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lmforge.errors import CheckpointError
from lmforge.utils.atomic import fsync_dir, fsync_file
from lmforge.utils.logging import get_logger

logger = get_logger("lmforge.train.checkpoint")


# DCP warns on every call made without a process group, also from the thread of an asynchronous
# save; one process is a supported case here, so that one message is silenced.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

TRACKER_FILE = "latest_checkpointed_iteration.txt"
COMMON_FILE = "common.json"
CONFIG_FILE = "config.yaml"
# "lmforge-dcp/3": files larger than a block are recorded in checksums.json per block (verified in
# parallel, train/checkpoint/verify.py); a new format so that an lmforge which knows only whole-file
# digests refuses such a checkpoint by name instead of misreading its record. "/2": every file recorded
# by one digest; "/1" came before any record.
FORMAT = "lmforge-dcp/3"
LEGACY_FORMAT = "lmforge-dcp/1"
KNOWN_FORMATS = (LEGACY_FORMAT, "lmforge-dcp/2", FORMAT)
HF_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def iteration_dir_name(step: int) -> str:
    return f"iteration_{step:08d}"


def read_tracker(save_path: str | os.PathLike) -> int | None:
    tracker = Path(save_path) / TRACKER_FILE
    if not tracker.is_file():
        return None
    text = tracker.read_text(encoding="utf-8", errors="replace").strip()[:100]
    try:
        step = int(text)
        if step < 0:
            raise ValueError
        return step
    except ValueError:
        raise CheckpointError(
            f"The checkpoint tracker {tracker} should hold one iteration number, but it holds {text!r}. "
            f"Point checkpoint.load_path at an iteration_XXXXXXXX directory instead, or fix the file."
        ) from None


def write_tracker(save_path: str | os.PathLike, step: int) -> None:
    tracker = Path(save_path) / TRACKER_FILE
    tmp = tracker.with_name(f".{TRACKER_FILE}.tmp")
    with open(tmp, "w") as f:
        f.write(f"{step}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, tracker)
    fsync_dir(tracker.parent)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")


def _write_yaml(path: Path, data: dict[str, Any]) -> None:
    import yaml

    with open(path, "w") as f:
        yaml.safe_dump(data, f, sort_keys=False)


def _fsync_tree(root: Path) -> None:
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            fsync_file(os.path.join(dirpath, name))
        fsync_dir(dirpath)


@contextlib.contextmanager
def _quiet_single_process():
    # DCP warns on every call without a process group; one process is a supported case here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()
