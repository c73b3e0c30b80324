"""Experiment trackers: Weights & Biases (``monitor.wandb``) and MLflow (``monitor.mlflow``).

Each logs, from rank 0 only (the rank that writes metrics.jsonl): the resolved config once at the
start, every numeric field of each step's metrics record (the record metrics.jsonl gets: loss, lr,
grad_norm, step_time, tokens_per_s, ..., val_loss / val_ppl on evaluation steps) against the step
every ``log_interval`` steps (evaluation steps always), and the run summary (``summary.json``'s
fields) at the end. The run id is kept in ``<output_dir>/tracker_runs.json``; a run that resumes
from a checkpoint (global step > 0 at the start) continues the same tracker run. The packages are
optional extras: a missing one is a ConfigError naming the extra, raised when the trainer is built.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from lmforge.config.schema import TrainConfig
from lmforge.config.sections_run import MonitorConfig
from lmforge.config.sections_trackers import MlflowConfig, WandbConfig
from lmforge.errors import ConfigError
from lmforge.train.callbacks.base import TrainerCallback, logger
from lmforge.train.callbacks.tracker_settings import (
    mlflow_settings,
    require_package,
    wandb_settings,
)

RUNS_FILE = "tracker_runs.json"


def step_scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The numeric, finite fields of a metrics record (``step`` is the x axis, not a scalar)."""
    out = {}
    for key, value in metrics.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(value):
            out[key] = float(value)
    return out


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def _tag_dict(tags: list | dict) -> dict[str, str]:
    return {t: "true" for t in tags} if isinstance(tags, list) else {k: str(v) for k, v in tags.items()}


class TrackerCallback(TrainerCallback):
    """The shared part: rank 0, run-id bookkeeping, what is logged when. Subclasses talk to a library."""

    order = 85  # after every callback that adds to the step's metrics; before metrics.jsonl (90)
    name = ""  # the key under monitor and in tracker_runs.json
    module = ""  # the package to import

    def __init__(self, section: WandbConfig | MlflowConfig, output_dir: str | os.PathLike) -> None:
        self.cfg = section
        require_package(self.module, self.name, f"monitor.{self.name}.enable")
        self.output_dir = Path(output_dir)
        self.log_interval = self.cfg.log_interval
        self.active = False
        self.run_id: str | None = None

    # -- what subclasses provide
    def start(self, resume_id: str | None, config: dict[str, Any], step: int) -> str: ...
    def log(self, scalars: dict[str, float], step: int) -> None: ...
    def finish(self, summary: dict[str, Any]) -> None: ...
    def close(self) -> None: ...

    # -- hooks
    def on_train_begin(self, args: Any, state: Any, **kwargs: Any) -> None:
        trainer = kwargs.get("trainer")
        if trainer is not None and trainer.ctx.rank != 0:
            return
        runs_file = self.output_dir / RUNS_FILE
        runs = json.loads(runs_file.read_text()) if runs_file.is_file() else {}
        step = int(getattr(state, "global_step", 0))
        resume_id = runs.get(self.name) if step > 0 else None
        config = args.to_dict() if hasattr(args, "to_dict") else dict(args or {})
        self.run_id = self.start(resume_id, _jsonable(config), step)
        runs[self.name] = self.run_id
        self.output_dir.mkdir(parents=True, exist_ok=True)
        runs_file.write_text(json.dumps(runs, indent=2) + "\n")
        self.active = True
        logger.info("%s: %s run %s", self.name, "resumed" if resume_id else "started", self.run_id)

    def on_step_end(self, args: Any, state: Any, **kwargs: Any) -> None:
        if not self.active:
            return
        metrics = kwargs.get("metrics") or {}
        step = int(state.global_step)
        evaluated = "val_loss" in metrics or any(k.startswith("lm_eval/") for k in metrics)
        if step % self.log_interval != 0 and not evaluated:
            return
        scalars = step_scalars(metrics)
        if step % self.log_interval != 0:  # an evaluation between logged steps: only its results
            scalars = {k: v for k, v in scalars.items() if k.startswith(("val_", "lm_eval/"))}
        if scalars:
            self.log(scalars, step)

    def on_rollback(self, args: Any, state: Any, **kwargs: Any) -> None:
        # Recovery rolled back (train/recovery/): an event at the detection step, whatever log_interval says.
        if not self.active:
            return
        event = kwargs["rollback"]
        self.log(
            {
                "recovery/rollback_to_step": float(event["to_step"]),
                "recovery/rollbacks": float(event["rollback"]),
            },
            int(event["step"]),
        )

    def on_train_end(self, args: Any, state: Any, **kwargs: Any) -> None:
        if not self.active:
            return
        trainer = kwargs.get("trainer")
        summary = trainer.summary() if trainer is not None and hasattr(trainer, "summary") else {}
        self.finish(_jsonable(summary))
        self.active = False


class WandbCallback(TrackerCallback):
    name, module = "wandb", "wandb"

    def start(self, resume_id: str | None, config: dict[str, Any], step: int) -> str:
        import wandb

        try:
            self.run = self._init(wandb, resume_id, config)
        except Exception as exc:  # W&B's own errors (no API key, no network) as one clear message
            raise ConfigError(
                f"monitor.wandb: W&B could not start a run: {str(exc).rstrip('.')}. Log in first (wandb login, or "
                "WANDB_API_KEY), or set monitor.wandb.offline: true and upload later with wandb sync."
            ) from None
        if resume_id:
            self.run.config.update(config, allow_val_change=True)  # the restart's settings win
        return self.run.id

    def _init(self, wandb: Any, resume_id: str | None, config: dict[str, Any]) -> Any:
        s = wandb_settings(self.cfg, self.output_dir)  # the YAML, else WANDB_* variables, else defaults
        return wandb.init(
            project=s.project,
            entity=s.entity,
            name=s.name,
            tags=s.tags,
            config=config,
            dir=s.dir,
            mode=s.mode,
            id=resume_id,
            resume="allow" if resume_id else None,
            settings=wandb.Settings(silent=True, console="off"),
        )

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def finish(self, summary: dict[str, Any]) -> None:
        self.run.summary.update({f"run/{k}": v for k, v in summary.items()})
        self.run.finish()

    def close(self) -> None:
        self.run.finish()


class MlflowCallback(TrackerCallback):
    name, module = "mlflow", "mlflow"
    _BATCH = 100  # MLflow's limit of params per log_batch call

    def __init__(self, section: MlflowConfig, output_dir: str | os.PathLike) -> None:
        super().__init__(section, output_dir)
        require_package("sqlalchemy", "mlflow", "monitor.mlflow.enable")

    def tracking_uri(self) -> str:
        return mlflow_settings(self.cfg, self.output_dir).tracking_uri

    def start(self, resume_id: str | None, config: dict[str, Any], step: int) -> str:
        from mlflow import MlflowClient
        from mlflow.entities import Param

        self.output_dir.mkdir(parents=True, exist_ok=True)
        settings = mlflow_settings(self.cfg, self.output_dir)  # the YAML, else MLFLOW_* variables
        self.client = MlflowClient(tracking_uri=settings.tracking_uri)
        if resume_id:
            self.client.update_run(resume_id, status="RUNNING")
            run_id = resume_id
            known = self.client.get_run(run_id).data.params
        else:
            exp_id = self._experiment_id(settings)
            run = self.client.create_run(
                exp_id, run_name=settings.run_name, tags=_tag_dict(self.cfg.tags or [])
            )
            run_id, known = run.info.run_id, {}
        # Parameters are immutable in MLflow: a resumed run adds the keys it did not have; the whole
        # resolved config of each start is an artifact (config.json, config-step-N.json on resume).
        params = [Param(k, v) for k, v in _flatten(config).items() if k not in known]
        for i in range(0, len(params), self._BATCH):
            self.client.log_batch(run_id, params=params[i : i + self._BATCH])
        self.client.log_dict(run_id, config, f"config-step-{step}.json" if resume_id else "config.json")
        return run_id

    def _experiment_id(self, settings: Any) -> str:
        if settings.experiment_name is None:  # MLFLOW_EXPERIMENT_ID: an experiment that exists
            try:
                return self.client.get_experiment(settings.experiment_id).experiment_id
            except Exception:
                raise ConfigError(
                    f"MLFLOW_EXPERIMENT_ID={settings.experiment_id!r}: no such experiment in "
                    f"{settings.tracking_uri}; set monitor.mlflow.project to name one (it is created if new)."
                ) from None
        exp = self.client.get_experiment_by_name(settings.experiment_name)
        if exp is not None:
            return exp.experiment_id
        artifacts = (self.output_dir / "mlartifacts").resolve().as_uri()
        return self.client.create_experiment(settings.experiment_name, artifact_location=artifacts)

    def log(self, scalars: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in scalars.items()])

    def finish(self, summary: dict[str, Any]) -> None:
        self.client.log_dict(self.run_id, summary, "summary.json")
        status = str(summary.get("status", "completed"))
        self.client.set_tag(self.run_id, "lmforge.status", status)
        ended = "FINISHED" if status == "completed" else "FAILED" if status.startswith("failed") else "KILLED"
        self.client.set_terminated(self.run_id, status=ended)

    def close(self) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED")


def _flatten(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_flatten(value, f"{name}."))
        else:
            out[name] = json.dumps(value)[:6000]  # MLflow's limit on a parameter value
    return out


def log_to_run_trackers(
    config: TrainConfig, output_dir: str | os.PathLike, scalars: dict[str, float], step: int
) -> list[str]:
    """Log ``scalars`` at ``step`` into the tracker runs of a finished (or running) training run, as
    ``lmforge eval --tasks`` does: the run ids of ``<output_dir>/tracker_runs.json``, else new runs.
    Returns the names of the trackers logged to."""
    monitor = config.monitor
    done = []
    for cb in tracker_callbacks(monitor, output_dir):
        runs_file = Path(output_dir) / RUNS_FILE
        runs = json.loads(runs_file.read_text()) if runs_file.is_file() else {}
        plain = config.to_dict()
        cb.run_id = cb.start(runs.get(cb.name), _jsonable(plain), step)
        if cb.name not in runs:
            runs[cb.name] = cb.run_id
            runs_file.parent.mkdir(parents=True, exist_ok=True)
            runs_file.write_text(json.dumps(runs, indent=2) + "\n")
        cb.log(scalars, step)
        cb.close()
        done.append(cb.name)
    return done


def tracker_callbacks(monitor: MonitorConfig, output_dir: str | os.PathLike) -> list[TrackerCallback]:
    """The enabled trackers of the typed ``monitor`` section (a ConfigError here if a package is missing)."""
    out: list[TrackerCallback] = []
    for cls in (WandbCallback, MlflowCallback):
        section = getattr(monitor, cls.name)
        if section.enable:
            out.append(cls(section, output_dir))
    return out
