"""Offline: is a registry task's dataset in the local Hugging Face cache? Asked by ``lmforge eval
--tasks`` before anything is built, when the Hub cannot be reached.

The harness finds out that a task's dataset is missing only after it has indexed every task YAML it
ships (about 14,000 files, their ``include`` files parsed again for each) and after lmforge has built
the model: most of a minute before its one error. Here the named task's own YAML is found by a text
search for its ``task: NAME`` line (the harness's rule for a duplicate name: the first file in path
order wins), read with the harness's own loader (``include`` resolved), and its ``dataset_path`` /
``dataset_name`` / ``dataset_kwargs`` are asked of ``datasets``' builder in offline mode, which
resolves them exactly as the harness's later ``load_dataset`` would.

Only a definite answer refuses: ``datasets`` saying the files are not there. A group, a tag, a task
defined in Python, a name found nowhere, tasks of ``--include-path`` (which may redefine a name) and any
other error are left to the harness, whose later error stays the same.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class UncachedTask:
    task: str
    dataset: str  # dataset_path, with dataset_name when the task names one


def is_missing_download(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or what caused it) is a download that offline mode or the network refused."""
    seen = 0
    while exc is not None and seen < 10:
        name = type(exc).__name__
        text = str(exc)
        if isinstance(exc, (ConnectionError, TimeoutError)) or name in (
            "OfflineModeIsEnabled",
            "LocalEntryNotFoundError",
            "DatasetNotFoundError",
            "ConnectError",
            "ConnectTimeout",
        ):
            return True
        if "offline" in text.lower() or "Couldn't reach" in text or "couldn't find" in text.lower():
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def first_uncached_task(tasks: list[str]) -> UncachedTask | None:
    """The first of the registry ``tasks`` whose dataset ``datasets`` (in offline mode) says is not in
    the local cache; None when every one is there or cannot be told without the harness."""
    import lm_eval.tasks

    root = Path(lm_eval.tasks.__file__).parent
    for task in tasks:
        if task.endswith(".jsonl"):
            continue
        config = _task_config(task, root)
        if config is not None and _cached(config) is False:
            name = config.get("dataset_name")
            return UncachedTask(task, f"{config['dataset_path']}" + (f", {name}" if name else ""))
    return None


def _task_config(task: str, root: Path) -> dict[str, Any] | None:
    """The harness config of the plain YAML task ``task`` under ``root`` (includes resolved), or None."""
    from lm_eval.tasks._yaml_loader import load_yaml

    name = re.escape(task.encode())  # a top-level `task: NAME` line, either part quoted or not
    line = re.compile(rb"^(['\"]?)task\1:[ \t]*(['\"]?)" + name + rb"\2[ \t]*(#.*)?$", re.M)
    paths = (p for p in root.glob("**/*.yaml") if "__pycache__" not in p.parts)
    for path in sorted(paths, key=lambda p: p.as_posix()):
        try:
            if not line.search(path.read_bytes()):
                continue
            config = load_yaml(path, resolve_func=False, recursive=True)
        except Exception:  # noqa: BLE001 (a file the harness itself would skip)
            continue
        plain = "class" not in config and "group" not in config and config.get("task") == task
        if not plain or not isinstance(config.get("dataset_path"), str):
            return None
        return config
    return None


def _cached(config: dict[str, Any]) -> bool | None:
    """True / False: ``datasets`` finds / does not find the task's dataset offline; None: it cannot say."""
    kwargs = config.get("dataset_kwargs") or {}
    name = config.get("dataset_name")
    if not isinstance(kwargs, dict) or (name is not None and not isinstance(name, str)):
        return None
    try:
        import datasets

        datasets.load_dataset_builder(config["dataset_path"], name, **kwargs)
    except Exception as exc:  # noqa: BLE001 (datasets raises many kinds for a missing download)
        return False if is_missing_download(exc) else None
    return True
