"""W&B (offline mode) and MLflow (local store) trackers in a real training run with a restart: the
history read back equals metrics.jsonl, one tracker run across the restart, config and summary logged."""

from __future__ import annotations

import json
import time

import pytest

from lmforge.config import validate_section
from lmforge.errors import ConfigError
from lmforge.train.callbacks import read_metrics
from lmforge.train.callbacks.trackers import RUNS_FILE, MlflowCallback, WandbCallback, step_scalars

pytestmark = pytest.mark.slow


def _train_with_restart(tmp_path, monitor):
    from train.conftest import tiny_config, tiny_trainer

    ckpt = {"save_interleaved_steps": 2, "save_max": 10}
    tiny_trainer(tiny_config(tmp_path, training={"steps": 4}, checkpoint=ckpt, monitor=monitor)).fit()
    first = json.loads((tmp_path / "run" / RUNS_FILE).read_text())
    ckpt["load_path"] = str(tmp_path / "ckpt")
    # W&B names an offline run's directory by its start second and run id: a restart within the same
    # second (a tiny run on an idle machine) would share the first start's directory.
    time.sleep(1.1)
    tiny_trainer(tiny_config(tmp_path, training={"steps": 6}, checkpoint=ckpt, monitor=monitor)).fit()
    second = json.loads((tmp_path / "run" / RUNS_FILE).read_text())
    assert first == second  # the restart continued the same tracker run
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    return second, records


def _assert_same_history(history: dict[int, dict[str, float]], records):
    assert sorted(history) == [r["step"] for r in records]
    for r in records:
        expected = step_scalars(r)
        assert {"loss", "lr", "grad_norm", "step_time", "tokens_per_s"} <= expected.keys()
        assert history[r["step"]] == expected, r["step"]


def test_wandb_offline_history_matches_metrics_jsonl_across_a_restart(tmp_path, monkeypatch, wandb_records):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monitor = {"wandb": {"enable": True, "offline": True, "project": "tests", "tags": ["tiny", "ci"]}}
    runs, records = _train_with_restart(tmp_path, monitor)
    run_files = sorted((tmp_path / "run" / "wandb").glob(f"offline-run-*-{runs['wandb']}/run-*.wandb"))
    assert len(run_files) == 2  # one per process start, same run id: `wandb sync` merges them
    history: dict[int, dict[str, float]] = {}
    summaries, starts = {}, []
    for file in run_files:
        for rec in wandb_records(file):
            kind = rec.WhichOneof("record_type")
            if kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                step = items.pop("_step")
                history[step] = {k: v for k, v in items.items() if not k.startswith("_")}
            elif kind == "run":
                starts.append(rec.run)
            elif kind == "summary":
                for i in rec.summary.update:
                    summaries[i.key or "/".join(i.nested_key)] = json.loads(i.value_json)
    _assert_same_history(history, records)
    assert {s.run_id for s in starts} == {runs["wandb"]} and all(s.project == "tests" for s in starts)
    assert list(starts[0].tags) == ["tiny", "ci"] and starts[0].display_name == "run"
    config = {u.key: json.loads(u.value_json) for u in starts[-1].config.update}
    assert config["training"]["steps"] == 6
    assert summaries["run/status"] == "completed" and summaries["run/steps"] == "6/6"


def test_mlflow_history_matches_metrics_jsonl_across_a_restart(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monitor = {"mlflow": {"enable": True, "project": "tests", "run_name": "tiny", "tags": {"team": "ci"}}}
    runs, records = _train_with_restart(tmp_path, monitor)
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'run' / 'mlflow.db'}")
    run = client.get_run(runs["mlflow"])
    history: dict[int, dict[str, float]] = {}
    for key in run.data.metrics:
        for m in client.get_metric_history(run.info.run_id, key):
            history.setdefault(m.step, {})[key] = m.value
    _assert_same_history(history, records)
    assert run.info.run_name == "tiny" and run.data.tags["team"] == "ci"
    assert run.info.status == "FINISHED" and run.data.tags["lmforge.status"] == "completed"
    assert json.loads(run.data.params["training.steps"]) == 4  # parameters are immutable: the first start's
    artifacts = {f.path for f in client.list_artifacts(run.info.run_id)}
    assert {"config.json", "config-step-4.json", "summary.json"} <= artifacts


@pytest.mark.parametrize(("cls", "extra"), [(WandbCallback, "wandb"), (MlflowCallback, "mlflow")])
def test_missing_package_names_the_extra(tmp_path, monkeypatch, cls, extra):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == extra else real(name, *a)
    )
    with pytest.raises(ConfigError, match=rf"pip install 'lmforge\[{extra}\]'"):
        cls({"enable": True}, tmp_path)


def test_wandb_online_without_a_login_is_a_clear_error(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR", "WANDB_CONFIG_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc with a W&B key
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    cb = WandbCallback(
        validate_section("monitor.wandb", {"enable": True, "project": "tests"}), tmp_path / "run"
    )
    with pytest.raises(ConfigError, match=r"monitor.wandb: W&B could not start a run: .*offline: true"):
        cb.start(None, {"a": 1}, 0)


def test_output_dir_moves_the_wandb_dir_and_check_lists_the_stores(base_config, monkeypatch):
    from lmforge.config import load_config
    from lmforge.config.outputs import output_locations, with_output_dir

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    base_config["output_dir"] = "out/a"
    base_config["monitor"] = {"wandb": {"enable": True, "dir": "out/a/wb"}, "mlflow": {"enable": True}}
    cfg = with_output_dir(load_config(base_config), "out/b")
    assert cfg.monitor.wandb.dir == "out/b/wb"
    rows = dict(output_locations(cfg))
    assert rows["W&B run files (monitor.wandb)"] == "out/b/wb/wandb"
    assert rows["MLflow store (monitor.mlflow)"].startswith("sqlite:///out/b/mlflow.db")
