"""Trackers read their own environment variables as their users expect, the YAML wins where both are
set, and a tracker that could not start is refused before anything is built."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lmforge.config import validate_section
from lmforge.config.sections_trackers import MlflowConfig, WandbConfig
from lmforge.errors import ConfigError
from lmforge.train.callbacks.tracker_settings import (
    check_trackers,
    mlflow_settings,
    wandb_has_credentials,
    wandb_settings,
)

REPO = Path(__file__).resolve().parents[3]
WANDB_ENV = {
    "WANDB_PROJECT": "env-project",
    "WANDB_ENTITY": "env-team",
    "WANDB_NAME": "env-run",
    "WANDB_TAGS": "a, b",
    "WANDB_MODE": "offline",
    "WANDB_DIR": "/env/wandb",
}


def test_wandb_variables_fill_what_the_yaml_leaves_unset(tmp_path):
    s = wandb_settings(WandbConfig(enable=True), tmp_path / "run", WANDB_ENV)
    assert (s.project, s.entity, s.name, s.tags, s.mode, s.dir) == (
        "env-project",
        "env-team",
        "env-run",
        ["a", "b"],
        "offline",
        "/env/wandb",
    )


def test_wandb_yaml_wins_over_the_variables(tmp_path):
    section = WandbConfig(
        enable=True, project="p", entity="e", run_name="r", tags=["t"], offline=False, dir="d"
    )
    s = wandb_settings(section, tmp_path / "run", WANDB_ENV)
    assert (s.project, s.entity, s.name, s.tags, s.mode, s.dir) == ("p", "e", "r", ["t"], "online", "d")


def test_wandb_defaults_without_either(tmp_path):
    s = wandb_settings(WandbConfig(enable=True), tmp_path / "run", {})
    assert (s.project, s.entity, s.name, s.tags, s.mode, s.dir) == (
        "lmforge",
        None,
        "run",
        None,
        "online",
        str(tmp_path / "run"),
    )


def test_an_unknown_wandb_mode_names_the_variable(tmp_path):
    with pytest.raises(ConfigError, match="WANDB_MODE='ofline'"):
        wandb_settings(WandbConfig(enable=True), tmp_path, {"WANDB_MODE": "ofline"})


def test_mlflow_variables_and_yaml(tmp_path):
    env = {"MLFLOW_TRACKING_URI": "http://tracking:5000", "MLFLOW_EXPERIMENT_NAME": "env-exp"}
    s = mlflow_settings(MlflowConfig(enable=True), tmp_path / "run", env)
    assert (s.tracking_uri, s.experiment_name) == ("http://tracking:5000", "env-exp")
    s = mlflow_settings(MlflowConfig(enable=True, tracking_uri="sqlite:///x.db", project="p"), tmp_path, env)
    assert (s.tracking_uri, s.experiment_name) == ("sqlite:///x.db", "p")
    s = mlflow_settings(MlflowConfig(enable=True), tmp_path / "run", {"MLFLOW_EXPERIMENT_ID": "7"})
    assert (s.experiment_name, s.experiment_id) == (None, "7")
    assert s.tracking_uri == f"sqlite:///{(tmp_path / 'run' / 'mlflow.db').resolve()}"


def test_wandb_credentials_from_env_or_netrc(tmp_path):
    assert wandb_has_credentials({"WANDB_API_KEY": "k"})
    netrc = tmp_path / "netrc"
    assert not wandb_has_credentials({"NETRC": str(netrc)})  # no file
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "x" * 40 + "\n")
    netrc.chmod(0o600)
    assert wandb_has_credentials({"NETRC": str(netrc)})
    assert not wandb_has_credentials({"NETRC": str(netrc), "WANDB_BASE_URL": "https://wandb.example.com"})


def test_online_wandb_without_a_login_is_refused_offline_is_not(base_config, tmp_path):
    pytest.importorskip("wandb")
    from lmforge.config import load_config

    base_config["monitor"] = {"wandb": {"enable": True}}
    monitor = load_config(base_config).monitor
    no_login = {"NETRC": str(tmp_path / "none")}
    with pytest.raises(ConfigError, match=r"monitor.wandb: W&B would run online \(the default\)"):
        check_trackers(monitor, tmp_path, no_login)
    check_trackers(monitor, tmp_path, {**no_login, "WANDB_MODE": "offline"})


@pytest.mark.slow
def test_wandb_run_started_from_the_variables(tmp_path, monkeypatch):
    """A real (offline) W&B run: its project and files follow WANDB_PROJECT and WANDB_DIR."""
    pytest.importorskip("wandb")
    from lmforge.train.callbacks.trackers import WandbCallback

    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_PROJECT", "from-env")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    cb = WandbCallback(validate_section("monitor.wandb", {"enable": True}), tmp_path / "run")
    run_id = cb.start(None, {"a": 1}, 0)
    try:
        assert cb.run.project == "from-env"
        assert list((tmp_path / "wb" / "wandb").glob(f"offline-run-*-{run_id}"))
        assert not (tmp_path / "run" / "wandb").exists()
    finally:
        cb.close()


def _cli(tmp_path: Path, command: str, config: dict, env: dict[str, str]) -> subprocess.CompletedProcess:
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(config))
    full = {**os.environ, "PYTHONPATH": str(REPO / "src"), **env}
    for var in ("WANDB_API_KEY", "WANDB_MODE", "MLFLOW_TRACKING_URI"):
        if var not in env:
            full.pop(var, None)
    return subprocess.run(
        [sys.executable, "-m", "lmforge", command, "--config", str(path)],
        capture_output=True,
        text=True,
        env=full,
        timeout=300,
        cwd=tmp_path,
    )


@pytest.mark.slow
def test_check_and_train_refuse_a_tracker_that_cannot_start_before_building(tmp_path, monkeypatch, capsys):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    from lmforge.cli import main
    from train.test_train_cli import ADAMW, write_config

    config = yaml.safe_load(Path(write_config(tmp_path, ADAMW, steps=2)).read_text())
    config["monitor"] = {"wandb": {"enable": True}}
    path = tmp_path / "wandb.yaml"
    path.write_text(yaml.safe_dump(config))
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    for command in ("check", "train"):
        assert main([command, "--config", str(path)]) == 2
        err = capsys.readouterr().err
        assert "monitor.wandb: W&B would run online (the default)" in err
    assert not (tmp_path / "run").exists()  # train stopped before creating anything
    # The variable is honoured: offline, `check` accepts the same file.
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert main(["check", "--config", str(path)]) == 0
    # An MLflow server that is not there: `train` refuses before the model is built.
    config["monitor"] = {"mlflow": {"enable": True}}
    proc = _cli(tmp_path, "train", config, {"MLFLOW_TRACKING_URI": "http://127.0.0.1:9"})
    assert proc.returncode == 2, proc.stderr
    assert "monitor.mlflow: the MLflow tracking store http://127.0.0.1:9 cannot be used" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "run" / "train.log").exists()
