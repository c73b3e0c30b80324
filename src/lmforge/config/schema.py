"""The ``train.yaml`` schema: one pydantic class per section, with the original's fields and defaults.

Field names, types and defaults follow the configuration document (spec 004) and the original's
``config.py`` (reference/mindformers.md §1.3). Types are strict: a bool is never a number and a
string is never coerced, except that a float field accepts an int and a number written as a string
(``"1e-8"``, which YAML 1.1 reads as a string). Sections marked *open* keep unknown keys (the
original's ``allow_extra``); they are readable as attributes and included in ``to_dict()``.

Every rule raises ``ValueError`` whose text starts with the full dotted path of the key; ``load``
turns pydantic's errors into one :class:`~lmforge.errors.ConfigError`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, model_validator

from lmforge.config.layer_spec import check_layer_range, parse_layer_specs

_NUMBER = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?$")


def _number_from_string(value: Any) -> Any:
    # YAML 1.1 reads ``1e-8`` (no dot) as a string; the spec's users write it, so it counts as a float.
    if isinstance(value, str) and _NUMBER.match(value.strip()):
        return float(value.strip())
    return value


Float = Annotated[float, BeforeValidator(_number_from_string)]


class Section(BaseModel):
    """A strict section: unknown keys are errors, values are type-checked, objects are frozen."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, protected_namespaces=())

    def to_dict(self) -> dict[str, Any]:
        """A plain dict of this section, nested sections and extras included."""
        return self.model_dump(mode="python")

    def get(self, key: str, default: Any = None) -> Any:
        """The value of a field or extra key (an extra named like a pydantic method, e.g. ``schema``,
        is only reachable this way or with ``section[key]``)."""
        extra = self.__pydantic_extra__ or {}
        if key in extra:
            return extra[key]
        if key in type(self).model_fields:
            return getattr(self, key)
        return default

    def __getitem__(self, key: str) -> Any:
        extra = self.__pydantic_extra__ or {}
        if key in extra or key in type(self).model_fields:
            return self.get(key)
        raise KeyError(f"'{type(self).__name__}' object has no key '{key}'")


class OpenSection(Section):
    """A section whose undeclared keys pass through to the component that reads it (``allow_extra``)."""

    model_config = ConfigDict(strict=True, extra="allow", frozen=True, protected_namespaces=())

    @model_validator(mode="after")
    def _nest_extra_mappings(self) -> OpenSection:
        # Like the original, a nested mapping among the extras becomes a config object, so that
        # ``cfg.train_dataset.dataloader.config.seq_length`` works; to_dict() turns it back.
        extra = self.__pydantic_extra__ or {}
        for key, value in list(extra.items()):
            if isinstance(value, dict) and all(isinstance(k, str) for k in value):
                extra[key] = ConfigNode.model_validate(value)
        return self

    def extras(self) -> dict[str, Any]:
        """The undeclared keys of this section (plain values)."""
        dumped = self.to_dict()
        return {k: dumped[k] for k in (self.__pydantic_extra__ or {})}


class ConfigNode(OpenSection):
    """A nested mapping inside an open section: any keys, attribute access, plain dict via to_dict()."""


def _positive(value: Any, path: str) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"{path} must be positive, got {value}")


def _one_of(value: Any, path: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"{path} must be one of {', '.join(repr(v) for v in valid)}; got {value!r}")


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

    @model_validator(mode="after")
    def _check(self) -> CheckpointConfig:
        # The original divides by save_interleaved_steps and keeps the last save_max saves; 0 or a
        # negative value would crash or delete every checkpoint, so they are refused here.
        for name in ("save_max", "save_interleaved_steps", "load_worker_number", "reshard_worker_num"):
            _positive(getattr(self, name), f"checkpoint.{name}")
        return self


# --------------------------------------------------------------------------------------------------
# training


class TrainingConfig(Section):
    steps: int = 1000
    local_batch_size: int = 1
    global_batch_size: int = 1
    max_norm: Float = 1.0
    seed: int = 42
    deterministic: bool = False
    rampup_batch_size: list[Any] | None = None

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
        _positive(self.steps, "training.steps")
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
# parallelism

SHARD_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
RESHARD_POLICIES = ("always", "never", "default")
CP_METHODS = ("colossal", "ulysses", "hybrid")
PP_SCHEDULES = ("1f1b", "interleaved_1f1b", "gpipe")
P2P_TRANSPORTS = ("auto", "plain")
DISPATCHERS = ("alltoall", "alltoall_deredundancy")
_PP_CHUNK = re.compile(r"^\s*\d+\s*(-\s*\d+\s*)?$")


class ParallelismConfig(Section):
    data_parallel_shard: int = -1
    data_parallel_shard_strategy: str = "optim_grads_params"
    reshard_after_forward_policy: str = "default"
    cpu_offload: bool = False
    disable_gradient_division: bool = True
    dense_fsdp_shard_size: int | None = None
    tensor_parallel: int = 1
    context_parallel: int = 1
    context_parallel_method: str = "colossal"
    context_parallel_async: bool = False
    ulysses_degree_in_cp: int | None = None
    context_parallel_mask_type: str = "causal"
    pipeline_parallel: int = 1
    # The original's class default is "auto" (the spec's table says None); null means the same.
    pipeline_parallel_layers_per_stage: str | list[Any] | None = "auto"
    pipeline_parallel_schedule: str = "1f1b"
    pipeline_parallel_microbatch_size: int = 1
    pipeline_parallel_interleave_num: int = 1
    pipeline_parallel_overlap_p2p: bool = False
    pipeline_parallel_overlap_b_f: bool = False
    pipeline_parallel_enable_dxdw_split: bool = False
    pipeline_parallel_p2p_transport: str = "plain"
    # The spec: "enabling TP enables SP automatically; turning it off is not supported". lmforge sets it
    # whenever tensor_parallel > 1 instead of refusing a file that omits it (the original's master does).
    sequence_parallel: bool = False
    enable_mc2: bool = False
    enable_loss_parallel: bool = False
    expert_parallel: int = 1
    npu_nums_per_device: int = 8
    moe_token_dispatcher_type: str = "alltoall"
    expert_parallel_async_d2h: bool = False
    expert_parallel_use_safe_tokens: bool = True

    @model_validator(mode="before")
    @classmethod
    def _sequence_parallel_follows_tp(cls, data: Any) -> Any:
        if isinstance(data, dict):
            tp = data.get("tensor_parallel", 1)
            if isinstance(tp, int) and not isinstance(tp, bool) and tp > 1:
                data = {**data, "sequence_parallel": True}
        return data

    @model_validator(mode="after")
    def _check(self) -> ParallelismConfig:
        p = "parallelism"
        if self.data_parallel_shard == 0 or self.data_parallel_shard < -1:
            raise ValueError(
                f"{p}.data_parallel_shard must be -1 (shard over every data-parallel rank) or a positive "
                f"integer, got {self.data_parallel_shard}"
            )
        for name in (
            "tensor_parallel",
            "context_parallel",
            "pipeline_parallel",
            "pipeline_parallel_interleave_num",
            "pipeline_parallel_microbatch_size",
            "expert_parallel",
            "npu_nums_per_device",
            "dense_fsdp_shard_size",
            "ulysses_degree_in_cp",
        ):
            _positive(getattr(self, name), f"{p}.{name}")
        _one_of(self.data_parallel_shard_strategy, f"{p}.data_parallel_shard_strategy", SHARD_STRATEGIES)
        _one_of(self.reshard_after_forward_policy, f"{p}.reshard_after_forward_policy", RESHARD_POLICIES)
        _one_of(self.context_parallel_method, f"{p}.context_parallel_method", CP_METHODS)
        _one_of(self.pipeline_parallel_schedule, f"{p}.pipeline_parallel_schedule", PP_SCHEDULES)
        _one_of(self.pipeline_parallel_p2p_transport, f"{p}.pipeline_parallel_p2p_transport", P2P_TRANSPORTS)
        _one_of(self.moe_token_dispatcher_type, f"{p}.moe_token_dispatcher_type", DISPATCHERS)
        if self.moe_token_dispatcher_type == "alltoall_deredundancy" and (
            self.expert_parallel < self.npu_nums_per_device
        ):
            raise ValueError(
                f"{p}.expert_parallel must be greater than or equal to npu_nums_per_device when using "
                f"'alltoall_deredundancy', but got expert_parallel={self.expert_parallel} < "
                f"npu_nums_per_device={self.npu_nums_per_device}."
            )
        if self.context_parallel_method == "hybrid" and self.context_parallel > 1:
            u = self.ulysses_degree_in_cp
            if u is None:
                raise ValueError(
                    f"{p}.ulysses_degree_in_cp is required when context_parallel_method is 'hybrid' "
                    f"(a divisor of context_parallel={self.context_parallel})"
                )
            if self.context_parallel % u != 0:
                raise ValueError(
                    f"{p}.ulysses_degree_in_cp ({u}) must divide context_parallel ({self.context_parallel})"
                )
        self._check_layers_per_stage()
        return self

    def _check_layers_per_stage(self) -> None:
        path = "parallelism.pipeline_parallel_layers_per_stage"
        spec = self.pipeline_parallel_layers_per_stage
        if spec is None or spec == "auto":
            return
        if isinstance(spec, str):
            raise ValueError(
                f"{path} must be 'auto' or a list of strings (one per pipeline stage), got {spec!r}"
            )
        pp, chunks = self.pipeline_parallel, self.pipeline_parallel_interleave_num
        if len(spec) != pp:
            raise ValueError(
                f"{path} must have one entry per pipeline stage (pipeline_parallel={pp}), got {len(spec)}"
            )
        for i, entry in enumerate(spec):
            if not isinstance(entry, str):
                raise ValueError(
                    f"{path}[{i}] must be a string of {chunks} comma-separated layer ranges such as '0-3' "
                    f"or '4', got {entry!r}"
                )
            parts = entry.split(",")
            if len(parts) != chunks:
                raise ValueError(
                    f"{path}[{i}] must hold pipeline_parallel_interleave_num={chunks} comma-separated "
                    f"ranges, got {entry!r}"
                )
            for part in parts:
                if not _PP_CHUNK.match(part):
                    raise ValueError(
                        f"{path}[{i}]: invalid layer range {part.strip()!r}; expected format is "
                        "'start-end' or 'single_layer'"
                    )
                bounds = [int(x) for x in part.split("-")]
                if bounds[0] > bounds[-1]:
                    raise ValueError(
                        f"{path}[{i}]: invalid layer range {part.strip()!r}: layer_start must be less than "
                        "or equal to layer_end"
                    )


# --------------------------------------------------------------------------------------------------
# optimizer and lr_scheduler


class OptimizerConfig(OpenSection):
    type: str = "AdamW"
    betas: list[Float] = Field(default_factory=lambda: [0.9, 0.95])
    eps: Float = 1.0e-8
    weight_decay: Float = 0.01
    weight_decay_include: list[str] | None = None
    weight_decay_exclude: list[str] | None = None
    accumulate_allreduce_grads_in_fp32: bool = True

    @model_validator(mode="after")
    def _check(self) -> OptimizerConfig:
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(
                f"optimizer.betas must be two values, each in [0, 1) (e.g. [0.9, 0.95]); got {self.betas}"
            )
        if not self.eps > 0:
            raise ValueError(f"optimizer.eps must be > 0 (e.g. 1.0e-8), got {self.eps}")
        if not self.weight_decay >= 0:
            raise ValueError(f"optimizer.weight_decay must be >= 0, got {self.weight_decay}")
        return self


class LrSchedulerConfig(OpenSection):
    type: str
    learning_rate: Float = 1e-5

    @model_validator(mode="after")
    def _check(self) -> LrSchedulerConfig:
        if not self.learning_rate >= 0:
            raise ValueError(f"lr_scheduler.learning_rate must be >= 0, got {self.learning_rate}")
        return self


# --------------------------------------------------------------------------------------------------
# train_dataset


class DataloaderConfig(OpenSection):
    type: str
    shuffle: bool = False
    column_names: list[str] = Field(default_factory=lambda: ["input_ids", "labels"])
    python_multiprocessing: bool = False


class TrainDatasetConfig(Section):
    dataloader: DataloaderConfig
    drop_remainder: bool = True
    num_parallel_workers: int = 8
    prefetch_size: int = 1
    numa_enable: bool = False
    use_distribute_dataset: bool = False

    @model_validator(mode="after")
    def _check(self) -> TrainDatasetConfig:
        if self.num_parallel_workers < 0:
            raise ValueError(
                f"train_dataset.num_parallel_workers must be >= 0, got {self.num_parallel_workers}"
            )
        _positive(self.prefetch_size, "train_dataset.prefetch_size")
        return self


# --------------------------------------------------------------------------------------------------
# model


class ModelConfig(OpenSection):
    model_type: str
    architectures: str

    def layer_count(self) -> int | None:
        """Decoder layers plus MTP layers, or None when the section does not say."""
        layers = None
        for key in ("num_hidden_layers", "num_layers"):
            value = getattr(self, key, None)
            if isinstance(value, int) and not isinstance(value, bool):
                layers = value
                break
        if layers is None:
            return None
        mtp = 0
        for key in ("mtp_num_layers", "num_nextn_predict_layers"):
            value = getattr(self, key, None)
            if isinstance(value, int) and not isinstance(value, bool):
                mtp = value
                break
        return layers + max(mtp, 0)


# --------------------------------------------------------------------------------------------------
# monitor


class HealthCheckpointConfig(Section):
    embedding_local_norm_threshold: Float = 100.0
    global_norm_skip_threshold: Float = 100.0
    global_norm_skip_time: int = 10

    @model_validator(mode="after")
    def _check(self) -> HealthCheckpointConfig:
        p = "monitor.health_checkpoint"
        _positive(self.embedding_local_norm_threshold, f"{p}.embedding_local_norm_threshold")
        _positive(self.global_norm_skip_threshold, f"{p}.global_norm_skip_threshold")
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
        _positive(self.log_interval, "monitor.tensorboard.log_interval")
        _positive(self.queue_size, "monitor.tensorboard.queue_size")
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


class MonitorConfig(Section):
    health_checkpoint: HealthCheckpointConfig = Field(default_factory=HealthCheckpointConfig)
    train_state: TrainStateConfig = Field(default_factory=TrainStateConfig)
    tensorboard: TensorboardConfig = Field(default_factory=TensorboardConfig)
    moe_monitor: MoeMonitorConfig = Field(default_factory=MoeMonitorConfig)


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
# recompute, recompute_comm, swap

RECOMPUTE_MODES = ("None", "full", "select")


def _check_select_module(value: Any, path: str) -> None:
    if not isinstance(value, dict):
        raise ValueError(
            f"{path} must be a mapping (module path regex -> list of layer specs), got {type(value).__name__}"
        )
    for key, specs in value.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"{path}: every key must be a non-empty module path regex, got {key!r}")
        try:
            re.compile(key)
        except re.error as exc:
            raise ValueError(f"{path}: key {key!r} is not a valid regular expression ({exc})") from None
        parse_layer_specs(specs, f"{path}[{key!r}]")


class RecomputeConfig(Section):
    mode: str = "None"
    full_recompute_layer: list[Any] | None = None
    select_module: dict[Any, Any] | None = None
    exclude_op: list[str] | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_mode_is_none(cls, data: Any) -> Any:
        # The mode is the *string* "None"; an explicit YAML null means the same thing.
        if isinstance(data, dict) and "mode" in data and data["mode"] is None:
            data = {**data, "mode": "None"}
        return data

    @model_validator(mode="after")
    def _check(self) -> RecomputeConfig:
        _one_of(self.mode, "recompute.mode", RECOMPUTE_MODES)
        if self.mode == "full" and not self.full_recompute_layer:
            raise ValueError(
                "recompute.full_recompute_layer is required when recompute.mode is 'full' (mode is 'full' "
                "but full_recompute_layer is missing or empty); e.g. full_recompute_layer: ['0-3']"
            )
        if self.mode == "select" and not self.select_module:
            raise ValueError(
                "recompute.select_module is required when recompute.mode is 'select' (mode is 'select' but "
                "select_module is missing or empty); e.g. select_module: {'mlp': ['0-3']}"
            )
        if self.full_recompute_layer is not None:
            parse_layer_specs(self.full_recompute_layer, "recompute.full_recompute_layer")
        if self.select_module is not None:
            _check_select_module(self.select_module, "recompute.select_module")
        return self


class RecomputeCommConfig(Section):
    enable: bool = False
    select_module: dict[Any, Any] | None = None

    @model_validator(mode="after")
    def _check(self) -> RecomputeCommConfig:
        if self.enable and not self.select_module:
            raise ValueError(
                "recompute_comm.select_module is required when recompute_comm.enable is True (enable is "
                "True but select_module is missing or empty); e.g. select_module: {'attention.qkv': ['0-3']}"
            )
        if self.select_module is not None:
            _check_select_module(self.select_module, "recompute_comm.select_module")
        return self


def _swap_entries(value: Any, path: str, needs_op_name: bool) -> list[dict[str, Any]]:
    entries = [value] if isinstance(value, dict) else value
    if not isinstance(entries, list):
        raise ValueError(f"{path} must be a list of mappings, got {type(value).__name__}")
    allowed = {"op_name", "layers"} if needs_op_name else {"layers"}
    for i, entry in enumerate(entries):
        where = f"{path}[{i}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where} must be a mapping such as {{layers: ['0-1']}}, got {entry!r}")
        unknown = sorted(str(k) for k in entry if k not in allowed)
        if unknown:
            raise ValueError(f"{where}: unknown keys {unknown}; valid keys are {sorted(allowed)}")
        if "layers" not in entry:
            raise ValueError(f"{where}.layers is required (a list of layer specs such as ['0-1'])")
        if needs_op_name and (not isinstance(entry.get("op_name"), str) or not entry["op_name"]):
            raise ValueError(f"{where}.op_name is required (a module name or regex such as 'attention')")
        parse_layer_specs(entry["layers"], f"{where}.layers")
    return entries


class SwapConfig(Section):
    enable: bool = False
    default_prefetch: int = 1
    layer_swap: list[Any] | dict[Any, Any] | None = None
    op_swap: list[Any] | dict[Any, Any] | None = None

    @model_validator(mode="after")
    def _check(self) -> SwapConfig:
        if self.default_prefetch < 1:
            raise ValueError(
                f"swap.default_prefetch must be in [1, num_layers - 1], got {self.default_prefetch}"
            )
        if self.layer_swap is not None:
            _swap_entries(self.layer_swap, "swap.layer_swap", needs_op_name=False)
        if self.op_swap is not None:
            _swap_entries(self.op_swap, "swap.op_swap", needs_op_name=True)
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
        _positive(self.lora_rank, "lora_config.lora_rank")
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


# --------------------------------------------------------------------------------------------------
# the whole file


class TrainConfig(OpenSection):
    """A validated, frozen ``train.yaml``. Unknown top-level keys pass through (``allow_extra``)."""

    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    parallelism: ParallelismConfig = Field(default_factory=ParallelismConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    lr_scheduler: LrSchedulerConfig
    train_dataset: TrainDatasetConfig
    model: ModelConfig
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    context: ContextConfig = Field(default_factory=ContextConfig)
    profiler: ProfilerConfig = Field(default_factory=ProfilerConfig)
    recompute: RecomputeConfig = Field(default_factory=RecomputeConfig)
    recompute_comm: RecomputeCommConfig = Field(default_factory=RecomputeCommConfig)
    swap: SwapConfig = Field(default_factory=SwapConfig)
    callbacks: list[CallbackConfig] = Field(default_factory=list)
    lora_config: LoraConfig | None = None
    # lmforge's own top-level key: where logs, TensorBoard events and plots go.
    output_dir: str = "./output"

    # Warnings found while loading (inert fields, ...); see lmforge.config.config_warnings.
    _warnings: tuple[str, ...] = PrivateAttr(default=())

    @property
    def warnings(self) -> tuple[str, ...]:
        """Warnings found while loading: fields accepted without effect, overridden settings."""
        return self._warnings

    @model_validator(mode="after")
    def _check_against_model(self) -> TrainConfig:
        num_layers = self.model.layer_count()
        if num_layers is None:
            return self
        self._check_layer_specs(num_layers)
        self._check_pipeline_split()
        return self

    def _check_layer_specs(self, n: int) -> None:
        def check(values: Any, label: str) -> None:
            check_layer_range(parse_layer_specs(values, label), values, n, label)

        if self.recompute.full_recompute_layer is not None:
            check(self.recompute.full_recompute_layer, "recompute.full_recompute_layer")
        for name, section in (("recompute", self.recompute), ("recompute_comm", self.recompute_comm)):
            for key, specs in (section.select_module or {}).items():
                check(specs, f"{name}.select_module[{key!r}]")
        swap = self.swap
        largest = -1
        for field in ("layer_swap", "op_swap"):
            value = getattr(swap, field)
            if value is None:
                continue
            for i, entry in enumerate([value] if isinstance(value, dict) else value):
                label = f"swap.{field}[{i}].layers"
                check(entry["layers"], label)
                largest = max([largest] + [hi for _, hi in parse_layer_specs(entry["layers"], label)])
        if swap.enable:
            if not 1 <= swap.default_prefetch <= n - 1:
                raise ValueError(
                    f"swap.default_prefetch must be in [1, num_layers - 1] = [1, {n - 1}] for this model "
                    f"({n} layers), got {swap.default_prefetch}"
                )
            if largest >= 0 and largest + swap.default_prefetch >= n:
                raise ValueError(
                    f"swap.default_prefetch ({swap.default_prefetch}) plus the largest swapped layer id "
                    f"({largest}) must be below the model's {n} layers"
                )

    def _check_pipeline_split(self) -> None:
        par = self.parallelism
        stages = par.pipeline_parallel * par.pipeline_parallel_interleave_num
        spec = par.pipeline_parallel_layers_per_stage
        decoder_layers = getattr(self.model, "num_hidden_layers", None) or getattr(
            self.model, "num_layers", None
        )
        auto = stages > 1 and spec in (None, "auto") and isinstance(decoder_layers, int)
        if auto and decoder_layers % stages != 0:
            raise ValueError(
                f"parallelism.pipeline_parallel_layers_per_stage: Number of layers ({decoder_layers}) is "
                f"not divisible by total stages ({stages}). Please configure the model distribution via "
                "'pipeline_parallel_layers_per_stage'."
            )


SECTION_CLASSES: dict[str, type[Section]] = {
    "checkpoint": CheckpointConfig,
    "training": TrainingConfig,
    "parallelism": ParallelismConfig,
    "optimizer": OptimizerConfig,
    "lr_scheduler": LrSchedulerConfig,
    "train_dataset": TrainDatasetConfig,
    "model": ModelConfig,
    "monitor": MonitorConfig,
    "context": ContextConfig,
    "profiler": ProfilerConfig,
    "recompute": RecomputeConfig,
    "recompute_comm": RecomputeCommConfig,
    "swap": SwapConfig,
    "callbacks": CallbackConfig,
    "lora_config": LoraConfig,
}
