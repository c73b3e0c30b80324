"""pyproject.toml's license is the SPDX expression string of PEP 639 (setuptools deprecates the table
form), and the build requires a setuptools that understands it."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
tomllib = pytest.importorskip("tomllib")


def test_license_is_an_spdx_string_and_setuptools_floor_supports_it():
    data = tomllib.loads(PYPROJECT.read_text())
    assert data["project"]["license"] == "Apache-2.0"
    (setuptools_req,) = [r for r in data["build-system"]["requires"] if r.startswith("setuptools")]
    floor = re.fullmatch(r"setuptools>=(\d+)(?:\.\d+)*", setuptools_req)
    assert floor and int(floor.group(1)) >= 77, setuptools_req  # 77.0: PEP 639 license expressions


def test_setuptools_reads_it_without_a_deprecation_warning(monkeypatch):
    pyprojecttoml = pytest.importorskip("setuptools.config.pyprojecttoml")
    from setuptools.dist import Distribution

    monkeypatch.chdir(PYPROJECT.parent)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = pyprojecttoml.apply_configuration(Distribution(), PYPROJECT)
    assert dist.metadata.license_expression == "Apache-2.0"
    assert not [w for w in caught if "license" in str(w.message).lower()]
