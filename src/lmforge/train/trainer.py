"""The training loop: batches in, steps, callbacks out. Everything beside the step is a callback."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lmforge.config import CheckpointConfig, TrainConfig
from lmforge.errors import ConfigError
from lmforge.parallel.plan import BatchSchedule
from lmforge.train.callbacks import (
    CallbackHandler,
    CheckpointCallback,
    LoggingCallback,
    MetricsCallback,
    PlotCallback,
    TrainerCallback,
    build_callback,
)
from lmforge.train.callbacks.logging import format_summary
from lmforge.train.checkpoint import Checkpointable, CheckpointManager, recover_save_path
from lmforge.train.loss_scale import LossScaler
from lmforge.train.parallel_seam import ParallelContext
from lmforge.train.perf import MfuMeter, device_memory_gib
from lmforge.train.resumption import Resumption
from lmforge.train.run_outcome import StepTally, no_update_failure
from lmforge.train.state import TrainState
from lmforge.train.step import SkipPolicy, StepResult, TrainingStopped, TrainStep
from lmforge.train.stop_agreement import StopAgreement
from lmforge.utils.atomic import check_output_dir, write_text_atomic
from lmforge.utils.logging import get_logger, setup_logging

logger = get_logger("lmforge.train")

DataloaderFactory = Callable[[int], Any]  # consumed_samples -> iterable of micro-batches


class Trainer:
    """Runs ``training.steps`` optimizer steps of a built model/optimizer/scheduler/data pipeline.

    ``dataloader_factory(consumed_samples)`` returns the micro-batch iterable positioned at that
    sample (it is called after a checkpoint's position is known). Build a Trainer from a YAML with
    :func:`lmforge.train.builder.build_trainer`.

    The trainer keeps the loop and delegates to components it holds: ``resumption`` (which checkpoint,
    the data position, what follows a restore), ``stop_agreement`` (signals, the stop all ranks agree
    on) and ``mfu`` (FLOPs per token and the peak).
    """

    def __init__(
        self,
        config: TrainConfig,
        *,
        model: nn.Module,
        optimizer: Any,
        scheduler: Any,
        dataloader_factory: DataloaderFactory,
        ctx: ParallelContext | None = None,
        output_dir: str | Path | None = None,
        callbacks: list[TrainerCallback] | None = None,
        hf_loader: Callable[[nn.Module, Path], None] | None = None,
        peak_flops: float | None = None,
        files_to_copy: list[str | Path] | None = None,
        log_to_file: bool = True,
        batches: BatchSchedule | None = None,
    ) -> None:
        self.config = config
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.dataloader_factory = dataloader_factory
        self.dataloader: Any = None
        self.ctx = ctx or ParallelContext(device=_model_device(model))
        self.output_dir = Path(output_dir or config.output_dir or "./output")
        self.hf_loader = hf_loader
        self.mfu = MfuMeter(model, self.ctx.device, config.mfu, peak_flops)
        # Regional torch.compile (parallel/compile.py): log how long compiling took, and any recompile.
        self._compile_watch = None
        if config.compile.enable:
            from lmforge.parallel.compile import CompileWatch

            self._compile_watch = CompileWatch()
        self.log_to_file = log_to_file
        self.stop_agreement = StopAgreement()
        self.final_save: tuple[int, float] | None = None  # (step, seconds) of the save after the loop
        self.artifacts: dict[str, str] = {}
        self._setup_run_dir()

        training = config.training
        self.max_norm = float(training.max_norm)
        if batches is None:
            # Without a run plan (a Trainer built by hand): the plan's schedule for this process's dp size.
            batches = BatchSchedule.of(training, self.ctx.dp_size)
            problems = batches.problems()
            if problems:
                raise ConfigError(problems[0])
            for note in batches.warnings():
                logger.warning("%s", note)
        self.batches = batches
        self.state = TrainState(
            max_steps=int(training.steps),
            global_batch_size=self.batches.global_batch_at(0),
            num_accumulation_steps=self.batches.accumulation_steps_at(0),
        )
        self.step_fn = TrainStep(
            model,
            optimizer,
            scheduler,
            max_norm=self.max_norm,
            ctx=self.ctx,
            skip_policy=SkipPolicy.from_monitor(config.monitor),
            loss_scaler=_loss_scaler_for(model),
        )
        self.checkpoint_cfg = config.checkpoint  # the typed CheckpointConfig
        self.callbacks = CallbackHandler()
        self._add_builtin_callbacks(files_to_copy)
        for cb in callbacks or []:
            self.callbacks.add(cb)
        for i, item in enumerate(config.callbacks):
            self.callbacks.add(build_callback(item, i))
        self._run_started = 0.0
        self._run_tokens = 0
        self.run_steps = StepTally()  # this launch's steps: applied, skipped and why (train/run_outcome.py)
        self.resumption = Resumption(self)
        from lmforge.train.recovery import build_recovery

        # None unless recovery.enable
        self._recovery = build_recovery(config, self._checkpoint_manager, self.callbacks)

    # -- construction helpers -----------------------------------------------------------------

    def _warn_inert_checkpoint_fields(self) -> None:
        ck = self.checkpoint_cfg
        if ck.load_balanced:
            logger.warning(
                "checkpoint.load_balanced: true has no effect in lmforge: torch.distributed.checkpoint already "
                "reads on every rank only the shards that rank needs."
            )
        if ck.remove_redundancy:
            logger.warning(
                "checkpoint.remove_redundancy: true has no effect in lmforge: torch.distributed.checkpoint "
                "always writes a replicated tensor once (redundancy is always removed)."
            )

    def _add_builtin_callbacks(self, files_to_copy: list[str | Path] | None) -> None:
        self._warn_inert_checkpoint_fields()
        self.callbacks.add(LoggingCallback())
        self.callbacks.add(MetricsCallback())
        self.callbacks.add(PlotCallback())
        # Memory, TensorBoard, monitors, profiler, evaluation, MaxLogitsMonitor (docs/observability.md).
        from lmforge.train.callbacks.observability import observability_callbacks

        for cb in observability_callbacks(
            self.config, self.output_dir, model=self.model, device=self.ctx.device, rank=self.ctx.rank
        ):
            self.callbacks.add(cb)
        ck = self.checkpoint_cfg
        self._checkpoint_manager: CheckpointManager | None = None
        if ck.enable_save:
            manager = self._checkpoint_manager = CheckpointManager(
                ck.save_path,
                prefix=ck.prefix,
                save_max=ck.save_max,
                no_save_optim=ck.no_save_optim,
                async_save=ck.async_save,
                config_dict=self.config.to_dict(),  # serialised: the checkpoint's config.yaml
                files_to_copy=files_to_copy,
            )
            self.callbacks.add(CheckpointCallback(manager, ck.save_interleaved_steps))

    @property
    def checkpoint_manager(self) -> CheckpointManager | None:
        return self._checkpoint_manager

    def checkpointable(self) -> Checkpointable:
        return Checkpointable(
            self.model, self.optimizer, self.scheduler, self.dataloader, self.state, self.callbacks
        )

    def _hook_kwargs(self) -> dict[str, Any]:
        return {
            "trainer": self,
            "model": self.model,
            "optimizer": self.optimizer,
            "lr_scheduler": self.scheduler,
            "train_dataset": self.dataloader,
        }

    # -- the run ------------------------------------------------------------------------------

    def _setup_run_dir(self) -> None:
        if self.ctx.rank == 0:
            check_output_dir(self.output_dir, "output_dir")
            self.output_dir.mkdir(parents=True, exist_ok=True)
        log_file = str(self.output_dir / "train.log") if (self.log_to_file and self.ctx.rank == 0) else None
        setup_logging(log_file=log_file)
        if log_file:
            self.artifacts["log"] = log_file

    def fit(self) -> dict[str, Any]:
        # Signals are handled from the start to the end of the run (also during the final save), so
        # SIGTERM at any moment ends with a complete checkpoint; the run's directories are locked.
        with self.stop_agreement.signals_handled():
            locks = self._lock_run_dirs()
            try:
                summary = self._fit()
            finally:
                for lock in locks:
                    lock.release()
        reason = self.stop_agreement.reason
        if reason and reason.startswith("diverged"):
            raise TrainingStopped(reason[len("diverged: ") :])
        failure = self.no_update_failure()
        if failure is not None:
            logger.error("%s", failure)
            raise TrainingStopped(failure)
        return summary

    def no_update_failure(self) -> str | None:
        """Why this run failed although it ran to its end: none of its steps applied an update (a stop that
        was asked for is no failure: the run is resumed later). None when it trained."""
        if self.stop_agreement.stopping:
            return None
        manager = self._checkpoint_manager
        saved = [Path(p).name for p in manager.saved_this_run] if manager is not None else []
        return no_update_failure(self.run_steps, self.step_fn.skip_policy, saved=saved)

    def request_stop(self, reason: str) -> None:
        """Ask the run to stop (signal-safe: flags only): all ranks agree on it before the next step,
        save and stop (:class:`~lmforge.train.stop_agreement.StopAgreement`)."""
        self.stop_agreement.request(reason)

    def _lock_run_dirs(self) -> list[Any]:
        from lmforge.utils.run_lock import lock_dirs, run_dirs

        locks = (
            lock_dirs(run_dirs(self.output_dir, _saved_to(self.checkpoint_cfg))) if self.ctx.rank == 0 else []
        )
        if locks and self._checkpoint_manager is not None:  # ours now: fix a crashed save's leftovers
            recover_save_path(self._checkpoint_manager.save_path)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # the other ranks read save_path only once it is consistent
        return locks

    def _fit(self) -> dict[str, Any]:
        self.resumption.resume_or_start()
        if self.ctx.rank == 0 and self.ctx.device.type == "cpu":
            from lmforge.utils import malloc

            logger.info("CPU allocator: %s", malloc.status)  # utils/malloc.py; "not applied" outside the CLI
        kw = self._hook_kwargs
        self.callbacks.call("on_begin", self.config, self.state, **kw())
        self.callbacks.call("on_train_begin", self.config, self.state, **kw())
        self._run_started = time.perf_counter()
        self._loop()
        self.callbacks.call("on_train_end", self.config, self.state, **kw())
        self.callbacks.call("on_end", self.config, self.state, **kw())
        summary = self.summary()
        if self.ctx.rank == 0:
            logger.info(format_summary(summary))
            write_text_atomic(self.output_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
        return summary

    def _restart_data_iteration(self) -> None:
        """After a restore: the data iterator restarts at the loader's (restored) position."""
        self._data_iter: Iterator | None = None
        self._epoch_open = False
        # Micro-batches this rank has consumed (the data position in loader steps).
        self._micro_fetched = self.state.consumed_samples // self.batches.samples_per_micro_step

    def _next_micro_batch(self) -> dict[str, torch.Tensor]:
        """The next micro-batch; epoch hooks fire at the loader's epoch boundaries.

        A loader with ``len()`` (micro-batches per epoch per rank; lmforge's training loader wraps
        around forever) marks an epoch every ``len()`` micro-batches; a finite loader without it
        ends an epoch when it is exhausted.
        """
        kw = self._hook_kwargs
        per_epoch = self._micro_batches_per_epoch()
        if self._data_iter is None or (
            per_epoch and self._micro_fetched % per_epoch == 0 and self._epoch_open is False
        ):
            self.callbacks.call("on_epoch_begin", self.config, self.state, **kw())
            self._epoch_open = True
        for _attempt in range(2):
            if self._data_iter is None:
                self._data_iter = iter(self.dataloader)
            try:
                batch = next(self._data_iter)
                break
            except StopIteration:
                self._data_iter = None
                if not per_epoch:
                    self.callbacks.call("on_epoch_end", self.config, self.state, **kw())
                    self.state.epoch += 1
                    self.callbacks.call("on_epoch_begin", self.config, self.state, **kw())
        else:
            raise RuntimeError("the training data loader yields no batches")
        self._micro_fetched += 1
        if per_epoch and self._micro_fetched % per_epoch == 0:
            self.callbacks.call("on_epoch_end", self.config, self.state, **kw())
            self.state.epoch += 1
            self._epoch_open = False
        return batch

    def _micro_batches_per_epoch(self) -> int | None:
        try:
            n = len(self.dataloader)
        except TypeError:
            return None
        return n if n > 0 else None

    def _loop(self) -> None:
        state, kw = self.state, self._hook_kwargs
        recovery = self._recovery
        while state.global_step < state.max_steps or (
            recovery is not None and recovery.vote_at_end(self.ctx)
        ):
            if self.stop_agreement.agreed(self.ctx, recovery, state.global_step):
                if recovery is not None and recovery.agreed is not None:
                    # A stop agreed together with a rollback: roll back first, so the stop keeps good weights.
                    recovery.roll_back(self)
                break
            if recovery is not None and recovery.agreed is not None:
                recovery.roll_back(self)  # (or, when it cannot, the trainer stops at the next agreement)
                continue
            self.callbacks.call("on_step_begin", self.config, state, **kw())
            t0 = time.perf_counter()
            state.global_batch_size = self.batches.global_batch_at(state.consumed_samples)
            state.num_accumulation_steps = self.batches.accumulation_steps_at(state.consumed_samples)
            micro = [self._next_micro_batch() for _ in range(state.num_accumulation_steps)]
            if recovery is None:
                result = self.step_fn(micro)
            else:
                with recovery.scaled_lr(state, self.optimizer, self.scheduler):
                    result = self.step_fn(micro)
            if self.step_fn.loss_scaler is not None:
                state.loss_scaler = self.step_fn.loss_scaler.state_dict()
            if self.ctx.device.type == "cuda":
                torch.cuda.synchronize(self.ctx.device)
            step_time = time.perf_counter() - t0
            state.consumed_samples += result.samples
            state.global_step += 1
            self._account(result)
            metrics = self._metrics(result, step_time, micro[0])
            policy = self.step_fn.skip_policy
            anomaly = (
                recovery.observe(state, result, policy.max_consecutive) if recovery is not None else None
            )
            if anomaly is not None:
                metrics["anomaly"] = anomaly.reason
            if self._compile_watch is not None:
                metrics["compile_s"] = self._compile_watch.after_step(state.global_step)
            self.callbacks.call(
                "on_step_end",
                self.config,
                state,
                loss=result.loss,
                grad_norm=result.grad_norm,
                result=result,
                metrics=metrics,
                **kw(),
            )
            limit = policy.max_consecutive
            if recovery is None and limit > 0 and state.consecutive_skips >= limit:
                why = (
                    f"monitor.health_checkpoint.global_norm_skip_time = {limit}"
                    if policy.spike_skipping
                    else f"{limit} consecutive non-finite steps; monitor.health_checkpoint.global_norm_skip_time sets it"
                )
                self.stop_agreement.reason = (
                    f"diverged: {state.consecutive_skips} consecutive steps were skipped (last: {result.skip_reason}) "
                    f"at step {state.global_step}. Training stops ({why}). Lower lr_scheduler.learning_rate, check "
                    f"the data, or resume from the last checkpoint with different settings."
                )
                logger.error(self.stop_agreement.reason[len("diverged: ") :])
                break

    def _account(self, r: StepResult) -> None:
        s = self.state
        s.tokens_seen += r.num_tokens
        self._run_tokens += r.input_tokens
        self.run_steps.record(s.global_step, r)
        if r.skipped:
            s.skipped_steps += 1
            # An fp16 overflow lowers the loss scale and is expected now and then; it counts towards
            # divergence only once the scale is below 1 (the gradients overflow unscaled).
            if not r.overflow or (r.loss_scale or 0.0) <= 1.0:
                s.consecutive_skips += 1
            return
        s.consecutive_skips = 0
        s.last_loss = r.loss
        if math.isfinite(r.loss) and r.loss < s.best_loss:
            s.best_loss = r.loss

    def _metrics(
        self, r: StepResult, step_time: float, first_batch: dict[str, torch.Tensor]
    ) -> dict[str, Any]:
        tokens_per_s = r.input_tokens / step_time if step_time > 0 else 0.0
        flops_per_token = self.mfu.flops_per_token(int(first_batch["input_ids"].shape[-1]))
        achieved = flops_per_token * tokens_per_s / self.ctx.world_size  # per device
        peak = self.mfu.peak()
        m: dict[str, Any] = {
            "step": self.state.global_step,
            "consumed_samples": self.state.consumed_samples,
            "global_batch_size": r.samples,
            "loss": r.loss,
            "lr": r.lr,
            "grad_norm": r.grad_norm,
            "step_time": step_time,
            "tokens_per_s": tokens_per_s,
            "tflops_per_device": achieved / 1e12,
            "mfu": achieved / peak if peak else None,
            "memory_gib": device_memory_gib(self.ctx.device),
            "num_tokens": r.num_tokens,
        }
        if r.aux_losses:
            m["aux_losses"] = dict(r.aux_losses)
            m.update(r.aux_losses)
        if r.loss_scale is not None:
            m["loss_scale"] = r.loss_scale
        if r.skipped:
            m["skipped"] = True
            m["skip_reason"] = r.skip_reason
        return m

    # -- the end ------------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        from lmforge.train.summary import run_summary

        return run_summary(self)


def _loss_scaler_for(model: nn.Module) -> LossScaler | None:
    """fp16 compute needs dynamic loss scaling; bf16 and fp32 do not (fp32's exponent range)."""
    return LossScaler() if getattr(model, "compute_dtype", None) == torch.float16 else None


def _saved_to(checkpoint: CheckpointConfig) -> str | None:
    """``checkpoint.save_path`` when the run saves checkpoints, else None."""
    return checkpoint.save_path if checkpoint.enable_save else None


def _model_device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")
