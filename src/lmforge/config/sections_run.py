"""Sections about the run itself: checkpoint, training, monitor, context, profiler, callbacks, lora_config."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_serializer, model_validator

from lmforge.config.base import Float, OpenSection, Section, check_positive
from lmforge.config.sections_trackers import MlflowConfig, WandbConfig

# --------------------------------------------------------------------------------------------------
# checkpoint


class CheckpointConfig(Section):
    enable_save: bool = True
    save_path: str = ""
    save_max: int = 5
    save_interleaved_steps: int = 1000
    no_save_optim: bool = False
    async_save: bool = False
    prefix: str | None = "checkpoint"
    remove_redundancy: bool = False
    load_path: str = ""
    load_balanced: bool = False
    no_load_optim: bool = False
    load_worker_number: int = 1
    save_global_layout_cache: bool = True
    reshard_worker_num: int = 1
    # lmforge extension (docs/training.md "Automatic resume"): resume from save_path's latest complete
    # checkpoint, ahead of load_path. "auto": only when torchrun restarted the workers (an elastic
    # restart of the same job; the original has none, so its semantics are untouched); true: also on a
    # fresh launch (a requeued SLURM job); false: never.
    auto_resume: bool | Literal["auto"] = "auto"

    @field_validator("auto_resume", mode="before")
    @classmethod
    def _auto_resume_value(cls, value: Any) -> Any:
        if not isinstance(value, bool) and value != "auto":
            raise ValueError(f'checkpoint.auto_resume must be true, false or "auto"; got {value!r}')
        return value

    # lmforge: load a checkpoint whose parameters differ from the model's (e.g. fewer layers); the
    # parameters skipped either way are listed in the log. Needs no_load_optim: true.
    partial_load: bool = False
    # lmforge: resume (weights, step, schedule, data position) with a fresh optimizer state; the one way
    # to resume with another optimizer.type (a checkpoint's state is refused by any other type).
    reset_optimizer: bool = False

    @model_validator(mode="after")
    def _check(self) -> CheckpointConfig:
        # The original divides by save_interleaved_steps and keeps the last save_max saves; 0 or a
        # negative value would crash or delete every checkpoint, so they are refused here.
        for name in ("save_max", "save_interleaved_steps", "load_worker_number", "reshard_worker_num"):
            check_positive(getattr(self, name), f"checkpoint.{name}")
        if self.enable_save and not self.save_path:
            raise ValueError(
                "checkpoint.save_path: save_path must be provided for CheckpointCallback. Set it to the "
                "directory where iteration_XXXXXXXX/ checkpoints should be written, or set "
                "checkpoint.enable_save: false (or omit the checkpoint section: no checkpoints are saved)."
            )
        if self.reset_optimizer and self.no_load_optim:
            raise ValueError(
                "checkpoint.reset_optimizer: true resumes a run without its optimizer state, but "
                "checkpoint.no_load_optim: true loads the weights only (nothing else is resumed); set one of them."
            )
        if (
            self.reset_optimizer
            and not self.load_path
            and (self.auto_resume is False or not self.enable_save)
        ):
            raise ValueError(
                "checkpoint.reset_optimizer: true has nothing to act on: no checkpoint.load_path is set and "
                "checkpoint.auto_resume cannot resume from save_path. Set load_path, or remove reset_optimizer."
            )
        # Nothing is saved, so there is nothing to resume from; only an explicit true is a mistake.
        if self.auto_resume is True and not self.enable_save:
            raise ValueError(
                "checkpoint.auto_resume: true needs checkpoint.enable_save: true (it resumes from the "
                "checkpoints this run saves in checkpoint.save_path); set auto_resume: false or enable saving."
            )
        return self


# --------------------------------------------------------------------------------------------------
# training


MAX_SEED = 2**64 - 1  # the largest seed torch.manual_seed takes


class TrainingConfig(Section):
    steps: int = 1000
    # lmforge extension (docs/config.md "lmforge's own keys"): passes over the training split; the run
    # plan derives the steps from the data (parallel/plan.py). Exactly one of steps / epochs is given.
    epochs: int | None = None
    local_batch_size: int = 1
    global_batch_size: int = 1
    max_norm: Float = 1.0
    seed: int = 42
    deterministic: bool = False
    rampup_batch_size: list[Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _steps_null_means_unset(cls, data: Any) -> Any:
        # `--set training.steps=null` removes a recipe's steps so that `--set training.epochs=N` can
        # replace it; null alone would silently mean the default 1000 steps, so it needs epochs.
        if isinstance(data, dict) and "steps" in data and data["steps"] is None:
            if data.get("epochs") is None:
                raise ValueError(
                    "training.steps: null leaves the run without a length; give training.steps (optimizer "
                    "steps) or training.epochs (passes over the training data)."
                )
            data = {k: v for k, v in data.items() if k != "steps"}
        return data

    @model_validator(mode="after")
    def _check_length(self) -> TrainingConfig:
        if self.epochs is None:
            return self
        if self.epochs < 1:
            raise ValueError(
                f"training.epochs must be a positive number of passes over the training data, got {self.epochs}."
            )
        if "steps" in self.model_fields_set:
            raise ValueError(
                f"training.steps ({self.steps}) and training.epochs ({self.epochs}) are both set; give one: "
                "steps is the number of optimizer steps, epochs the number of passes over the training data "
                "(the steps are then derived from the data and shown by `lmforge check`). To replace a "
                "file's steps on the command line: --set training.steps=null --set training.epochs=N."
            )
        return self

    @model_serializer(mode="wrap")
    def _dump_one_length(self, handler: Any) -> Any:
        # A config written back (checkpoint config.yaml) keeps the key the user gave: with epochs, the
        # steps are derived again from the data when it is read, so they are not written.
        out = handler(self)
        if self.epochs is not None and isinstance(out, dict):
            out.pop("steps", None)
        return out

    @model_validator(mode="after")
    def _check(self) -> TrainingConfig:
        if self.global_batch_size <= 0:
            raise ValueError(
                f"training.global_batch_size in config must be positive, got {self.global_batch_size}"
            )
        if self.local_batch_size <= 0:
            raise ValueError(
                f"training.local_batch_size in config must be positive, got {self.local_batch_size}"
            )
        check_positive(self.steps, "training.steps")
        if not 0 <= self.seed <= MAX_SEED:
            # torch.manual_seed overflows past 2**64 - 1 and numpy's generators (the text loader's
            # shuffle) refuse a negative seed: both were tracebacks once training started.
            raise ValueError(f"training.seed must be an integer in [0, 2**64 - 1], got {self.seed}")
        if not self.max_norm > 0:
            # The original has no switch to turn clipping off: with max_norm 0 its clip coefficient
            # max_norm / (norm + eps) is 0 and every gradient is silently zeroed (negative values flip
            # the gradients). lmforge refuses both.
            raise ValueError(
                f"training.max_norm must be > 0, got {self.max_norm}: clipping always runs, and "
                "max_norm 0 would scale every gradient to zero (a negative value would flip them); to "
                "clip less, use a larger value such as 1.0 or 10.0"
            )
        rbs = self.rampup_batch_size
        if rbs is not None:
            if len(rbs) != 3:
                raise ValueError(
                    "training.rampup_batch_size must be a 3-element list [start_global_batch_size, "
                    f"batch_size_increment, rampup_samples], got {rbs!r}."
                )
            if any(isinstance(v, bool) or not isinstance(v, int) for v in rbs):
                raise ValueError(f"training.rampup_batch_size elements must be int, got {rbs!r}.")
            start, inc, samples = rbs
            if start <= 0 or inc <= 0 or samples < 0:
                raise ValueError(
                    "training.rampup_batch_size needs start_global_batch_size > 0, "
                    f"batch_size_increment > 0 and rampup_samples >= 0, got {rbs!r}."
                )
            if start > self.global_batch_size:
                raise ValueError(
                    f"training.rampup_batch_size: start_global_batch_size {start} exceeds "
                    f"training.global_batch_size {self.global_batch_size}."
                )
            if (self.global_batch_size - start) % inc != 0:
                raise ValueError(
                    "training.rampup_batch_size: global_batch_size - start_global_batch_size "
                    f"({self.global_batch_size} - {start}) must be a multiple of batch_size_increment {inc}."
                )
        return self


# --------------------------------------------------------------------------------------------------
# monitor


class HealthCheckpointConfig(Section):
    embedding_local_norm_threshold: Float = 100.0
    global_norm_skip_threshold: Float = 100.0
    global_norm_skip_time: int = 10

    @model_validator(mode="after")
    def _check(self) -> HealthCheckpointConfig:
        p = "monitor.health_checkpoint"
        check_positive(self.embedding_local_norm_threshold, f"{p}.embedding_local_norm_threshold")
        check_positive(self.global_norm_skip_threshold, f"{p}.global_norm_skip_threshold")
        if self.global_norm_skip_time < 0:
            raise ValueError(f"{p}.global_norm_skip_time must be >= 0, got {self.global_norm_skip_time}")
        return self


def _norm_selector(value: Any, path: str) -> None:
    # bool: all parameters on/off; str: a substring filter ("" = off); list of str: several filters.
    if isinstance(value, (bool, str)):
        return
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return
    raise ValueError(f"{path} only supports bool, str, or list[str]; got {value!r}")


class TrainStateConfig(Section):
    local_norm: bool | str | list[str] = ""
    local_loss: bool = False
    device_norm: bool | str | list[str] = False
    device_loss: bool = False

    @model_validator(mode="before")
    @classmethod
    def _check_selectors(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name in ("local_norm", "device_norm"):
                if name in data:
                    _norm_selector(data[name], f"monitor.train_state.{name}")
        return data


class TensorboardConfig(Section):
    output_dir: str = ""
    log_interval: int = 1
    queue_size: int = 1000

    @model_validator(mode="after")
    def _check(self) -> TensorboardConfig:
        check_positive(self.log_interval, "monitor.tensorboard.log_interval")
        check_positive(self.queue_size, "monitor.tensorboard.queue_size")
        return self


class MoeMonitorConfig(Section):
    save_tokens_per_expert_interval: Any = None
    target_layers: Any = None

    @model_validator(mode="after")
    def _check(self) -> MoeMonitorConfig:
        p = "monitor.moe_monitor"
        interval = self.save_tokens_per_expert_interval
        if isinstance(interval, bool):
            raise ValueError(f"{p}.save_tokens_per_expert_interval should be int or None, not bool.")
        if interval is not None:
            if not isinstance(interval, int):
                raise ValueError(
                    f"{p}.save_tokens_per_expert_interval should be int or None, got {interval!r}."
                )
            if interval <= 0:
                raise ValueError(
                    f"{p}.save_tokens_per_expert_interval must be positive or None, got {interval}."
                )
        layers = self.target_layers
        if isinstance(layers, bool):
            raise ValueError(f"{p}.target_layers should be int, list[int] or None, not bool.")
        if isinstance(layers, int):
            if layers <= 0:
                raise ValueError(f"{p}.target_layers must be positive when it is an int, got {layers}.")
        elif isinstance(layers, list):
            if any(isinstance(v, bool) or not isinstance(v, int) for v in layers):
                raise ValueError(f"{p}.target_layers should contain only ints, got {layers!r}.")
            if any(v < 0 for v in layers):
                raise ValueError(f"{p}.target_layers list values must be non-negative, got {layers!r}.")
        elif layers is not None:
            raise ValueError(f"{p}.target_layers should be int, list[int] or None, got {layers!r}.")
        return self


class DoctorConfig(Section):
    """``monitor.doctor``: the training doctor's rules, run live during training (docs/guide.md)."""

    enable: bool = True
    check_interval: int = 50  # steps between checks (plus steps 5, 10 and 20, and the end of the run)

    @model_validator(mode="after")
    def _check(self) -> DoctorConfig:
        check_positive(self.check_interval, "monitor.doctor.check_interval")
        return self


class MonitorConfig(Section):
    health_checkpoint: HealthCheckpointConfig = Field(default_factory=HealthCheckpointConfig)
    train_state: TrainStateConfig = Field(default_factory=TrainStateConfig)
    tensorboard: TensorboardConfig = Field(default_factory=TensorboardConfig)
    moe_monitor: MoeMonitorConfig = Field(default_factory=MoeMonitorConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig)
    doctor: DoctorConfig = Field(default_factory=DoctorConfig)


# --------------------------------------------------------------------------------------------------
# context, profiler


class ContextConfig(Section):
    """MindSpore's context; the original's PyNative trainer never applies it, nor does lmforge."""

    mode: int = 1
    max_device_memory: str = "59GB"
    device_target: str = "Ascend"


class ProfilerConfig(Section):
    enable_profiling: bool = False
    start_step: int = 1
    end_step: int = 1
    output_path: str | None = None
    profiler_rank: list[int] | None = None
    profiler_level: int = 0
    mstx: bool = False
    profile_memory: bool = False
    profile_cpu: bool = True
    with_stack: bool = True

    @field_validator("profiler_level", mode="before")
    @classmethod
    def _level_is_an_int(cls, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, int):  # the original's message
            raise ValueError(
                f"profiler.profiler_level: Invalid profiler_level type: {type(value).__name__}, must be int"
            )
        return value

    @model_validator(mode="after")
    def _check(self) -> ProfilerConfig:
        s, e = self.start_step, self.end_step
        if s <= 0 or e <= 0:
            raise ValueError(
                f"profiler.start_step and profiler.end_step must be positive, but got {s} and {e} "
                "(ProfilerConfig.start_step and end_step must be positive)"
            )
        if s > e:
            raise ValueError(
                f"profiler.start_step must be less than or equal to profiler.end_step, but got {s} and {e} "
                "(ProfilerConfig.start_step must be less than or equal to end_step)"
            )
        if self.profiler_level not in (0, 1, 2):
            raise ValueError(f"profiler.profiler_level must be 0, 1 or 2, got {self.profiler_level}")
        if self.profiler_rank is not None and any(r < 0 for r in self.profiler_rank):
            raise ValueError(f"profiler.profiler_rank must list non-negative ranks, got {self.profiler_rank}")
        return self


# --------------------------------------------------------------------------------------------------
# callbacks, lora_config


class CallbackConfig(OpenSection):
    type: str


class LoraConfig(Section):
    target_modules: str = ""
    exclude_layers: str | None = None
    lora_rank: int = 8
    lora_alpha: int = 16
    lora_dropout: Float = 0.0
    lora_a_std: Float = 0.01
    lora_b_std: Float = 0.0

    @model_validator(mode="after")
    def _check(self) -> LoraConfig:
        check_positive(self.lora_rank, "lora_config.lora_rank")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"lora_config.lora_dropout must be in [0, 1), got {self.lora_dropout}")
        for name in ("target_modules", "exclude_layers"):
            pattern = getattr(self, name)
            if pattern:
                try:
                    re.compile(pattern)
                except re.error as exc:
                    raise ValueError(
                        f"lora_config.{name} is not a valid regular expression: {pattern!r} ({exc})"
                    ) from None
        return self
