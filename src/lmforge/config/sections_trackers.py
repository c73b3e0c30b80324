"""``monitor.wandb`` and ``monitor.mlflow``: experiment trackers (lmforge extension keys).

Off unless ``enable: true``; the packages are optional extras (``lmforge[wandb]``, ``lmforge[mlflow]``).
A key left unset (``null``, the default) takes the tracker's own environment variable, as its users
expect (``WANDB_PROJECT``, ``WANDB_MODE``, ``MLFLOW_TRACKING_URI``, ...), else lmforge's default; a key
set in the YAML wins over the variable (lmforge.train.callbacks.trackers resolves them). See
docs/observability.md.
"""

from __future__ import annotations

from typing import Any

from pydantic import model_validator

from lmforge.config.base import Section, check_positive


def _check_tags(tags: Any, path: str) -> None:
    ok = (isinstance(tags, list) and all(isinstance(t, str) for t in tags)) or (
        isinstance(tags, dict) and all(isinstance(k, str) for k in tags)
    )
    if not ok:
        raise ValueError(f"{path} must be a list of strings or a mapping of name: value, got {tags!r}")


class WandbConfig(Section):
    # null (or "", as older dumps write it): the environment variable named, else the default after it
    # (lmforge.train.callbacks.trackers resolves them).
    enable: bool = False
    project: str | None = None  # $WANDB_PROJECT, else "lmforge"
    entity: str | None = None  # $WANDB_ENTITY, else the account's default team or user
    run_name: str | None = None  # $WANDB_NAME, else the name of output_dir
    tags: list[str] | dict[str, Any] | None = None  # $WANDB_TAGS (comma-separated), else none
    offline: bool | None = None  # $WANDB_MODE (online, offline, disabled), else online
    dir: str | None = None  # $WANDB_DIR, else output_dir
    log_interval: int = 1

    @model_validator(mode="after")
    def _check(self) -> WandbConfig:
        if self.tags is not None:
            _check_tags(self.tags, "monitor.wandb.tags")
        check_positive(self.log_interval, "monitor.wandb.log_interval")
        return self


class MlflowConfig(Section):
    enable: bool = False
    tracking_uri: str | None = None  # $MLFLOW_TRACKING_URI, else sqlite:///<output_dir>/mlflow.db
    project: str | None = None  # the experiment: $MLFLOW_EXPERIMENT_NAME / _ID, else "lmforge"
    run_name: str | None = None  # the name of output_dir
    tags: list[str] | dict[str, Any] | None = None
    log_interval: int = 1

    @model_validator(mode="after")
    def _check(self) -> MlflowConfig:
        if self.tags is not None:
            _check_tags(self.tags, "monitor.mlflow.tags")
        check_positive(self.log_interval, "monitor.mlflow.log_interval")
        return self
