"""The ``train.yaml`` schema: ``TrainConfig`` and the section classes it is made of.

Field names, types and defaults follow the configuration document (spec 004) and the original's
``config.py`` (reference/mindformers.md §1.3). The sections live in ``sections_*.py``; this module
assembles them and runs the checks that need two sections at once (layer specs against the model).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, PrivateAttr, ValidationError, ValidationInfo, field_validator, model_validator

from lmforge.config.base import ConfigNode, Float, OpenSection, Section
from lmforge.config.layer_spec import check_layer_range, parse_layer_specs
from lmforge.config.sections_components import (
    DataloaderConfig,
    LrSchedulerConfig,
    ModelConfig,
    OptimizerConfig,
    TrainDatasetConfig,
)
from lmforge.config.sections_eval import (
    eval_dataset_messages,
    inherit_eval_dataset,
    refuse_eval_without_validation_set,
)
from lmforge.config.sections_parallel import (
    ParallelismConfig,
    RecomputeCommConfig,
    RecomputeConfig,
    SwapConfig,
)
from lmforge.config.sections_recovery import RecoveryConfig
from lmforge.config.sections_run import (
    CallbackConfig,
    CheckpointConfig,
    ContextConfig,
    HealthCheckpointConfig,
    LoraConfig,
    MoeMonitorConfig,
    MonitorConfig,
    ProfilerConfig,
    TensorboardConfig,
    TrainingConfig,
    TrainStateConfig,
)
from lmforge.config.sections_speed import CompileConfig, Float8Config, MfuConfig

__all__ = [
    "SECTION_CLASSES",
    "CallbackConfig",
    "CheckpointConfig",
    "ConfigNode",
    "ContextConfig",
    "DataloaderConfig",
    "Float",
    "HealthCheckpointConfig",
    "LoraConfig",
    "LrSchedulerConfig",
    "ModelConfig",
    "MoeMonitorConfig",
    "MonitorConfig",
    "OpenSection",
    "OptimizerConfig",
    "ParallelismConfig",
    "ProfilerConfig",
    "RecomputeCommConfig",
    "RecomputeConfig",
    "RecoveryConfig",
    "Section",
    "SwapConfig",
    "TensorboardConfig",
    "TrainConfig",
    "TrainDatasetConfig",
    "TrainStateConfig",
    "TrainingConfig",
]

# --------------------------------------------------------------------------------------------------
# the whole file


class TrainConfig(OpenSection):
    """A validated, frozen ``train.yaml``. Unknown top-level keys pass through (``allow_extra``)."""

    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    parallelism: ParallelismConfig = Field(default_factory=ParallelismConfig)
    # validate_default: an omitted optimizer section is typed too (AdamW with its defaults).
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, validate_default=True)
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
    # Validation during training (lmforge.train.callbacks.validation): every eval_interval steps (0: never),
    # eval_steps micro-batches per rank (null: the whole validation split).
    eval_interval: int = 0
    eval_steps: int | None = None
    # Its own validation data, typed like train_dataset; a TextDataLoader one inherits what it does not
    # set from train_dataset (config/sections_eval.py).
    eval_dataset: TrainDatasetConfig | None = None
    # lmforge's own speed sections (docs/config.md "lmforge's own keys")
    compile: CompileConfig = Field(default_factory=CompileConfig)
    float8: Float8Config = Field(default_factory=Float8Config)
    mfu: MfuConfig = Field(default_factory=MfuConfig)
    # lmforge's own: roll back to the newest safe checkpoint on a spike or divergence (train/recovery/)
    recovery: RecoveryConfig = Field(default_factory=RecoveryConfig)

    # Warnings found while loading (inert fields, ...); see lmforge.config.config_warnings.
    _warnings: tuple[str, ...] = PrivateAttr(default=())

    @property
    def warnings(self) -> tuple[str, ...]:
        """Warnings found while loading: fields accepted without effect, overridden settings."""
        return self._warnings

    def with_derived_steps(self, steps: int) -> TrainConfig:
        """This configuration with ``training.steps`` derived from ``training.epochs`` (by the run plan,
        from the data). The lr section's typed form does not depend on the total: the run plan made
        and checked its schedule over these steps (``build_scheduler``)."""
        training = self.training.model_copy(update={"steps": int(steps)})
        return self.model_copy(update={"training": training})

    @model_validator(mode="before")
    @classmethod
    def _omitted_checkpoint_saves_nothing(cls, data: Any) -> Any:
        # The spec: a section that is omitted turns its feature off. Without a checkpoint section the
        # run trains without saving (the original stops with "save_path must be provided").
        if isinstance(data, dict) and "checkpoint" not in data:
            data = {**data, "checkpoint": {"enable_save": False}}
        return data

    @model_validator(mode="before")
    @classmethod
    def _eval_dataset_inherits(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("eval_dataset") is not None:
            data = {
                **data,
                "eval_dataset": inherit_eval_dataset(data["eval_dataset"], data.get("train_dataset")),
            }
        return data

    @field_validator("eval_dataset", mode="wrap")
    @classmethod
    def _name_eval_dataset_keys(cls, value: Any, handler: Any) -> Any:
        # The dataloader schemas name their keys under train_dataset; here they are eval_dataset's.
        try:
            return handler(value)
        except ValidationError as exc:
            raise ValueError("; ".join(eval_dataset_messages(exc))) from None

    @field_validator("lr_scheduler", mode="after")
    @classmethod
    def _type_lr_scheduler(cls, section: LrSchedulerConfig, info: ValidationInfo) -> LrSchedulerConfig:
        # The section typed its keys itself; what depends on training.steps (ratios, the WSD decay start,
        # the YAML's own total_steps) is checked now, before anything is built. With training.epochs the
        # total is derived from the data by the run plan (lmforge.parallel.plan), which checks it then.
        training = info.data.get("training")
        if training is not None and training.epochs is None and section.typed is not None:
            section.typed.check_against_training(int(training.steps))
        return section

    @model_validator(mode="after")
    def _check_data_against_model(self) -> TrainConfig:
        # The loader's sequence length and token ids must be the model's; both sections are typed now.
        data, model = self.train_dataset.dataloader.typed, self.model.typed
        if data is not None and model is not None:
            data.check_against_model(model.config.seq_length, model.config.vocab_size)
        return self

    @model_validator(mode="after")
    def _check_eval(self) -> TrainConfig:
        if self.eval_interval < 0:
            raise ValueError(
                f"eval_interval must be a non-negative int (evaluate every N optimizer steps; 0 = never), "
                f"got {self.eval_interval}"
            )
        if self.eval_steps is not None and self.eval_steps <= 0:
            raise ValueError(
                "eval_steps must be a positive int (micro-batches per evaluation) or absent for the whole "
                f"validation split, got {self.eval_steps}"
            )
        refuse_eval_without_validation_set(self)
        return self

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
    "compile": CompileConfig,
    "float8": Float8Config,
    "mfu": MfuConfig,
    "recovery": RecoveryConfig,
}
