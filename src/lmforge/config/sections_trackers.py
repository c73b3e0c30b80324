"""``monitor.wandb`` and ``monitor.mlflow``: experiment trackers (lmforge extension keys).

Off unless ``enable: true``; the packages are optional extras (``lmforge[wandb]``, ``lmforge[mlflow]``).
See docs/observability.md.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from lmforge.config.base import Section, check_positive


def _check_tags(tags: Any, path: str) -> None:
    ok = (isinstance(tags, list) and all(isinstance(t, str) for t in tags)) or (
        isinstance(tags, dict) and all(isinstance(k, str) for k in tags)
    )
    if not ok:
        raise ValueError(f"{path} must be a list of strings or a mapping of name: value, got {tags!r}")


class WandbConfig(Section):
    enable: bool = False
    project: str = "lmforge"
    entity: str = ""  # team or user; empty: the account's default
    run_name: str = ""  # empty: the name of output_dir
    tags: list[str] | dict[str, Any] = Field(default_factory=list)
    offline: bool = False  # W&B's offline mode: written under dir, uploaded later with `wandb sync`
    dir: str = ""  # empty: output_dir
    log_interval: int = 1

    @model_validator(mode="after")
    def _check(self) -> WandbConfig:
        _check_tags(self.tags, "monitor.wandb.tags")
        check_positive(self.log_interval, "monitor.wandb.log_interval")
        if self.enable and not self.project:
            raise ValueError(
                "monitor.wandb.project must name a W&B project when monitor.wandb.enable is true"
            )
        return self


class MlflowConfig(Section):
    enable: bool = False
    tracking_uri: str = ""  # empty: $MLFLOW_TRACKING_URI, else a file store in <output_dir>/mlruns
    project: str = "lmforge"  # the MLflow experiment
    run_name: str = ""  # empty: the name of output_dir
    tags: list[str] | dict[str, Any] = Field(default_factory=list)
    log_interval: int = 1

    @model_validator(mode="after")
    def _check(self) -> MlflowConfig:
        _check_tags(self.tags, "monitor.mlflow.tags")
        check_positive(self.log_interval, "monitor.mlflow.log_interval")
        if self.enable and not self.project:
            raise ValueError(
                "monitor.mlflow.project must name an MLflow experiment when monitor.mlflow.enable is true"
            )
        return self
