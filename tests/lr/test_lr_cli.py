"""``lmforge lr`` on the shipped configs and the spec's example YAMLs."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import yaml

from lmforge.cli import main
from lmforge.lr import build_scheduler

from .helpers import typed

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted((ROOT / "configs").glob("*.yaml"))
SPEC = sorted((ROOT / "tests" / "fixtures" / "spec_yamls").glob("*.yaml"))


def _has_lr_scheduler(path: Path) -> bool:
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    return isinstance(data, dict) and isinstance(data.get("lr_scheduler"), dict)


SPEC_WITH_LR = [p for p in SPEC if _has_lr_scheduler(p)]


def test_every_example_config_draws(tmp_path, capsys):
    configs = [*SHIPPED, *SPEC_WITH_LR]
    assert SHIPPED, "configs/*.yaml should exist"
    argv = ["lr", "-o", str(tmp_path / "all.png")]
    for path in configs:
        argv += ["--config", str(path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "all.png").stat().st_size > 10_000
    for path in configs:
        assert f"{path.stem}: " in out
    assert "warm-up end" in out


@pytest.mark.skipif(not SPEC_WITH_LR, reason="the spec example YAMLs are not there yet")
def test_spec_examples_cover_the_documented_schedulers():
    types = {yaml.safe_load(p.read_text(encoding="utf-8"))["lr_scheduler"]["type"] for p in SPEC_WITH_LR}
    assert {
        "CosineWithWarmUpLR",
        "WarmUpStableDecayLR",
        "CosineAnnealingLR",
        "PolynomialWithWarmUpLR",
    } <= types


def _write_config(directory: Path, name: str, lr_scheduler: dict, steps: int) -> Path:
    path = directory / f"{name}.yaml"
    path.write_text(
        yaml.safe_dump({"training": {"steps": steps}, "lr_scheduler": lr_scheduler}), encoding="utf-8"
    )
    return path


def test_csv_has_every_step_with_exact_values(tmp_path, capsys):
    section = {
        "type": "WarmUpStableDecayLR",
        "learning_rate": 0.001,
        "warmup_steps": 4,
        "decay_start_ratio": 0.5,
    }
    config = _write_config(tmp_path, "wsd", section, 40)
    out_csv = tmp_path / "lr.csv"
    assert main(["lr", "--config", str(config), "-o", str(tmp_path / "lr.png"), "--csv", str(out_csv)]) == 0
    rows = list(csv.reader(out_csv.open()))
    assert rows[0] == ["step", "lr"]
    assert [int(r[0]) for r in rows[1:]] == list(range(41))
    schedule = build_scheduler(typed(section), 40)
    assert [float(r[1]) for r in rows[1:]] == [schedule.lr_at(t) for t in range(41)]
    out = capsys.readouterr().out
    assert "decay start" in out and "only its lr_scheduler and training sections were read" in out


def test_several_configs_give_a_long_csv_and_overrides_apply(tmp_path):
    a = _write_config(tmp_path, "a", {"type": "LinearWithWarmUpLR", "learning_rate": 0.01}, 10)
    b = _write_config(
        tmp_path, "b", {"type": "ConstantWarmUpLR", "learning_rate": 0.02, "warmup_steps": 2}, 10
    )
    out_csv = tmp_path / "both.csv"
    argv = ["lr", "--config", str(a), "--config", str(b), "--set", "training.steps=6"]
    assert main([*argv, "-o", str(tmp_path / "both.png"), "--csv", str(out_csv)]) == 0
    rows = list(csv.reader(out_csv.open()))
    assert rows[0] == ["config", "step", "lr"]
    assert len(rows) == 1 + 2 * 7
    assert rows[1] == ["a", "0", "0.01"] and rows[-1] == ["b", "6", "0.02"]


def test_a_typo_exits_2_with_the_dotted_key(tmp_path, capsys):
    config = _write_config(tmp_path, "typo", {"type": "CosineWithWarmUpLR", "warmup_ration": 0.1}, 10)
    assert main(["lr", "--config", str(config), "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert "lr_scheduler.warmup_ration" in err and "did you mean warmup_ratio?" in err
    assert not (tmp_path / "x.png").exists()


def test_output_without_extension_prints_the_file_it_writes(tmp_path, capsys):
    config = _write_config(tmp_path, "c", {"type": "ConstantWarmUpLR", "learning_rate": 0.01}, 10)
    assert main(["lr", "--config", str(config), "-o", str(tmp_path / "myplot")]) == 0
    out = capsys.readouterr().out
    assert f"plot: {tmp_path / 'myplot.png'}\n" in out
    assert (tmp_path / "myplot.png").stat().st_size > 1000 and not (tmp_path / "myplot").exists()
