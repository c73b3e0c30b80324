"""Saving: ``CheckpointManager`` writes atomic, optionally asynchronous, rotated checkpoints."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemWriter, _StoragePrefix

from lmforge.errors import CheckpointError
from lmforge.models.common.fused_layout import WEIGHT_LAYOUT
from lmforge.train.checkpoint.files import (
    COMMON_FILE,
    CONFIG_FILE,
    FORMAT,
    TRACKER_FILE,
    _distributed,
    _fsync_tree,
    _quiet_single_process,
    _write_json,
    _write_yaml,
    iteration_dir_name,
    read_tracker,
    write_tracker,
)
from lmforge.train.checkpoint.state_codec import encode_state
from lmforge.train.checkpoint.state_dicts import (
    Checkpointable,
    _model_is_finite,
    _model_state_dict,
    _optimizer_state_dict,
)
from lmforge.train.checkpoint.verify import digest_rank_files, rank_file_stem, write_checksums
from lmforge.train.rng import capture_rng_state
from lmforge.utils.atomic import check_output_dir, recover_dir, replace_dir
from lmforge.utils.logging import get_logger

logger = get_logger("lmforge.train.checkpoint")

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
    future: Future | None  # None for a synchronous save (already written); else its digests
    started: float
    digests: dict[str, Any] = field(default_factory=dict)  # this rank's shard files (synchronous save)


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
        # Set by recovery (train/recovery/): a checkpoint it may still roll back to is kept beyond save_max,
        # and a save of weights it knows to be damaged is refused (the reason; None: save).
        self.protect: Callable[[Path], bool] | None = None
        self.refuse: Callable[[int], str | None] | None = None
        self.last_step: int | None = None  # the step of this manager's last save (None: none yet)
        self.keep: Path | None = None  # the best validation checkpoint: never rotated away
        # Set by the trainer for a LoRA run (train/checkpoint/lora.py): where the frozen base came from.
        # With it, checkpoints hold the adapters, buffers and optimizer state only, not the base.
        self.lora_base: dict[str, Any] | None = None
        self._pending: _PendingSave | None = None
        self._hasher: ThreadPoolExecutor | None = None  # hashes the files of an asynchronous save
        self.last_save_seconds: float = 0.0  # time the training loop was blocked by the last save
        # Async saves run their collectives on a process group of their own: sharing the default one
        # with training's collectives interleaves them and corrupts both (gloo aborts).
        self._pg = dist.new_group(backend="gloo") if (async_save and _distributed()) else None
        # poll()'s agreement runs on the main thread while DCP may still use _pg in its background thread:
        # two threads issuing collectives on one group interleave them (a hang), so it has a group too.
        self._agree_pg = dist.new_group(backend="gloo") if (async_save and _distributed()) else None
        if self.rank == 0:
            check_output_dir(self.save_path, "checkpoint.save_path")
            self.save_path.mkdir(parents=True, exist_ok=True)

    # -- public -------------------------------------------------------------------------------

    def save(self, target: Checkpointable, step: int) -> bool:
        """Save ``target`` as iteration ``step``. Returns False if the save was refused."""
        t0 = time.perf_counter()
        self.wait()  # one save in flight at a time; finishing the previous one keeps the order
        if self._refused(step):
            return False
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
            stem = rank_file_stem(self.prefix, self.rank, self.world_size)
            if self.async_save:
                with _quiet_single_process():
                    future = dcp.async_save(
                        state_dict, storage_writer=writer, process_group=self._pg, no_dist=not _distributed()
                    )
                if self._hasher is None:
                    self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmforge-ckpt-hash")
                # This rank's files are hashed in the background too, once DCP has written them.
                hashed = self._hasher.submit(_digest_when_written, future, partial_dir, stem)
                self._pending = _PendingSave(step, partial_dir, final_dir, hashed, t0)
                logger.info("Checkpoint save of step %d started in the background -> %s", step, final_dir)
            else:
                with _quiet_single_process():
                    dcp.save(state_dict, storage_writer=writer, no_dist=not _distributed())
                digests = digest_rank_files(partial_dir, stem)
                self._pending = _PendingSave(step, partial_dir, final_dir, None, t0, digests)
        if not self.async_save:
            self.wait()  # publishes (an asynchronous save is published by poll()/wait() later)
        self.last_save_seconds = time.perf_counter() - t0
        self.last_step = step
        return True

    def _refused(self, step: int) -> bool:
        """Whether ``refuse`` (recovery) vetoes this save on any rank: agreed, as the save is collective."""
        if self.refuse is None:
            return False
        why = self.refuse(step)
        refused = why is not None
        if _distributed():
            flag = torch.tensor([1 if refused else 0], dtype=torch.int32)
            if dist.get_backend() == "nccl":
                flag = flag.cuda()
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            refused = bool(int(flag.item()))
        if refused:
            logger.warning(
                "Not saving the checkpoint of step %d: %s.",
                step,
                why or "recovery refused it on another rank",
            )
        return refused

    def poll(self) -> None:
        """Finish a background save once it is done on every rank (called between steps, at the same
        point on every rank; never waits for the save itself).

        Each rank's part finishes at its own time (its writes, then hashing its files). Finishing is
        collective (the digests are gathered, rank 0 publishes, all meet at a barrier), so the ranks first
        agree that all are done: a rank that went ahead alone would wait in the checkpoint group while
        the others wait for it in the next step's collectives (seen as a hang of 2 ranks). The agreement
        has its own group: the save's group may still be busy in DCP's background thread."""
        if self._pending is None or self._pending.future is None:
            return
        done = self._pending.future.done()
        if self._agree_pg is not None:
            flag = torch.tensor([1 if done else 0], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._agree_pg)
            done = bool(flag.item())
        if done:
            self.wait()

    def wait(self) -> None:
        """Block until the save in flight (if any) is written and published."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        with self._save_errors(pending.step, pending.partial_dir):
            digests = pending.digests
            if pending.future is not None:
                digests = pending.future.result()  # re-raises a failure of the background save
            digests = self._gather_digests(digests, self._pg if pending.future is not None else None)
            if self.rank == 0:
                write_checksums(pending.partial_dir, digests)
                self._publish(pending)
        self._barrier(self._pg if pending.future is not None else None)

    def close(self) -> None:
        self.wait()
        if self._hasher is not None:
            self._hasher.shutdown()
            self._hasher = None

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
        callbacks_state = target.callbacks.state_dict() if target.callbacks is not None else None
        if callbacks_state:
            sd["callbacks"] = {f"rank_{self.rank}": encode_state(callbacks_state)}
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
            # Resuming with another optimizer type is refused (train/checkpoint/load.py).
            "optimizer_type": type(target.optimizer).__name__ if "optimizer" in sd else None,
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

    def _gather_digests(self, digests: dict[str, Any], group: Any) -> dict[str, Any]:
        """Every rank's shard digests, merged (a collective; it is also the barrier before publishing)."""
        if not _distributed():
            return digests
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, digests, group=group)
        return {name: d for rank_digests in gathered for name, d in rank_digests.items()}

    def _barrier(self, group: Any = None) -> None:
        if _distributed():
            dist.barrier(group=group)


def _digest_when_written(future: Future, directory: Path, stem: str) -> dict[str, Any]:
    future.result()  # re-raises a failure of the background save
    return digest_rank_files(directory, stem)


def recover_save_path(save_path: str | os.PathLike) -> list[str]:
    """Rank 0, holding the run lock of ``save_path``: finish or undo what a crash left of a save.

    ``.iteration_X.partial`` (a save that never completed; the tracker never named it) is removed;
    ``.iteration_X.old`` (a re-save interrupted between its renames) is put back when ``iteration_X`` is
    missing and removed when it is complete; a tracker's temporary file is removed. Returns what was done.
    """
    root = Path(save_path)
    if not root.is_dir():
        return []
    done = []
    for leftover in sorted(root.glob(".iteration_*.partial")):
        shutil.rmtree(leftover, ignore_errors=True)
        done.append(f"removed the interrupted save {leftover.name}")
    for old in sorted(root.glob(".iteration_*.old")):
        live = root / old.name[1 : -len(".old")]
        if recover_dir(live):
            done.append(f"restored {live.name} from {old.name}")
        else:
            shutil.rmtree(old, ignore_errors=True)
            done.append(f"removed {old.name} (its replacement {live.name} is complete)")
    for tmp in root.glob(f".{TRACKER_FILE}.tmp"):
        tmp.unlink(missing_ok=True)
        done.append(f"removed {tmp.name}")
    for line in done:
        logger.warning("checkpoint.save_path %s: %s.", root, line)
    return done
