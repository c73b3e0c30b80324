"""The training loop: batches in, steps, callbacks out. Everything beside the step is a callback."""

from __future__ import annotations

import json
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

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
from lmforge.train.checkpoint import (
    Checkpointable,
    CheckpointManager,
    load_checkpoint,
    recover_save_path,
)
from lmforge.train.checkpoint.resume import checkpoint_to_load
from lmforge.train.loss_scale import LossScaler
from lmforge.train.parallel_seam import ParallelContext
from lmforge.train.perf import device_memory_gib, mfu_peak
from lmforge.train.state import TrainState
from lmforge.train.step import SkipPolicy, StepResult, TrainingStopped, TrainStep
from lmforge.utils.atomic import check_output_dir, write_text_atomic
from lmforge.utils.logging import get_logger, setup_logging

logger = get_logger("lmforge.train")

DataloaderFactory = Callable[[int], Any]  # consumed_samples -> iterable of micro-batches


class Trainer:
    """Runs ``training.steps`` optimizer steps of a built model/optimizer/scheduler/data pipeline.

    ``dataloader_factory(consumed_samples)`` returns the micro-batch iterable positioned at that
    sample (it is called after a checkpoint's position is known). Build a Trainer from a YAML with
    :func:`lmforge.train.builder.build_trainer`.
    """

    def __init__(
        self,
        config: Any,
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
        self.output_dir = Path(output_dir or getattr(config, "output_dir", None) or "./output")
        self.hf_loader = hf_loader
        self.peak_flops = peak_flops
        # Regional torch.compile (parallel/compile.py): log how long compiling took, and any recompile.
        self._compile_watch = None
        if getattr(getattr(config, "compile", None), "enable", False):
            from lmforge.parallel.compile import CompileWatch

            self._compile_watch = CompileWatch()
        self.log_to_file = log_to_file
        # stop_requested is this rank's wish (a signal, request_stop); stopping is what all ranks
        # agreed at the last stop agreement. Only stopping may change what a rank does next.
        self.stop_requested = False
        self.stopping = False
        self.stop_reason: str | None = None
        self._stop_signal = 0  # the number of the last stop signal this rank received (0: none)
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
            skip_policy=SkipPolicy.from_monitor(getattr(config, "monitor", None)),
            loss_scaler=_loss_scaler_for(model),
        )
        self.checkpoint_cfg = config.checkpoint  # typed; .get(key, default) reads it like a mapping
        self.callbacks = CallbackHandler()
        self._add_builtin_callbacks(files_to_copy)
        for cb in callbacks or []:
            self.callbacks.add(cb)
        for i, item in enumerate(getattr(config, "callbacks", None) or []):
            self.callbacks.add(build_callback(item, i))
        self._flops_per_token: float | None = None
        self._run_started = 0.0
        self._run_tokens = 0
        self._resumed_from: str | None = None
        from lmforge.train.recovery import build_recovery

        # None unless recovery.enable
        self._recovery = build_recovery(config, self._checkpoint_manager, self.callbacks)

    # -- construction helpers -----------------------------------------------------------------

    def _warn_inert_checkpoint_fields(self) -> None:
        ck = self.checkpoint_cfg
        if ck.get("load_balanced"):
            logger.warning(
                "checkpoint.load_balanced: true has no effect in lmforge: torch.distributed.checkpoint already "
                "reads on every rank only the shards that rank needs."
            )
        if ck.get("remove_redundancy"):
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
        if ck.get("enable_save", True):
            manager = self._checkpoint_manager = CheckpointManager(
                ck.get("save_path", ""),
                prefix=ck.get("prefix", "checkpoint"),
                save_max=int(ck.get("save_max", 5)),
                no_save_optim=bool(ck.get("no_save_optim", False)),
                async_save=bool(ck.get("async_save", False)),
                config_dict=_config_dict(self.config),
                files_to_copy=files_to_copy,
            )
            self.callbacks.add(CheckpointCallback(manager, int(ck.get("save_interleaved_steps", 1000))))

    @property
    def checkpoint_manager(self) -> CheckpointManager | None:
        return self._checkpoint_manager

    def checkpointable(self) -> Checkpointable:
        return Checkpointable(self.model, self.optimizer, self.scheduler, self.dataloader, self.state)

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
        previous_handlers = self._install_signal_handlers()
        locks = self._lock_run_dirs()
        try:
            summary = self._fit()
        finally:
            for lock in locks:
                lock.release()
            self._restore_signal_handlers(previous_handlers)
        if self.stop_reason and self.stop_reason.startswith("diverged"):
            raise TrainingStopped(self.stop_reason[len("diverged: ") :])
        return summary

    def _lock_run_dirs(self) -> list[Any]:
        from lmforge.utils.run_lock import lock_dirs, run_dirs

        locks = lock_dirs(run_dirs(self.output_dir, self.checkpoint_cfg)) if self.ctx.rank == 0 else []
        if locks and self._checkpoint_manager is not None:  # ours now: fix a crashed save's leftovers
            recover_save_path(self._checkpoint_manager.save_path)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # the other ranks read save_path only once it is consistent
        return locks

    def _fit(self) -> dict[str, Any]:
        self._resume_or_start()
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

    def _resume_or_start(self) -> None:
        header, own = checkpoint_to_load(self.checkpoint_cfg)
        # This job's own checkpoint (auto-resume) continues completely, optimizer included.
        no_load_optim = False if own else bool(self.checkpoint_cfg.get("no_load_optim", False))
        consumed = 0
        if header is not None and header.kind == "dcp" and not no_load_optim:
            consumed = int(header.common.get("consumed_samples", 0))
        self.dataloader = self.dataloader_factory(consumed)
        if header is not None:
            load_checkpoint(
                header,
                self.checkpointable(),
                no_load_optim=no_load_optim,
                hf_loader=self.hf_loader,
                partial_load=bool(self.checkpoint_cfg.get("partial_load", False)),
                reset_optimizer=bool(self.checkpoint_cfg.get("reset_optimizer", False)),
            )
            self._resumed_from = str(header.path)
            if header.kind == "dcp" and not no_load_optim:
                saved_gbs = int(header.common.get("global_batch_size") or 0)
                current = self.batches.global_batch_at(self.state.consumed_samples)
                if self.batches.rampup is None and saved_gbs and saved_gbs != current:
                    # As the original: keep the sample position, re-express it in steps of the new batch.
                    self.state.global_step = int(self.state.global_step * saved_gbs / current)
                    logger.warning(
                        "The checkpoint was trained with global_batch_size %d, this run uses %d: resuming at step %d.",
                        saved_gbs,
                        current,
                        self.state.global_step,
                    )
        self._record_lora_base(header)
        self.after_restore()
        if self._recovery is not None:
            self._recovery.start(self.state)
        scaler = self.step_fn.loss_scaler
        if scaler is not None:
            logger.info(
                "model.compute_dtype float16: dynamic loss scaling from %g (x%g after %d clean updates, x%g "
                "on overflow)",
                scaler.scale,
                scaler.growth_factor,
                scaler.growth_interval,
                scaler.backoff_factor,
            )

    def after_restore(self) -> None:
        """After a checkpoint was loaded into the live objects (resume, or recovery's rollback)."""
        self.state.max_steps = int(self.config.training.steps)
        scaler = self.step_fn.loss_scaler
        if scaler is not None:
            if self.state.loss_scaler:
                scaler.load_state_dict(self.state.loss_scaler)  # the scale of the checkpoint
            self.state.loss_scaler = scaler.state_dict()
        self._data_iter: Iterator | None = None
        self._epoch_open = False
        # Micro-batches this rank has consumed (the data position in loader steps).
        self._micro_fetched = self.state.consumed_samples // self.batches.samples_per_micro_step

    def _record_lora_base(self, header: Any) -> None:
        """A LoRA run saves small checkpoints: the adapters plus where the frozen base came from."""
        from lmforge.train.checkpoint.lora import base_record, has_adapters

        manager = getattr(self, "_checkpoint_manager", None)
        if manager is None or not has_adapters(self.model):
            return
        seed = int(self.config.training.seed)
        if self.ctx.rank == 0:  # only rank 0 writes common.json
            manager.lora_base = base_record(header, seed)
        else:
            manager.lora_base = {}  # every rank must leave the frozen base out of the state dict

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
            if self._stop_agreed():
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
                self.stop_reason = (
                    f"diverged: {state.consecutive_skips} consecutive steps were skipped (last: {result.skip_reason}) "
                    f"at step {state.global_step}. Training stops ({why}). Lower lr_scheduler.learning_rate, check "
                    f"the data, or resume from the last checkpoint with different settings."
                )
                logger.error(self.stop_reason[len("diverged: ") :])
                break

    def _account(self, r: StepResult) -> None:
        s = self.state
        s.tokens_seen += r.num_tokens
        self._run_tokens += r.input_tokens
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
        flops_per_token = self._model_flops_per_token(int(first_batch["input_ids"].shape[-1]))
        achieved = flops_per_token * tokens_per_s / self.ctx.world_size  # per device
        peak = self._peak()
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

    def _model_flops_per_token(self, seq_length: int) -> float:
        if self._flops_per_token is None:
            fn = getattr(self.model, "flops_per_token", None)
            if callable(fn):
                self._flops_per_token = float(fn(seq_length))
            else:  # dense approximation: 6 FLOPs per parameter per token (forward + backward)
                self._flops_per_token = 6.0 * sum(p.numel() for p in self.model.parameters())
        return self._flops_per_token

    def _peak(self) -> float:
        if self.peak_flops is None:
            # The dtype the matmuls run in (the parameters are the fp32 masters).
            dtype = getattr(self.model, "compute_dtype", None) or next(
                (p.dtype for p in self.model.parameters() if p.is_floating_point()), torch.float32
            )
            override = getattr(getattr(self.config, "mfu", None), "peak_tflops", None)
            peak = mfu_peak(self.ctx.device, dtype, override)
            logger.info("MFU denominator: %s", peak.source)
            self.peak_flops = peak.flops
        return self.peak_flops

    # -- stopping -----------------------------------------------------------------------------

    def request_stop(self, reason: str) -> None:
        """Ask the run to stop: all ranks agree on it before the next step, save and stop.

        Safe inside a signal handler: it only sets flags (no logging, no I/O, no collective).
        """
        self.stop_reason = self.stop_reason or reason
        self.stop_requested = True

    def _stop_agreed(self) -> bool:
        """Every rank stops at the same step, even if only one received the signal.

        Called at one fixed point of the loop, before each step, on every rank: an all-reduce (MAX)
        of [this rank wants to stop, the signal it received]. Everything a rank does differently on
        stopping (breaking out of the loop, the final save) follows the agreed value, never the local
        flag: a signal handled during a step, or right after this all-reduce, is only acted on at the
        next agreement, so no rank can enter a save's collectives while another trains on.
        """
        if self.stopping:
            return True
        votes = [1 if self.stop_requested else 0, self._stop_signal]
        if self._recovery is not None:  # recovery's rollback vote rides on the same all-reduce
            votes += self._recovery.vote_values()
        if self.ctx.distributed:
            flag = torch.tensor(votes, dtype=torch.int64, device=self.ctx.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            votes = [int(v) for v in flag.tolist()]
        agreed, signum = bool(votes[0]), votes[1]
        if self._recovery is not None:
            self._recovery.agree(votes[2:])
        if not agreed:
            return False
        if signum and self._stop_signal != signum:  # the strongest signal any rank received
            self.stop_reason = f"received {signal.Signals(signum).name} (on another rank)"
        self.stop_reason = self.stop_reason or "stop requested on another rank"
        self.stop_requested = self.stopping = True
        logger.warning(
            "%s: all ranks stop after step %d (with a checkpoint of it when saving is on).",
            self.stop_reason,
            self.state.global_step,
        )
        return True

    def _install_signal_handlers(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        previous = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.getsignal(sig)

            def handler(signum: int, frame: Any, _prev: Any = previous[sig]) -> None:
                if self.stop_requested and signum == signal.SIGINT:
                    raise KeyboardInterrupt  # a second Ctrl-C stops at once
                # Flags only: the stop is agreed and logged at the next fixed point of the loop.
                self._stop_signal = max(self._stop_signal, int(signum))
                self.request_stop(f"received {signal.Signals(signum).name}")

            signal.signal(sig, handler)
        return previous

    def _restore_signal_handlers(self, previous: dict[int, Any]) -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    # -- the end ------------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        from lmforge.train.summary import run_summary

        return run_summary(self)


def _loss_scaler_for(model: nn.Module) -> LossScaler | None:
    """fp16 compute needs dynamic loss scaling; bf16 and fp32 do not (fp32's exponent range)."""
    return LossScaler() if getattr(model, "compute_dtype", None) == torch.float16 else None


def _model_device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _config_dict(config: Any) -> dict[str, Any] | None:
    if hasattr(config, "to_dict"):
        return config.to_dict()
    if isinstance(config, dict):
        return dict(config)
    return None
