"""What a tracker run is started with: the YAML's ``monitor.wandb`` / ``monitor.mlflow`` keys, else
the tracker's own environment variables (as its users set them), else lmforge's defaults — and the
checks that refuse a tracker that could not start, before anything is built.

W&B: ``WANDB_PROJECT``, ``WANDB_ENTITY``, ``WANDB_NAME``, ``WANDB_TAGS``, ``WANDB_MODE``, ``WANDB_DIR``;
the variables lmforge passes nothing for (``WANDB_API_KEY``, ``WANDB_BASE_URL``, ``WANDB_RUN_GROUP``,
``WANDB_NOTES``, ...) reach W&B untouched. MLflow: ``MLFLOW_TRACKING_URI``, ``MLFLOW_EXPERIMENT_NAME``,
``MLFLOW_EXPERIMENT_ID``.
"""

from __future__ import annotations

import importlib.util
import netrc
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from lmforge.config.sections_trackers import MlflowConfig, WandbConfig
from lmforge.errors import ConfigError

# WANDB_MODE's values (W&B's own aliases: dryrun = offline, run = online).
WANDB_MODES = {
    "online": "online",
    "run": "online",
    "offline": "offline",
    "dryrun": "offline",
    "disabled": "disabled",
}
DEFAULT_PROJECT = "lmforge"
WANDB_HOST = "https://api.wandb.ai"


def _given(value: Any) -> bool:
    return value is not None and value != ""  # "" is how older dumps of the config wrote "unset"


@dataclass(frozen=True)
class WandbSettings:
    project: str
    entity: str | None
    name: str
    tags: list[str] | None
    mode: str  # online, offline or disabled
    dir: str
    mode_from: str  # where the mode came from, for messages


@dataclass(frozen=True)
class MlflowSettings:
    tracking_uri: str
    experiment_name: str | None  # None: experiment_id names it
    experiment_id: str | None
    run_name: str


def wandb_settings(
    section: WandbConfig, output_dir: str | os.PathLike, env: Mapping[str, str] = os.environ
) -> WandbSettings:
    """``monitor.wandb`` resolved: the YAML's value, else the W&B variable, else the default."""
    if section.offline is not None:
        mode, mode_from = ("offline" if section.offline else "online"), "monitor.wandb.offline"
    elif env.get("WANDB_MODE"):
        raw = env["WANDB_MODE"].strip().lower()
        if raw not in WANDB_MODES:
            raise ConfigError(
                f"WANDB_MODE={env['WANDB_MODE']!r} is not a W&B mode; use one of {', '.join(sorted(WANDB_MODES))}, "
                "or set monitor.wandb.offline in the YAML (it wins over the variable)."
            )
        mode, mode_from = WANDB_MODES[raw], "WANDB_MODE"
    else:
        mode, mode_from = "online", "the default"
    if section.tags:  # [] is how older dumps wrote "unset"
        tags = _tag_list(section.tags)
    elif env.get("WANDB_TAGS"):
        tags = [t.strip() for t in env["WANDB_TAGS"].split(",") if t.strip()]
    else:
        tags = None
    return WandbSettings(
        project=_first(section.project, env.get("WANDB_PROJECT"), DEFAULT_PROJECT),
        entity=_first(section.entity, env.get("WANDB_ENTITY"), None),
        name=_first(section.run_name, env.get("WANDB_NAME"), Path(output_dir).resolve().name),
        tags=tags,
        mode=mode,
        dir=_first(section.dir, env.get("WANDB_DIR"), os.fspath(output_dir)),
        mode_from=mode_from,
    )


def mlflow_settings(
    section: MlflowConfig, output_dir: str | os.PathLike, env: Mapping[str, str] = os.environ
) -> MlflowSettings:
    """``monitor.mlflow`` resolved: the YAML's value, else the MLflow variable, else the default."""
    default_uri = f"sqlite:///{(Path(output_dir) / 'mlflow.db').resolve()}"  # MLflow's advised local store
    experiment_id = None
    if _given(section.project):
        name = section.project
    elif env.get("MLFLOW_EXPERIMENT_NAME"):
        name = env["MLFLOW_EXPERIMENT_NAME"]
    elif env.get("MLFLOW_EXPERIMENT_ID"):
        name, experiment_id = None, env["MLFLOW_EXPERIMENT_ID"]
    else:
        name = DEFAULT_PROJECT
    return MlflowSettings(
        tracking_uri=_first(section.tracking_uri, env.get("MLFLOW_TRACKING_URI"), default_uri),
        experiment_name=name,
        experiment_id=experiment_id,
        run_name=_first(section.run_name, None, Path(output_dir).resolve().name),
    )


def _first(*values: Any) -> Any:
    for value in values[:-1]:
        if _given(value):
            return value
    return values[-1]


def _tag_list(tags: list | dict) -> list[str]:
    return list(tags) if isinstance(tags, list) else [f"{k}:{v}" for k, v in tags.items()]


def require_package(module: str, extra: str, key: str) -> None:
    """A ConfigError naming the extra to install when ``module`` cannot be imported."""
    if importlib.util.find_spec(module) is None:
        raise ConfigError(
            f"{key} is true but the '{module}' package is not installed; install it with "
            f"pip install 'lmforge[{extra}]' (or set {key}: false)."
        )


def wandb_has_credentials(env: Mapping[str, str] = os.environ) -> bool:
    """Whether W&B will find an API key for its host without asking: ``WANDB_API_KEY``, an identity
    token file, or the netrc entry ``wandb login`` writes (``$NETRC`` or ``~/.netrc``)."""
    if env.get("WANDB_API_KEY") or env.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlsplit(env.get("WANDB_BASE_URL") or WANDB_HOST).netloc
    path = env.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def check_trackers(monitor: Any, output_dir: str | os.PathLike, env: Mapping[str, str] = os.environ) -> None:
    """Every reason an enabled tracker could not start that is known without the network: the package,
    the settings (the YAML's and the variables'), W&B's login for an online run. A ConfigError names
    the key or variable; ``lmforge check`` and ``lmforge train`` call it before building anything."""
    if monitor.wandb.enable:
        require_package("wandb", "wandb", "monitor.wandb.enable")
        settings = wandb_settings(monitor.wandb, output_dir, env)
        if settings.mode == "online" and not wandb_has_credentials(env):
            raise ConfigError(
                f"monitor.wandb: W&B would run online ({settings.mode_from}) but no API key is set up: log in "
                "with `wandb login` (or set WANDB_API_KEY), or run offline with WANDB_MODE=offline or "
                "monitor.wandb.offline: true and upload later with `wandb sync`."
            )
    if monitor.mlflow.enable:
        require_package("mlflow", "mlflow", "monitor.mlflow.enable")
        require_package("sqlalchemy", "mlflow", "monitor.mlflow.enable")
        mlflow_settings(monitor.mlflow, output_dir, env)


def open_tracker_stores(
    monitor: Any, output_dir: str | os.PathLike, env: Mapping[str, str] = os.environ
) -> None:
    """What needs the tracker's store, on the rank that logs, before the model is built: an MLflow
    tracking store that cannot be reached or opened is a ConfigError now rather than after the model
    and data are built. (W&B's server is reached only when its run starts.)"""
    if not monitor.mlflow.enable:
        return
    from mlflow import MlflowClient

    settings = mlflow_settings(monitor.mlflow, output_dir, env)
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    # One quick attempt: MLflow's default (7 retries with back-off) would wait minutes for a server
    # that is not there. The user's own settings of these variables are kept.
    quick = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}
    added = {k: v for k, v in quick.items() if k not in os.environ}
    os.environ.update(added)
    try:
        MlflowClient(tracking_uri=settings.tracking_uri).search_experiments(max_results=1)
    except Exception as exc:  # MLflow's own errors (unreachable server, unreadable store)
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise ConfigError(
            f"monitor.mlflow: the MLflow tracking store {settings.tracking_uri} cannot be used ({first}). Set "
            "monitor.mlflow.tracking_uri (or MLFLOW_TRACKING_URI) to a reachable server or a local sqlite:/// "
            "path, or set monitor.mlflow.enable: false."
        ) from None
    finally:
        for key in added:
            os.environ.pop(key, None)
