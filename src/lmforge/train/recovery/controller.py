"""Self-healing training: detect on every rank together, roll back to the newest safe checkpoint, go on.

The trainer delegates to :class:`Recovery` at four points: after each step (``observe``), in the stop
agreement before each step (``vote_values`` / ``agree``: one all-reduce carries both votes), when a
rollback is agreed (``roll_back``, through the resume code path of train/checkpoint) and around each step
(``scaled_lr``). Checkpoint rotation asks ``protects`` before deleting a checkpoint.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lmforge.config import TrainConfig
from lmforge.config.sections_recovery import RecoveryConfig
from lmforge.train.checkpoint import iteration_dir_name, load_checkpoint, resolve_checkpoint
from lmforge.train.recovery.detector import Anomaly, AnomalyDetector
from lmforge.train.recovery.give_up import marker_path, write_give_up_marker
from lmforge.train.recovery.quarantine import quarantine
from lmforge.train.recovery.safe_checkpoint import complete_iterations, newest_safe
from lmforge.train.recovery.snapshot import Snapshot, Snapshots
from lmforge.train.state import RECOVERY_KEY
from lmforge.utils.logging import get_logger

logger = get_logger("lmforge.train.recovery")

_NO_ONSET = -(2**62)  # the vote's "no anomaly here" (votes are reduced with MAX over -onset)
STATE_KEY = RECOVERY_KEY  # TrainState.extra[STATE_KEY]: rollbacks, end of the lowered-lr window, detector


class Recovery:
    """The ``recovery:`` section at work in one trainer (one per rank)."""

    def __init__(self, section: RecoveryConfig, save_path: str | Path) -> None:
        self.section = section
        self.save_path = Path(save_path)
        self.detector = AnomalyDetector()
        self.pending: Anomaly | None = None  # seen on this rank, not yet agreed
        self.agreed: Anomaly | None = None  # agreed by every rank: roll back before the next step
        self.rollbacks = 0
        self.lr_scaled_until = 0  # steps up to this one train at lr x lr_scale
        self.gave_up = False  # max_rollbacks reached or no safe checkpoint: the run stops
        self.snapshots: Snapshots | None = None  # recovery.snapshot_interval > 0: the in-memory snapshots
        self.events: list[dict[str, Any]] = []

    # -- state that survives restarts (in the checkpoint's trainer state) -----------------------------

    def start(self, state: Any) -> None:
        saved = state.extra.get(STATE_KEY) or {}
        self.rollbacks = int(saved.get("rollbacks", 0))
        self.lr_scaled_until = int(saved.get("lr_scaled_until", 0))
        # The detector's recent losses: without them a resumed run could not judge a spike in its first
        # steps, and a damaged step there would be accepted as normal (and later restored as safe).
        self.detector.load_state_dict(saved.get("detector") or {})

    def _remember(self, state: Any) -> None:
        state.extra[STATE_KEY] = {
            "rollbacks": self.rollbacks,
            "lr_scaled_until": self.lr_scaled_until,
            "detector": self.detector.state_dict(),
        }

    # -- detection ------------------------------------------------------------------------------------

    def observe(self, state: Any, result: Any, skip_limit: int) -> Anomaly | None:
        """Judge the step just done (every rank sees the same reduced loss; the vote decides)."""
        if self.pending is None:
            self.pending = self.detector.observe(
                int(state.global_step),
                float(result.loss),
                bool(result.skipped),
                int(state.consecutive_skips),
                skip_limit,
            )
            self._remember(state)  # the checkpoint of this step carries the detector's history
        return self.pending

    def vote_values(self) -> list[int]:
        return [1 if self.pending else 0, -self.pending.onset if self.pending else _NO_ONSET]

    def agree(self, values: list[int]) -> None:
        """The reduced vote (MAX over ranks): any rank's anomaly, at the earliest onset any rank saw."""
        if not values[0]:
            return
        onset = -int(values[1])
        reason = self.pending.reason if self.pending is not None else "an anomaly detected on another rank"
        self.agreed = Anomaly(reason, onset)

    def vote_at_end(self, ctx: Any) -> bool:
        """After the last step: does any rank want a rollback? (collective, so every rank loops or not)"""
        want = self.pending is not None and self.agreed is None
        if ctx.distributed:
            flag = torch.tensor([1 if want else 0], device=ctx.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            want = bool(int(flag.item()))
        return want

    # -- rotation -------------------------------------------------------------------------------------

    def protects(self, path: Path) -> bool:
        """Whether ``path`` is the checkpoint a rollback would restore now (rotation keeps it)."""
        # The next step's loss may still spike: the newest verified weights are safe for it.
        onsets = [(self.detector.newest_verified_step() or 0) + 2]
        best = self.detector.best_step()
        if best is not None:
            onsets.append(best + 1)  # a divergence rolls back to before the lowest loss
        if self.pending is not None:
            onsets.append(self.pending.onset)
        if self.agreed is not None:
            onsets.append(self.agreed.onset)
        keep = newest_safe(complete_iterations(self.save_path), min(onsets))
        return keep is not None and path.name == iteration_dir_name(keep)

    def refuses_save(self, step: int) -> str | None:
        """Why the weights of ``step`` must not be saved (CheckpointManager agrees on it over the ranks).

        Once an anomaly is seen, the live weights are after its onset: saved, they would become the latest
        checkpoint, which a resume after a stop or a crash would continue from."""
        anomaly = self.agreed or self.pending
        if anomaly is not None:
            return f"recovery saw {anomaly.reason}; the weights of step {step} may hold the damage"
        if self.gave_up:
            return f"recovery gave up at step {step}; the weights may hold the damage"
        return None

    # -- the lowered learning rate after a rollback ---------------------------------------------------

    @contextlib.contextmanager
    def scaled_lr(self, state: Any, optimizer: Any, scheduler: Any) -> Iterator[None]:
        factor = float(self.section.lr_scale)
        if factor == 1.0 or state.global_step + 1 > self.lr_scaled_until:
            yield
            return
        groups = optimizer.param_groups
        before = [float(g["lr"]) for g in groups]
        _set_lrs(groups, [lr * factor for lr in before])
        scheduled = getattr(scheduler, "last_epoch", None)
        try:
            yield
        finally:
            # A step that updated moved the scheduler, which set the next lr itself; a skipped one did
            # not, and its group lrs are still the lowered ones.
            if scheduler is None or getattr(scheduler, "last_epoch", None) == scheduled:
                _set_lrs(groups, before)

    # -- the rollback ---------------------------------------------------------------------------------

    def roll_back(self, trainer: Any) -> dict[str, Any] | None:
        """Restore every rank from the newest safe checkpoint; None (and the trainer stopping) when it cannot.

        The checkpoints written after the onset are moved aside (quarantine.py), and the restored state —
        this rollback counted, the data position past the skipped batches — is saved again as the restored
        step's checkpoint before training goes on: a restart from here continues the recovered run.
        """
        anomaly, self.agreed, self.pending = self.agreed, None, None
        assert anomaly is not None
        state = trainer.state
        detected = int(state.global_step)
        t0 = time.perf_counter()
        manager = trainer._checkpoint_manager
        manager.wait()  # an asynchronous save in flight is finished (and may be the one restored or moved)
        if self.rollbacks >= int(self.section.max_rollbacks):
            return self._give_up(
                trainer, anomaly, f"recovery.max_rollbacks ({self.section.max_rollbacks}) is reached"
            )
        disk = _agreed_step(newest_safe(complete_iterations(self.save_path), anomaly.onset), trainer.ctx)
        snapshot = self._agreed_snapshot(anomaly.onset, trainer)
        to_step = snapshot.step if snapshot is not None and (disk is None or snapshot.step >= disk) else disk
        if to_step is None:
            return self._give_up(
                trainer,
                anomaly,
                f"no checkpoint (or in-memory snapshot) of step <= {anomaly.onset - 2} exists in {self.save_path}",
            )
        skip = self.section.data == "skip"
        loader = trainer.dataloader
        detected_position = loader.state_dict() if skip and hasattr(loader, "state_dict") else None
        detected_consumed, tokens_before = int(state.consumed_samples), int(state.tokens_seen)
        use = snapshot if snapshot is not None and snapshot.step == to_step else None
        source = self._restore(trainer, use, to_step)
        restored_consumed = int(state.consumed_samples)
        if skip:
            state.consumed_samples = detected_consumed
        if detected_position is not None and hasattr(loader, "load_state_dict"):
            loader.load_state_dict(detected_position)
        elif not hasattr(loader, "load_state_dict"):  # a loader without a position to restore: a new one
            trainer.dataloader = trainer.dataloader_factory(int(state.consumed_samples))
        trainer.resumption.after_restore()
        self.rollbacks += 1
        self.detector.forget_after(to_step)
        self.lr_scaled_until = to_step + int(self.section.lr_scale_steps)
        self._remember(state)
        restore_s = time.perf_counter() - t0
        samples = (
            [restored_consumed, detected_consumed - 1] if detected_consumed > restored_consumed else None
        )
        event: dict[str, Any] = {
            "event": "rollback",
            "step": detected,
            "to_step": to_step,
            "reason": anomaly.reason,
            "skipped_samples": samples if skip else None,
            "replayed_samples": None if skip else samples,
            "onset": anomaly.onset,
            "data": self.section.data,
            "rollback": self.rollbacks,
            "max_rollbacks": int(self.section.max_rollbacks),
            "lost_tokens": tokens_before - int(state.tokens_seen),
            "restore_s": round(restore_s, 4),
            "source": "memory" if use is not None else "disk",
            "lr_scale": float(self.section.lr_scale),
            "lr_scaled_until": self.lr_scaled_until,
        }
        moved = self._quarantine(manager, anomaly, detected, self.rollbacks, trainer.ctx, event)
        event["damaged_dir"] = str(moved) if moved is not None else None
        t1 = time.perf_counter()
        manager.save(trainer.checkpointable(), to_step)
        manager.wait()  # published before training goes on (an asynchronous save too)
        event["save_s"] = round(time.perf_counter() - t1, 4)
        self.events.append(event)
        logger.warning(
            "recovery: %s. Rolled back every rank from step %d to the %s of step %d (%s, rollback %d of %d); %s "
            "samples %s.",
            anomaly.reason,
            detected,
            "in-memory snapshot" if use is not None else "checkpoint",
            to_step,
            source,
            self.rollbacks,
            self.section.max_rollbacks,
            "skipping" if skip else "replaying",
            f"{samples[0]}..{samples[1]}" if samples else "(none)",
        )
        trainer.callbacks.call("on_rollback", trainer.config, state, rollback=event, **trainer._hook_kwargs())
        return event

    def _restore(self, trainer: Any, snapshot: Snapshot | None, to_step: int) -> str:
        """Every rank restores the state of ``to_step``: from its own snapshot (the disk is not read) or the
        checkpoint, through the resume code path. Returns where from, for the log."""
        if snapshot is not None:
            snapshot.restore(
                trainer.model, trainer.optimizer, trainer.scheduler, trainer.dataloader, trainer.state
            )
            source = "each rank's own copy, the disk not read"
        else:
            header = resolve_checkpoint(self.save_path / iteration_dir_name(to_step))
            load_checkpoint(
                header, trainer.checkpointable(), no_load_optim=False, hf_loader=trainer.hf_loader
            )
            source = str(header.path)
        if self.snapshots is not None:
            self.snapshots.forget_after(to_step)  # the newer ones are of the steps undone
        return source

    def _agreed_snapshot(self, onset: int, trainer: Any) -> Snapshot | None:
        """The newest safe in-memory snapshot, when every rank holds one of the same step that still fits."""
        if self.snapshots is None:
            return None
        snapshot = self.snapshots.newest_safe(onset)
        if snapshot is not None and not snapshot.fits(trainer.model, trainer.optimizer):
            logger.warning(
                "recovery: the in-memory snapshot of step %d no longer fits the model; not used.",
                snapshot.step,
            )
            snapshot = None
        step = -1 if snapshot is None else snapshot.step
        low, high = step, step
        if trainer.ctx.distributed:
            values = torch.tensor([-step, step], dtype=torch.int64, device=trainer.ctx.device)
            dist.all_reduce(values, op=dist.ReduceOp.MAX)
            low, high = -int(values[0].item()), int(values[1].item())
        return snapshot if low == high and low >= 0 else None

    def _quarantine(
        self, manager: Any, anomaly: Anomaly, detected: int, number: int, ctx: Any, record: dict[str, Any]
    ) -> Path | None:
        """Rank 0 moves the checkpoints after the onset aside; every rank forgets them for rotation."""
        moved = None
        if ctx.rank == 0:
            moved = quarantine(self.save_path, anomaly.onset, detected, number, record)
        low = anomaly.onset - 2
        manager.saved_this_run = [
            p for p in manager.saved_this_run if not low < _iteration_step(p, default=low) <= detected
        ]
        return moved

    def _give_up(self, trainer: Any, anomaly: Anomaly, why: str) -> None:
        self.gave_up = True
        detected = int(trainer.state.global_step)
        record = {
            "event": "stop",
            "step": detected,
            "reason": anomaly.reason,
            "onset": anomaly.onset,
            "why": why,
        }
        moved = self._quarantine(
            trainer._checkpoint_manager, anomaly, detected, self.rollbacks + 1, trainer.ctx, record
        )
        safe = newest_safe(complete_iterations(self.save_path), anomaly.onset)
        where = (
            f"the newest checkpoint from before it is {self.save_path / iteration_dir_name(safe)} (the latest one "
            "now: the run saves none of the weights after the anomaly): resume from it"
            if safe is not None
            else "no checkpoint from before it exists: save earlier (checkpoint.save_interleaved_steps) and start again"
        )
        aside = f"; the checkpoints that may hold the damage are in {moved}" if moved is not None else ""
        marker = self._mark_given_up(trainer, anomaly, why, safe, moved)
        trainer.stop_agreement.stop_now(
            f"diverged: {anomaly.reason}; {why}, after {self.rollbacks} rollback(s). Training stops; {where}, with "
            "a lower lr_scheduler.learning_rate, recovery.lr_scale < 1 or recovery.data: skip (a resume keeps "
            "the count of rollbacks used: raise recovery.max_rollbacks to allow more), or check the data "
            f"around that step{aside}. {marker} records this give-up: a run that saves into "
            f"{self.save_path} (a torchrun restart too) is refused until you delete it."
        )
        logger.error("%s", trainer.stop_agreement.reason[len("diverged: ") :])
        return None

    def _mark_given_up(
        self, trainer: Any, anomaly: Anomaly, why: str, safe: int | None, moved: Path | None
    ) -> Path:
        """Rank 0 writes the give-up marker (give_up.py), so that a restarted job does not try again."""
        record = {
            "step": int(trainer.state.global_step),
            "onset": anomaly.onset,
            "anomaly": anomaly.reason,
            "reason": why,
            "rollbacks": self.rollbacks,
            "max_rollbacks": int(self.section.max_rollbacks),
            "safe_checkpoint": str(self.save_path / iteration_dir_name(safe)) if safe is not None else None,
            "damaged_dir": str(moved) if moved is not None else None,
        }
        if trainer.ctx.rank == 0:
            return write_give_up_marker(self.save_path, record)
        return marker_path(self.save_path)


def _set_lrs(groups: list[dict[str, Any]], lrs: list[float]) -> None:
    for group, lr in zip(groups, lrs, strict=True):
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def _iteration_step(path: Path, default: int) -> int:
    name = Path(path).name
    return int(name[len("iteration_") :]) if name.startswith("iteration_") else default


def _agreed_step(step: int | None, ctx: Any) -> int | None:
    """The oldest of the ranks' choices (each rank lists the checkpoint directory it can see)."""
    if not ctx.distributed:
        return step
    value = torch.tensor([-1 if step is None else step], dtype=torch.int64, device=ctx.device)
    none = torch.tensor([1 if step is None else 0], dtype=torch.int64, device=ctx.device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    dist.all_reduce(none, op=dist.ReduceOp.MAX)
    return None if int(none.item()) else int(value.item())


def build_recovery(config: TrainConfig, manager: Any, callbacks: Any) -> Recovery | None:
    """The ``recovery:`` section at work in a trainer, or None when it is off (``callbacks``: the trainer's
    handler, which takes the in-memory snapshots when ``recovery.snapshot_interval`` asks for them)."""
    section = config.recovery
    if not section.enable:
        return None
    from lmforge.train.recovery.checks import check_recovery

    check_recovery(config)  # (preflight refused it already for a run built from a YAML)
    recovery = Recovery(section, config.checkpoint.save_path)
    if manager is not None:
        manager.protect = recovery.protects
        manager.refuse = recovery.refuses_save
    if int(section.snapshot_interval) > 0:
        recovery.snapshots = Snapshots(int(section.snapshot_interval), recovery)
        callbacks.add(recovery.snapshots)
    return recovery
