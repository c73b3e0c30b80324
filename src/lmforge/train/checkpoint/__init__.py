"""Checkpoints on torch.distributed.checkpoint (DCP): atomic, rotated, resumable, reshardable.

Layout (the directory names and ``common.json`` follow the original's Checkpoint 2.0 format; the
tensor files are DCP's, so a checkpoint saved on one parallel layout loads into another)::

    {save_path}/
      latest_checkpointed_iteration.txt      # the newest complete iteration, written last
      iteration_{step:08d}/
        .metadata                            # DCP: every key, its shape, dtype and shards
        {prefix}-{rank:07d}-{world:07d}_0.distcp
        common.json                          # step, consumed samples, batch size, format, ...
        config.yaml                          # the run's resolved configuration (for generate)

One DCP state dict holds ``model``, ``optimizer`` (unless no_save_optim), ``scheduler``,
``trainer`` (step counters), and per rank ``rng.rank_{r}`` and ``dataloader.rank_{r}``.

Atomicity: a save is written into the hidden sibling ``.iteration_{step:08d}.partial``, its files
fsynced, then renamed into place; the tracker is replaced last through a temporary file and
``os.replace``. A crash at any point leaves the previous checkpoint and tracker intact; a re-save of
an existing iteration moves the old copy to ``.iteration_X.old`` first, and :func:`resolve_checkpoint`
puts it back if a crash hit between the two renames. A failed save (disk full, ...) is a
``CheckpointError`` that names the intact previous checkpoint.

Reading never runs code from the files (``train/checkpoint/safe_load.py``): ``.metadata`` and non-tensor items go
through allowlisting unpicklers, and the state skeletons are JSON.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import shutil
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemWriter, _StoragePrefix
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lmforge.errors import CheckpointError
from lmforge.models.common.fused_layout import WEIGHT_LAYOUT
from lmforge.train.checkpoint.safe_load import TensorRef as _TensorRef
from lmforge.train.checkpoint.safe_load import (
    decode_skeleton,
    encode_skeleton,
    load_dcp,
    read_dcp_metadata,
)
from lmforge.train.rng import capture_rng_state, restore_rng_state
from lmforge.train.state import TrainState
from lmforge.utils.atomic import check_output_dir, fsync_dir, fsync_file, recover_dir, replace_dir
from lmforge.utils.logging import get_logger

logger = get_logger("lmforge.train.checkpoint")

# DCP warns on every call made without a process group, also from the thread of an asynchronous
# save; one process is a supported case here, so that one message is silenced.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

TRACKER_FILE = "latest_checkpointed_iteration.txt"
COMMON_FILE = "common.json"
CONFIG_FILE = "config.yaml"
FORMAT = "lmforge-dcp/1"
HF_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def iteration_dir_name(step: int) -> str:
    return f"iteration_{step:08d}"


# ---------------------------------------------------------------------------------------------
# What a checkpoint holds
# ---------------------------------------------------------------------------------------------


@dataclass
class Checkpointable:
    """The live objects a checkpoint is taken from and restored into."""

    model: nn.Module
    optimizer: Any = None
    scheduler: Any = None
    dataloader: Any = None
    state: TrainState = field(default_factory=TrainState)


def _model_state_dict(model: nn.Module) -> dict[str, Any]:
    # get_model_state_dict strips wrapper prefixes (activation checkpointing, compile) so names are
    # stable across parallel layouts, and returns DTensors for sharded parameters.
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model)


_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def _canonical_name(name: str) -> str:
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def _optimizer_state_dict(model: nn.Module, optimizer: Any) -> tuple[str, dict[str, Any]]:
    """(format, state dict). "fqn_flat": keyed by parameter names, reshardable; "plain": the optimizer's own.

    "fqn_flat" is torch's flattened form: param-group settings are stored per parameter name too
    (``param_groups.<name>.lr``), because ranks that hold different parameters (pipeline stages) have
    different groups, in different orders; the nested form ("fqn", still read) kept one rank's groups.
    """
    if isinstance(optimizer, torch.optim.Optimizer) and _optimizer_holds_model_params(model, optimizer):
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return "fqn_flat", get_optimizer_state_dict(model, optimizer, options=_optimizer_options("fqn_flat"))
    return "plain", optimizer.state_dict()


def _optimizer_options(optimizer_format: str) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=optimizer_format == "fqn_flat")


def _old_masters(model_sd: dict[str, Any], keys: Any) -> dict[str, Any]:
    """Weights a checkpoint of the old single-device path holds as fp32 masters in the optimizer state
    (``optimizer.state.<name>.master``; its ``model.<name>`` entry is the bf16 copy): name -> the
    parameter they load into. Checkpoints written since 71445a7 store the fp32 weight as ``model.<name>``."""
    return {k: v for k, v in model_sd.items() if f"optimizer.state.{k}.master" in keys}


def _with_old_masters(sd: dict[str, Any], masters: dict[str, Any]) -> dict[str, Any]:
    """``sd`` (either optimizer form) plus the old masters' entries, which DCP loads into the parameters.
    New dicts: torch's optimizer state dict shares them with the live optimizer state."""
    if not isinstance(sd.get("state"), dict):  # flattened: "state.<name>.<key>"
        return {**sd, **{f"state.{k}.master": v for k, v in masters.items()}}
    state = {k: dict(v) for k, v in sd["state"].items()}
    for k, v in masters.items():
        state.setdefault(k, {})["master"] = v
    return {**sd, "state": state}


def _without_old_masters(sd: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(sd.get("state"), dict):
        return {k: v for k, v in sd.items() if not (k.startswith("state.") and k.endswith(".master"))}
    return {
        **sd,
        "state": {k: {kk: vv for kk, vv in v.items() if kk != "master"} for k, v in sd["state"].items()},
    }


def _optimizer_holds_model_params(model: nn.Module, optimizer: Any) -> bool:
    model_params = {id(p) for p in model.parameters()}
    return all(id(p) in model_params for g in optimizer.param_groups for p in g["params"])


def _model_is_finite(model: nn.Module) -> bool:
    # One fused norm per dtype group instead of isfinite() per tensor (60x faster on a CPU): a
    # non-finite element makes its tensor's norm non-finite. (A norm that overflows only flags weights
    # above ~1e19, which are broken anyway.)
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if local.is_floating_point() and local.numel():
            groups.setdefault((local.device, local.dtype), []).append(local.detach())
    finite = all(bool(torch.isfinite(torch.stack(torch._foreach_norm(ts))).all()) for ts in groups.values())
    if dist.is_available() and dist.is_initialized():
        flag = torch.tensor([0 if finite else 1], dtype=torch.int32)
        if dist.get_backend() == "nccl":
            flag = flag.cuda()
        dist.all_reduce(flag)
        finite = int(flag.item()) == 0
    return finite


# ---------------------------------------------------------------------------------------------
# Writer with the prefix in its file names
# ---------------------------------------------------------------------------------------------


class _PrefixedWriter(FileSystemWriter):
    """DCP's file writer, naming each rank's file ``{prefix}-{rank:07d}-{world:07d}_N.distcp``."""

    def __init__(self, path: str | os.PathLike, prefix: str | None) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True, overwrite=True)
        self._stem = f"{prefix}-" if prefix else ""

    def prepare_global_plan(self, plans):  # type: ignore[override]
        world = len(plans)
        return [
            dataclasses.replace(plan, storage_data=_StoragePrefix(f"{self._stem}{i:07d}-{world:07d}_"))
            for i, plan in enumerate(plans)
        ]


# ---------------------------------------------------------------------------------------------
# Saving
# ---------------------------------------------------------------------------------------------


@dataclass
class _PendingSave:
    step: int
    partial_dir: Path
    final_dir: Path
    future: Future | None  # None for a synchronous save (already written)
    started: float


class CheckpointManager:
    """Saves checkpoints of one run: atomic, optionally asynchronous, rotating at ``save_max``.

    Rotation only ever removes iteration directories that this manager wrote (this run), oldest
    first, as in the original; checkpoints of earlier runs in the same ``save_path`` are kept.
    """

    def __init__(
        self,
        save_path: str | os.PathLike,
        *,
        prefix: str | None = "checkpoint",
        save_max: int = 5,
        no_save_optim: bool = False,
        async_save: bool = False,
        config_dict: dict[str, Any] | None = None,
        files_to_copy: list[str | os.PathLike] | None = None,
    ) -> None:
        if not str(save_path):
            raise CheckpointError(
                "checkpoint.save_path: save_path must be provided for CheckpointCallback. Set it to the "
                "directory where iteration_XXXXXXXX/ checkpoints should be written, or set "
                "checkpoint.enable_save: false."
            )
        self.save_path = Path(save_path)
        self.prefix = prefix
        self.save_max = save_max
        self.no_save_optim = no_save_optim
        self.async_save = async_save
        self.config_dict = config_dict
        self.files_to_copy = [Path(p) for p in (files_to_copy or [])]
        self.rank = dist.get_rank() if _distributed() else 0
        self.world_size = dist.get_world_size() if _distributed() else 1
        self.saved_this_run: list[Path] = []
        # Set by recovery (train/recovery/): a checkpoint it may still roll back to is kept beyond save_max.
        self.protect: Callable[[Path], bool] | None = None
        self.keep: Path | None = None  # the best validation checkpoint: never rotated away
        # Set by the trainer for a LoRA run (train/checkpoint/lora.py): where the frozen base came from.
        # With it, checkpoints hold the adapters, buffers and optimizer state only, not the base.
        self.lora_base: dict[str, Any] | None = None
        self._pending: _PendingSave | None = None
        self.last_save_seconds: float = 0.0  # time the training loop was blocked by the last save
        # Async saves run their collectives on a process group of their own: sharing the default one
        # with training's collectives interleaves them and corrupts both (gloo aborts).
        self._pg = dist.new_group(backend="gloo") if (async_save and _distributed()) else None
        if self.rank == 0:
            check_output_dir(self.save_path, "checkpoint.save_path")
            self.save_path.mkdir(parents=True, exist_ok=True)

    # -- public -------------------------------------------------------------------------------

    def save(self, target: Checkpointable, step: int) -> bool:
        """Save ``target`` as iteration ``step``. Returns False if the save was refused."""
        t0 = time.perf_counter()
        self.wait()  # one save in flight at a time; finishing the previous one keeps the order
        if not _model_is_finite(target.model):
            logger.error(
                "Refusing to save a checkpoint at step %d: the model weights contain NaN or Inf. "
                "The previous checkpoint (%s) is kept.",
                step,
                self.latest_iteration(),
            )
            return False
        final_dir = self.save_path / iteration_dir_name(step)
        partial_dir = self.save_path / f".{iteration_dir_name(step)}.partial"
        if self.rank == 0:
            if partial_dir.exists():
                shutil.rmtree(partial_dir)  # leftover of a crashed save
            partial_dir.mkdir(parents=True)
        self._barrier()
        state_dict, common = self._build_state_dict(target, step)
        with self._save_errors(step, partial_dir):
            if self.rank == 0:
                _write_json(partial_dir / COMMON_FILE, common)
                if self.config_dict is not None:
                    _write_yaml(partial_dir / CONFIG_FILE, self.config_dict)
                for src in self.files_to_copy:
                    if src.is_file():
                        shutil.copyfile(src, partial_dir / src.name)
            writer = _PrefixedWriter(partial_dir, self.prefix)
            if self.async_save:
                with _quiet_single_process():
                    future = dcp.async_save(
                        state_dict, storage_writer=writer, process_group=self._pg, no_dist=not _distributed()
                    )
                self._pending = _PendingSave(step, partial_dir, final_dir, future, t0)
                logger.info("Checkpoint save of step %d started in the background -> %s", step, final_dir)
            else:
                with _quiet_single_process():
                    dcp.save(state_dict, storage_writer=writer, no_dist=not _distributed())
                self._pending = _PendingSave(step, partial_dir, final_dir, None, t0)
        if not self.async_save:
            self.wait()  # publishes (an asynchronous save is published by poll()/wait() later)
        self.last_save_seconds = time.perf_counter() - t0
        return True

    def poll(self) -> None:
        """Finish a background save if it is done (called between steps; never blocks)."""
        if self._pending is not None and self._pending.future is not None and self._pending.future.done():
            self.wait()

    def wait(self) -> None:
        """Block until the save in flight (if any) is written and published."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        with self._save_errors(pending.step, pending.partial_dir):
            if pending.future is not None:
                pending.future.result()  # re-raises a failure of the background save
                self._barrier(self._pg)
            if self.rank == 0:
                self._publish(pending)
        self._barrier(self._pg if pending.future is not None else None)

    def close(self) -> None:
        self.wait()

    def latest_iteration(self) -> int | None:
        return read_tracker(self.save_path)

    # -- internals ----------------------------------------------------------------------------

    def _build_state_dict(self, target: Checkpointable, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
        model_sd = _model_state_dict(target.model)
        from lmforge.train.checkpoint.lora import has_adapters, without_frozen

        adapters_only = self.lora_base is not None and has_adapters(target.model)
        if adapters_only:
            model_sd = without_frozen(target.model, model_sd)
        sd: dict[str, Any] = {"model": model_sd}
        optimizer_format = None
        if target.optimizer is not None and not self.no_save_optim:
            optimizer_format, sd["optimizer"] = _optimizer_state_dict(target.model, target.optimizer)
            if optimizer_format == "plain":
                sd["optimizer"] = encode_state(sd["optimizer"])
        if target.scheduler is not None:
            sd["scheduler"] = encode_state(target.scheduler.state_dict())
        sd["trainer"] = encode_state(target.state.to_dict())
        sd["rng"] = {f"rank_{self.rank}": encode_state(capture_rng_state())}
        if target.dataloader is not None and hasattr(target.dataloader, "state_dict"):
            sd["dataloader"] = {f"rank_{self.rank}": encode_state(target.dataloader.state_dict())}
        state = target.state
        common = {
            # The original's CommonInfo fields.
            "epoch_num": int(state.epoch) or 1,
            "step_num": int(state.max_steps),
            "global_step": int(step),
            "loss_scale": float(state.loss_scaler.get("scale", 1.0)),  # fp16 only; 1.0 otherwise
            "global_batch_size": int(state.global_batch_size),
            "consumed_samples": int(state.consumed_samples),
            "ckpt_status": None,
            # lmforge's additions.
            "format": FORMAT,
            "weight_layout": WEIGHT_LAYOUT,  # rows of the fused weights (models/common/fused_layout.py)
            "world_size": self.world_size,
            "has_optimizer": "optimizer" in sd,
            "optimizer_format": optimizer_format,
            "prefix": self.prefix,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        if adapters_only:
            common["lora_base"] = self.lora_base
        return sd, common

    def _publish(self, pending: _PendingSave) -> None:
        """Rank 0: fsync, rename the partial directory into place, update the tracker, rotate."""
        _fsync_tree(pending.partial_dir)
        final_dir = pending.final_dir
        # Re-saving a step (as the original does) moves the old one aside to .iteration_X.old first,
        # so that at any moment one complete copy exists; resolve_checkpoint() finds it there if a
        # crash hits between the two renames.
        replace_dir(pending.partial_dir, final_dir)
        write_tracker(self.save_path, pending.step)
        seconds = time.perf_counter() - pending.started
        logger.info("Saved checkpoint of step %d to %s (%.2fs)", pending.step, final_dir, seconds)
        if final_dir in self.saved_this_run:
            self.saved_this_run.remove(final_dir)
        self.saved_this_run.append(final_dir)
        self._rotate()

    @contextlib.contextmanager
    def _save_errors(self, step: int, partial_dir: Path):
        """A failed write (disk full, read-only, ...) is a clear error; the previous checkpoint is kept."""
        from torch.distributed.checkpoint.api import CheckpointException

        from lmforge.train.checkpoint.safe_load import first_failure

        try:
            yield
        except (CheckpointException, OSError) as exc:
            inner = first_failure(exc)
            if self.rank == 0:
                shutil.rmtree(partial_dir, ignore_errors=True)
            raise CheckpointError(
                f"Saving the checkpoint of step {step} under {self.save_path} failed: {type(inner).__name__}: "
                f"{inner}. The save did not complete; the previous checkpoint (iteration {self.latest_iteration()}) "
                "is intact and still the latest. Free space or fix the permissions of checkpoint.save_path, then resume."
            ) from None

    def _rotate(self) -> None:
        # save_max < 1 would make the original delete the checkpoint it just wrote; here it keeps all.
        if self.save_max < 1:
            return
        # Never rotated away: a checkpoint recovery may still roll back to (train/recovery/), and the best
        # validation checkpoint (kept beside save_max others).
        removable = [
            p for p in self.saved_this_run if p != self.keep and (self.protect is None or not self.protect(p))
        ]
        while len(removable) > self.save_max:
            oldest = removable.pop(0)
            self.saved_this_run.remove(oldest)
            logger.info(
                "The current number of weights is: %d, more than 'keep_checkpoint_max': %d. "
                "So, the oldest directory: '%s' will be removed!",
                len(self.saved_this_run) + 1,
                self.save_max,
                oldest,
            )
            shutil.rmtree(oldest, ignore_errors=True)

    def _barrier(self, group: Any = None) -> None:
        if _distributed():
            dist.barrier(group=group)


# ---------------------------------------------------------------------------------------------
# Tracker and file helpers
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# Finding and reading a checkpoint
# ---------------------------------------------------------------------------------------------


@dataclass
class CheckpointHeader:
    """A resolved checkpoint: what kind it is, where, and its ``common.json``."""

    kind: str  # "dcp" or "hf"
    path: Path
    common: dict[str, Any] = field(default_factory=dict)

    @property
    def has_optimizer(self) -> bool:
        return bool(self.common.get("has_optimizer", False))

    @property
    def global_step(self) -> int:
        return int(self.common.get("global_step", 0))


def is_hf_model_dir(path: Path) -> bool:
    if any((path / name).is_file() for name in HF_WEIGHT_FILES):
        return True
    return any(path.glob("*model.safetensors.index.json"))


def resolve_checkpoint(load_path: str | os.PathLike) -> CheckpointHeader | None:
    """Resolve ``checkpoint.load_path`` as the original does; None when there is nothing to load.

    A missing path or an empty directory means "start from scratch" (logged). An HF model
    directory is used as is; a save directory with a tracker resolves to its latest iteration;
    otherwise the path must be an iteration directory itself.
    """
    path = Path(load_path)
    if not str(load_path) or not path.exists() or (path.is_dir() and not any(path.iterdir())):
        logger.warning(
            "checkpoint.load_path %r does not exist or is empty: training starts from scratch.",
            str(load_path),
        )
        return None
    if not path.is_dir():
        raise CheckpointError(
            f"checkpoint.load_path {str(path)!r} is a file; it must be a directory: a checkpoint save_path "
            f"(with {TRACKER_FILE}), one iteration_XXXXXXXX directory, or a Hugging Face model directory."
        )
    if is_hf_model_dir(path):
        _check_hf_index(path)
        return CheckpointHeader("hf", path, {})
    step = read_tracker(path)
    if step is not None:
        it = path / iteration_dir_name(step)
        if not it.is_dir():
            it = _recovered_iteration(it)
        if not it.is_dir():
            raise CheckpointError(
                f"{path / TRACKER_FILE} names iteration {step}, but {it} does not exist. Point "
                f"checkpoint.load_path at an existing iteration_XXXXXXXX directory."
            )
        path = it
    if not (path / ".metadata").is_file():
        found = sorted(p.name for p in path.glob("iteration_*") if p.is_dir())
        hint = f" It contains {', '.join(found[-3:])} but no {TRACKER_FILE}." if found else ""
        raise CheckpointError(
            f"checkpoint.load_path {str(Path(load_path))!r} is not a checkpoint: expected a save_path with "
            f"{TRACKER_FILE}, an iteration_XXXXXXXX directory (with a DCP .metadata file), or a Hugging Face "
            f"model directory (model.safetensors or *model.safetensors.index.json).{hint}"
        )
    common = _read_common(path / COMMON_FILE)
    if "has_optimizer" not in common:
        common["has_optimizer"] = any(
            k.startswith("optimizer.") for k in _read_metadata(path).state_dict_metadata
        )
    return CheckpointHeader("dcp", path, common)


def _read_common(common_file: Path) -> dict[str, Any]:
    if not common_file.is_file():
        return {}
    try:
        common = json.loads(common_file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        common = exc
    if not isinstance(common, dict):
        raise CheckpointError(
            f"{common_file} is not the JSON object lmforge writes ({common if isinstance(common, Exception) else type(common).__name__}); "
            "the checkpoint is corrupt or truncated. Use another iteration of the save_path."
        )
    for key in ("global_step", "consumed_samples", "world_size", "global_batch_size"):
        if key in common and (
            isinstance(common[key], bool) or not isinstance(common[key], int) or common[key] < 0
        ):
            raise CheckpointError(
                f"{common_file}: {key} must be a non-negative integer, found {common[key]!r}; the checkpoint is "
                "corrupt. Use another iteration of the save_path."
            )
    return common


def _recovered_iteration(it: Path) -> Path:
    """The iteration a crash during a re-save left under its ``.old`` name (put back when possible)."""
    old = it.with_name(f".{it.name}.old")
    if not (old / ".metadata").is_file():
        return it
    try:
        recover_dir(it)
    except OSError:
        return old  # a read-only save_path: load it where it is
    logger.warning("Recovered %s from %s (a crash interrupted its re-save).", it, old.name)
    return it


def _check_hf_index(path: Path) -> None:
    for index in path.glob("*model.safetensors.index.json"):
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        missing = sorted({f for f in weight_map.values() if not (path / f).is_file()})
        if missing:
            raise CheckpointError(
                f"The Hugging Face index {index} lists weight files that are missing from {path}: "
                f"{', '.join(missing[:5])}. Download the complete model directory."
            )


def _read_metadata(path: Path):
    # Never pickle.load: see train/checkpoint/safe_load.py (a .metadata file could otherwise run code).
    return read_dcp_metadata(path)


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


NO_OPTIMIZER_MESSAGE = (
    "no_load_optim is False but no optimizer checkpoint found in {dir}. Please ensure the checkpoint "
    "directory contains optimizer weight files (optimizer state; it is absent when the checkpoint was saved "
    "with checkpoint.no_save_optim: true), or set no_load_optim=True to skip optimizer loading."
)
HF_RESUME_MESSAGE = (
    "Resume training (no_load_optim=False) is not supported for HuggingFace checkpoints. "
    "{dir} is a Hugging Face model directory: set checkpoint.no_load_optim: true to fine-tune from its weights."
)


def load_checkpoint(
    header: CheckpointHeader,
    target: Checkpointable,
    *,
    no_load_optim: bool,
    hf_loader: Callable[[nn.Module, Path], None] | None = None,
    partial_load: bool = False,
) -> None:
    """Restore ``target`` from ``header``.

    With ``no_load_optim`` only the model weights are loaded; otherwise model, optimizer, scheduler, trainer counters, data position
    and RNG states are restored, so training continues exactly.
    """
    if header.kind == "hf":
        if not no_load_optim:
            raise CheckpointError(HF_RESUME_MESSAGE.format(dir=header.path))
        if hf_loader is None:
            raise CheckpointError(
                f"{header.path} is a Hugging Face model directory, but this model type cannot load Hugging Face "
                f"weights. Use an lmforge checkpoint (iteration_XXXXXXXX) as checkpoint.load_path."
            )
        hf_loader(target.model, header.path)
        logger.info("Loaded Hugging Face weights from %s (optimizer state starts fresh).", header.path)
        return
    if not no_load_optim and target.optimizer is not None and not header.has_optimizer:
        raise CheckpointError(NO_OPTIMIZER_MESSAGE.format(dir=header.path))
    metadata = _read_metadata(header.path)
    keys = metadata.state_dict_metadata
    rank = dist.get_rank() if _distributed() else 0
    model_sd = _model_state_dict(target.model)
    from lmforge.models.lora import is_lora_param_name

    if not any(is_lora_param_name(k) for k in model_sd) and any(
        k.startswith("model.") and is_lora_param_name(k) for k in keys
    ):
        # Loading only the base would silently drop what the fine-tuning learnt.
        raise CheckpointError(
            f"Checkpoint {header.path} holds LoRA adapters (the run had lora_config) but the model has none. "
            "Build the model with the run's lora_config (lmforge generate / eval read it from the checkpoint's "
            "config.yaml or --config), or export the merged model with 'lmforge convert --to-hf DIR --from CKPT'."
        )
    lora_base = header.common.get("lora_base")
    if lora_base and any(is_lora_param_name(k) for k in model_sd):
        # A small LoRA checkpoint: the frozen base is rebuilt from its record, then the rest is loaded.
        from lmforge.train.checkpoint.lora import restore_base, without_frozen

        restore_base(lora_base, target.model, header.path, hf_loader)
        model_sd = without_frozen(target.model, model_sd)
    if no_load_optim:
        # Fine-tuning with LoRA from a checkpoint of the base model: the adapters keep their fresh init.
        fresh = {k for k in model_sd if f"model.{k}" not in keys and is_lora_param_name(k)}
        model_sd = {k: v for k, v in model_sd.items() if k not in fresh}
    model_sd = _matching_parameters(header.path, model_sd, keys, partial_load, no_load_optim)
    _check_shapes(header.path, model_sd, keys)
    masters = _old_masters(model_sd, keys)
    if masters:
        logger.warning(
            "Checkpoint %s was written by the old single-device path (bf16 weights, fp32 masters in the "
            "optimizer state): converting on load, its fp32 masters become the fp32 parameters. Checkpoints "
            "saved from now on hold the fp32 weights themselves.",
            header.path,
        )
    # The old path's masters load straight into the fp32 parameters (not its bf16 copies of them).
    sd: dict[str, Any] = {"model": {k: v for k, v in model_sd.items() if k not in masters}}
    if masters:
        sd["optimizer"] = {"state": {k: {"master": v} for k, v in masters.items()}}
    optimizer_format = header.common.get("optimizer_format") or "plain"
    own_rng, own_loader = f"rank_{rank}", f"rank_{rank}"
    same_layout = int(header.common.get("world_size", 1)) == (dist.get_world_size() if _distributed() else 1)
    local_param_names = None
    if not no_load_optim:
        if target.optimizer is not None:
            if optimizer_format in ("fqn", "fqn_flat"):
                from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

                state = get_optimizer_state_dict(
                    target.model, target.optimizer, options=_optimizer_options(optimizer_format)
                )
                sd["optimizer"] = _with_old_masters(state, masters)
                if optimizer_format == "fqn":
                    local_param_names = [group["params"] for group in sd["optimizer"]["param_groups"]]
            else:
                sd["optimizer"] = _allocate_encoded(metadata, "optimizer")
        if target.scheduler is not None and _has_key(keys, "scheduler"):
            sd["scheduler"] = _allocate_encoded(metadata, "scheduler")
        sd["trainer"] = _allocate_encoded(metadata, "trainer")
        if _has_key(keys, f"rng.{own_rng}"):
            sd["rng"] = {own_rng: _allocate_encoded(metadata, f"rng.{own_rng}")}
        if target.dataloader is not None and same_layout and _has_key(keys, f"dataloader.{own_loader}"):
            sd["dataloader"] = {own_loader: _allocate_encoded(metadata, f"dataloader.{own_loader}")}

    with _quiet_single_process():
        load_dcp(sd, header.path, no_dist=not _distributed())
    if local_param_names is not None:
        # The nested form saved a group's parameter names once, from one rank; pipeline stages hold
        # different parameters, so each rank keeps its own names.
        for group, names in zip(sd["optimizer"]["param_groups"], local_param_names):
            group["params"] = names

    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(target.model, {**sd["model"], **masters}, options=_non_strict())
    adapters_only = bool(lora_base and any(is_lora_param_name(k) for k in model_sd))
    if no_load_optim:
        _upgrade_layout(header, target, adapters_only)
        logger.info(
            "Loaded model weights from %s (no_load_optim: optimizer and step start fresh).", header.path
        )
        return
    if target.optimizer is not None:
        if optimizer_format in ("fqn", "fqn_flat"):
            from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

            set_optimizer_state_dict(
                target.model,
                target.optimizer,
                _without_old_masters(sd["optimizer"]),
                options=_optimizer_options(optimizer_format),
            )
        else:
            target.optimizer.load_state_dict(decode_state(sd["optimizer"]))
    _upgrade_layout(header, target, adapters_only)
    if "scheduler" in sd:
        target.scheduler.load_state_dict(decode_state(sd["scheduler"]))
    target.state.load_dict(decode_state(sd["trainer"]))
    if "rng" in sd:
        restore_rng_state(decode_state(sd["rng"][own_rng]))
    else:
        logger.warning(
            "Checkpoint %s has no RNG state for rank %d (saved on %s ranks): random streams restart from the seed.",
            header.path,
            rank,
            header.common.get("world_size", "?"),
        )
    if "dataloader" in sd and hasattr(target.dataloader, "load_state_dict"):
        target.dataloader.load_state_dict(decode_state(sd["dataloader"][own_loader]))
    logger.info("Resumed from %s at step %d.", header.path, target.state.global_step)


def _upgrade_layout(header: CheckpointHeader, target: Checkpointable, adapters_only: bool) -> None:
    from lmforge.train.checkpoint.layout_upgrade import checkpoint_layout, upgrade_fused_layout

    layout = checkpoint_layout(header.common)
    if layout != WEIGHT_LAYOUT:
        upgrade_fused_layout(target.model, target.optimizer, layout, header.path, adapters_only)


def load_model_weights(path: str | os.PathLike, model: nn.Module) -> CheckpointHeader:
    """Load only the model weights of a checkpoint (for generation and evaluation)."""
    header = resolve_checkpoint(path)
    if header is None:
        raise CheckpointError(f"No checkpoint found at {path}: the directory is missing or empty.")
    if header.kind == "hf":
        raise CheckpointError(f"{header.path} is a Hugging Face model directory, not an lmforge checkpoint.")
    load_checkpoint(header, Checkpointable(model=model), no_load_optim=True)
    return header


def _matching_parameters(
    path: Path, model_sd: dict[str, Any], keys: Any, partial_load: bool, no_load_optim: bool
) -> dict[str, Any]:
    """The model's parameters to load; a checkpoint with other parameters is refused unless
    ``checkpoint.partial_load`` says to load the common ones (and the others are listed)."""
    missing = [k for k in model_sd if f"model.{k}" not in keys]
    # Under pipeline parallelism a rank holds only its stage's layers: a checkpoint parameter is
    # unexpected only if no rank's model has it (a collective: every rank loads).
    known: set[str] = set(model_sd)
    if _distributed():
        names: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(names, sorted(model_sd))
        known = {n for rank_names in names for n in rank_names}
    unexpected = sorted(
        k[len("model.") :] for k in keys if k.startswith("model.") and k[len("model.") :] not in known
    )
    if not missing and not unexpected:
        return model_sd
    if not partial_load:
        parts = []
        if missing:
            parts.append(
                f"{len(missing)} parameter(s) of the model are missing from it, e.g. {', '.join(missing[:5])}"
            )
        if unexpected:
            parts.append(
                f"it holds {len(unexpected)} parameter(s) the model does not have, e.g. {', '.join(unexpected[:5])}"
            )
        raise CheckpointError(
            f"Checkpoint {path} does not match the model: {'; '.join(parts)}. Check that the model section is the "
            "one the checkpoint was trained with (e.g. num_hidden_layers), or set checkpoint.partial_load: true "
            "(with no_load_optim: true) to load only the parameters both have."
        )
    if not no_load_optim:
        raise CheckpointError(
            "checkpoint.partial_load: true loads model weights only; set checkpoint.no_load_optim: true as well "
            "(the optimizer state of a different set of parameters cannot be resumed)."
        )
    logger.warning(
        "checkpoint.partial_load: loading %d of the model's %d parameters from %s. Not in the checkpoint (keep "
        "their initial values): %s. In the checkpoint but not in the model (skipped): %s.",
        len(model_sd) - len(missing),
        len(model_sd),
        path,
        ", ".join(missing) or "none",
        ", ".join(unexpected) or "none",
    )
    return {k: v for k, v in model_sd.items() if k not in missing}


def _check_shapes(path: Path, model_sd: dict[str, Any], keys: dict[str, Any]) -> None:
    bad = []
    for name, tensor in model_sd.items():
        meta = keys[f"model.{name}"]
        if isinstance(meta, TensorStorageMetadata) and tuple(meta.size) != tuple(tensor.shape):
            bad.append(f"{name}: checkpoint {tuple(meta.size)} vs model {tuple(tensor.shape)}")
    if bad:
        raise CheckpointError(
            f"Checkpoint {path} does not match the model's shapes ({len(bad)} parameter(s)): {'; '.join(bad[:3])}. "
            f"Check that the model section is the one the checkpoint was trained with."
        )


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


def _non_strict():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(strict=False)
