"""The ``train.yaml`` configuration: schema, loading, overrides and dumping.

``load_config(path_or_dict, overrides=None) -> TrainConfig`` is the entry point; ``TrainConfig`` and
every section are frozen pydantic models with ``to_dict()``; ``dump_yaml(cfg, path=None)`` writes
the resolved configuration back to YAML. This package imports nothing else from lmforge except
errors and logging.
"""

from lmforge.config.layer_spec import expand_layer_specs, parse_layer_spec, parse_layer_specs
from lmforge.config.load import (
    apply_overrides,
    config_warnings,
    dump_yaml,
    load_config,
    read_raw,
    validate_config,
    validate_section,
)
from lmforge.config.schema import (
    SECTION_CLASSES,
    CallbackConfig,
    CheckpointConfig,
    ConfigNode,
    ContextConfig,
    DataloaderConfig,
    HealthCheckpointConfig,
    LoraConfig,
    LrSchedulerConfig,
    ModelConfig,
    MoeMonitorConfig,
    MonitorConfig,
    OptimizerConfig,
    ParallelismConfig,
    ProfilerConfig,
    RecomputeCommConfig,
    RecomputeConfig,
    SwapConfig,
    TensorboardConfig,
    TrainConfig,
    TrainDatasetConfig,
    TrainingConfig,
    TrainStateConfig,
)

__all__ = [
    "SECTION_CLASSES",
    "CallbackConfig",
    "CheckpointConfig",
    "ConfigNode",
    "ContextConfig",
    "DataloaderConfig",
    "HealthCheckpointConfig",
    "LoraConfig",
    "LrSchedulerConfig",
    "ModelConfig",
    "MoeMonitorConfig",
    "MonitorConfig",
    "OptimizerConfig",
    "ParallelismConfig",
    "ProfilerConfig",
    "RecomputeCommConfig",
    "RecomputeConfig",
    "SwapConfig",
    "TensorboardConfig",
    "TrainConfig",
    "TrainDatasetConfig",
    "TrainStateConfig",
    "TrainingConfig",
    "apply_overrides",
    "config_warnings",
    "dump_yaml",
    "expand_layer_specs",
    "load_config",
    "parse_layer_spec",
    "parse_layer_specs",
    "read_raw",
    "validate_config",
    "validate_section",
]
