"""``recovery.snapshot_interval``: each rank keeps a CPU copy of its own state every N steps, so a rollback
need not read the disk (Megatron's and torchft's in-memory checkpoints are the model).

What is copied is what a checkpoint restores, each rank only its own part, by identity of the live
objects (no names, no resharding: a snapshot is restored into the process that took it): the local shard
of every parameter and buffer, the optimizer's per-parameter state and its groups' settings, the
scheduler's state, the trainer counters, the RNG states and the data loader's position. Restoring copies
the tensors back in place, so nothing a parallel wrapper or the optimizer holds a reference to changes.

The two newest snapshots are kept: the newest one is always after the last update whose loss was seen
(``safe_checkpoint.py``), so a spike's rollback uses the one before it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lmforge.train.callbacks import TrainerCallback
from lmforge.train.rng import capture_rng_state, restore_rng_state

KEPT = 2


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _copy_out(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _local(value).detach().to("cpu", copy=True)
    return copy.deepcopy(value)


def _model_tensors(model: nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]


@dataclass
class Snapshot:
    step: int
    model: list[torch.Tensor]  # CPU copies, in the order of _model_tensors(model)
    optimizer_state: dict[int, dict[str, Any]]  # by the parameter's position in the optimizer's groups
    optimizer_groups: list[dict[str, Any]]  # every group's settings but its params
    scheduler: Any
    trainer: dict[str, Any]
    rng: dict[str, Any]
    data: Any  # the loader's state_dict, None when it has none

    @classmethod
    def take(
        cls, step: int, model: nn.Module, optimizer: Any, scheduler: Any, loader: Any, state: Any
    ) -> Snapshot:
        params = _optimizer_params(optimizer)
        return cls(
            step=step,
            model=[_copy_out(t) for t in _model_tensors(model)],
            optimizer_state={
                i: {k: _copy_out(v) for k, v in optimizer.state[p].items()}
                for i, p in enumerate(params)
                if p in optimizer.state
            },
            optimizer_groups=[
                {k: _copy_out(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups
            ],
            scheduler=copy.deepcopy(scheduler.state_dict()) if scheduler is not None else None,
            trainer=copy.deepcopy(state.to_dict()),
            rng=capture_rng_state(),
            data=copy.deepcopy(loader.state_dict()) if hasattr(loader, "state_dict") else None,
        )

    def fits(self, model: nn.Module, optimizer: Any) -> bool:
        """Whether the live objects still have the structure this snapshot was taken from."""
        live = _model_tensors(model)
        if len(live) != len(self.model) or any(
            _local(t).shape != s.shape for t, s in zip(live, self.model, strict=True)
        ):
            return False
        params = _optimizer_params(optimizer)
        held = {i for i, p in enumerate(params) if p in optimizer.state}
        if held != set(self.optimizer_state) or len(optimizer.param_groups) != len(self.optimizer_groups):
            return False
        return all(set(optimizer.state[params[i]]) == set(v) for i, v in self.optimizer_state.items())

    def restore(self, model: nn.Module, optimizer: Any, scheduler: Any, loader: Any, state: Any) -> None:
        with torch.no_grad():
            for live, saved in zip(_model_tensors(model), self.model, strict=True):
                _local(live).copy_(saved)
            params = _optimizer_params(optimizer)
            for i, saved_state in self.optimizer_state.items():
                live_state = optimizer.state[params[i]]
                for k, v in saved_state.items():
                    if isinstance(v, torch.Tensor) and isinstance(live_state[k], torch.Tensor):
                        _local(live_state[k]).copy_(v)
                    else:
                        live_state[k] = copy.deepcopy(v)
            for group, saved_group in zip(optimizer.param_groups, self.optimizer_groups, strict=True):
                for k, v in saved_group.items():
                    if isinstance(v, torch.Tensor) and isinstance(group.get(k), torch.Tensor):
                        _local(group[k]).copy_(v)
                    else:
                        group[k] = copy.deepcopy(v)
        if scheduler is not None and self.scheduler is not None:
            scheduler.load_state_dict(copy.deepcopy(self.scheduler))
        state.load_dict(copy.deepcopy(self.trainer))
        restore_rng_state(self.rng)
        if self.data is not None and hasattr(loader, "load_state_dict"):
            loader.load_state_dict(copy.deepcopy(self.data))


def _optimizer_params(optimizer: Any) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


class Snapshots(TrainerCallback):
    """Takes a snapshot every ``interval`` steps on every rank (none while an anomaly is pending here: the
    ranks agree on the one to use at the rollback)."""

    order = 75  # after the step's own callbacks that change weights (faults in tests), before checkpointing

    def __init__(self, interval: int, recovery: Any) -> None:
        self.interval = int(interval)
        self.recovery = recovery
        self.kept: list[Snapshot] = []

    def on_step_end(self, args: Any, state: Any, **kwargs: Any) -> None:
        step = int(state.global_step)
        if step % self.interval or self.recovery.pending is not None or self.recovery.agreed is not None:
            return
        trainer = kwargs["trainer"]
        snap = Snapshot.take(
            step, trainer.model, trainer.optimizer, trainer.scheduler, trainer.dataloader, state
        )
        self.kept = [s for s in self.kept if s.step < step][-(KEPT - 1) :] + [snap]

    def newest_safe(self, onset: int) -> Snapshot | None:
        safe = [s for s in self.kept if s.step <= onset - 2]
        return safe[-1] if safe else None

    def forget_after(self, step: int) -> None:
        self.kept = [s for s in self.kept if s.step <= step]
