"""``profiler``: torch.profiler over the training steps ``[start_step, end_step]`` (1-based, inclusive).

Recording starts right before step ``start_step`` begins and stops right after step ``end_step``
ends, so the trace holds exactly those steps; each is marked by a ``ProfilerStep#k`` range (k = the
training step). Traces go to ``output_path/rank_N`` (default ``<output_dir>/profile/rank_N``) as
Chrome-trace JSON (``*.pt.trace.json``): open them in TensorBoard's profiler plugin or in Perfetto.

``profiler_level`` (0/1/2 on the original's Ascend profiler) maps to how much torch records:

* 0 — op and kernel timeline only;
* 1 — plus input shapes (``record_shapes``);
* 2 — plus FLOP estimates and the owning ``nn.Module`` of each op (``with_flops``, ``with_modules``).

``profile_memory``, ``with_stack`` and ``profile_cpu`` (CPU activity) pass through; CUDA activity is
recorded whenever a GPU is in use. ``mstx`` (Ascend's lightweight markers) has no torch counterpart
here; loading the config warns when it is set.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function, tensorboard_trace_handler

from lmforge.config.sections_run import ProfilerConfig
from lmforge.utils.logging import get_logger

log = get_logger(__name__)


def _rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


def profiler_options(level: int) -> dict[str, bool]:
    """torch.profiler options of ``profiler.profiler_level`` (0, 1 or 2: checked by the typed section)."""
    return {"record_shapes": level >= 1, "with_flops": level >= 2, "with_modules": level >= 2}


class StepProfiler:
    """Profiles the configured window of training steps on the configured ranks."""

    def __init__(
        self, section: ProfilerConfig, output_dir: str | os.PathLike = ".", rank: int | None = None
    ) -> None:
        cfg = section  # typed: its start/end/level checks are the section's, at load
        self.enabled = cfg.enable_profiling
        self.start_step = cfg.start_step
        self.end_step = cfg.end_step
        self.rank = _rank() if rank is None else rank
        ranks = cfg.profiler_rank
        self.active_on_rank = self.enabled and (ranks is None or self.rank in list(ranks))
        self.options = profiler_options(cfg.profiler_level)
        self.profile_memory = cfg.profile_memory
        self.with_stack = cfg.with_stack
        self.profile_cpu = cfg.profile_cpu
        base = cfg.output_path or str(Path(output_dir) / "profile")
        self.trace_dir = Path(base) / f"rank_{self.rank}"
        # profiler.mstx (Ascend markers) has no torch counterpart: config loading warns about it.
        self._prof: profile | None = None
        self._step_range: record_function | None = None
        self.finished = False

    def _activities(self) -> list[ProfilerActivity]:
        activities = [ProfilerActivity.CPU] if self.profile_cpu else []
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        if not activities:
            warnings.warn(
                "profiler.profile_cpu is false and there is no GPU: recording CPU activity anyway",
                UserWarning,
                stacklevel=3,
            )
            activities = [ProfilerActivity.CPU]
        return activities

    def step_begin(self, step: int) -> None:
        """Called before training step ``step`` (1-based) runs."""
        if not self.active_on_rank or self.finished or not self.start_step <= step <= self.end_step:
            return
        if self._prof is None:
            self.trace_dir.mkdir(parents=True, exist_ok=True)
            self._prof = profile(
                activities=self._activities(),
                on_trace_ready=tensorboard_trace_handler(
                    str(self.trace_dir), worker_name=f"rank_{self.rank}"
                ),
                profile_memory=self.profile_memory,
                with_stack=self.with_stack,
                **self.options,
            )
            self._prof.start()
            log.info("profiler: recording steps %d-%d to %s", self.start_step, self.end_step, self.trace_dir)
        self._step_range = record_function(f"ProfilerStep#{step}")
        self._step_range.__enter__()

    def step_end(self, step: int) -> None:
        """Called after training step ``step`` finished."""
        if self._prof is None:
            return
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None
        if step >= self.end_step:
            self.stop()

    def stop(self) -> None:
        if self._prof is None:
            return
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None
        prof, self._prof = self._prof, None
        prof.stop()  # writes the trace through on_trace_ready
        self.finished = True
        log.info("profiler: trace written to %s", self.trace_dir)

    def trace_files(self) -> list[Path]:
        return sorted(self.trace_dir.glob("*.pt.trace.json*"))
