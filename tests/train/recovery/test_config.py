"""The ``recovery:`` section: typed and validated at load, refused with what it needs before anything is
built, printed by ``lmforge check``."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lmforge.cli import main
from lmforge.config import load_config
from lmforge.errors import ConfigError
from lmforge.train.recovery import check_recovery

from ..conftest import tiny_config

REPO = Path(__file__).resolve().parents[3]


def test_defaults_and_values(tmp_path):
    cfg = tiny_config(tmp_path)
    r = cfg.recovery
    assert (r.enable, r.max_rollbacks, r.data, r.lr_scale, r.lr_scale_steps) == (False, 3, "skip", 1.0, 0)
    assert r.snapshot_interval == 0
    cfg = tiny_config(
        tmp_path, recovery={"enable": True, "data": "replay", "lr_scale": "5e-1", "lr_scale_steps": 20}
    )
    assert (cfg.recovery.data, cfg.recovery.lr_scale) == ("replay", 0.5)


@pytest.mark.parametrize(
    "values,message",
    [
        ({"data": "redo"}, "recovery.data must be one of 'skip', 'replay'; got 'redo'"),
        ({"max_rollbacks": 0}, "recovery.max_rollbacks must be an int >= 1"),
        ({"lr_scale": 0.0}, "recovery.lr_scale must be in (0, 1]"),
        ({"lr_scale": 2.0}, "recovery.lr_scale must be in (0, 1]"),
        ({"lr_scale": 0.5}, "recovery.lr_scale is 0.5 but recovery.lr_scale_steps is 0"),
        ({"lr_scale_steps": -1}, "recovery.lr_scale_steps must be a non-negative int"),
        ({"enable": "yes"}, "recovery.enable"),
        ({"snapshot_every": 5}, "recovery.snapshot_every"),
        ({"snapshot_interval": -1}, "recovery.snapshot_interval must be a non-negative int"),
    ],
)
def test_bad_values_are_refused_at_load_naming_the_key(tmp_path, values, message):
    with pytest.raises(ConfigError) as info:
        tiny_config(tmp_path, recovery=values)
    assert message in str(info.value)


@pytest.mark.parametrize(
    "checkpoint,message",
    [
        ({"enable_save": False}, "checkpoint.enable_save is false"),
        ({"no_save_optim": True}, "checkpoint.no_save_optim is true"),
    ],
)
def test_what_recovery_needs_is_checked_before_anything_is_built(tmp_path, checkpoint, message):
    cfg = tiny_config(tmp_path, recovery={"enable": True}, checkpoint=checkpoint)
    with pytest.raises(ConfigError, match=message):
        check_recovery(
            cfg
        )  # one of preflight's checks (test_check_prints... runs it through `lmforge check`)
    check_recovery(tiny_config(tmp_path, checkpoint=checkpoint))  # recovery off: fine


@pytest.mark.slow
def test_check_prints_the_section_and_refuses_a_bad_one(tmp_path, capsys):
    raw = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    raw["recovery"] = {"enable": True, "data": "replay"}
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["check", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "recovery.data: replay  [file]" in out and "recovery.max_rollbacks: 3  [default]" in out
    raw["checkpoint"]["enable_save"] = False
    path.write_text(yaml.safe_dump(raw))
    assert main(["check", "--config", str(path)]) == 2
    assert "recovery.enable: true rolls back to a checkpoint" in capsys.readouterr().err
    assert load_config(raw).recovery.enable
