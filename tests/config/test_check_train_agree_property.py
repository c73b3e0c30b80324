"""Property: a single-key corruption of the spec's skeleton is accepted by both `lmforge check` and
`train`'s pre-build validation, or refused by both with a message naming the dotted key."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmforge.cli import main
from lmforge.config import load_config
from lmforge.errors import LmforgeError
from lmforge.train.preflight import preflight

ROOT = Path(__file__).resolve().parents[2]
SKELETON = ROOT / "tests" / "fixtures" / "spec_yamls" / "004_skeleton.yaml"
RAW = yaml.safe_load(SKELETON.read_text(encoding="utf-8"))
# The spec's skeleton and two shipped configs (dense AdamW, DeepSeek-V3 with Muon).
BASES = {
    path.name: yaml.safe_load(path.read_text(encoding="utf-8"))
    for path in (SKELETON, ROOT / "configs" / "demo.yaml", ROOT / "configs" / "muon_deepseek_v3.yaml")
}
RENAME = object()  # the corruption that misspells the key itself


def _leaves(node: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    if isinstance(node, dict) and node:
        return [leaf for key, value in node.items() for leaf in _leaves(value, (*prefix, key))]
    return [prefix]


LEAVES = _leaves(RAW)
CASES = [(name, leaf) for name, raw in BASES.items() for leaf in _leaves(raw)]
# No huge numbers: a model of 10**9 layers is valid YAML but takes forever to lay out on meta.
CORRUPTIONS = st.sampled_from([RENAME, None, "x", -1, 0, True, 1.5, 7, [], {}, ["x"]])


def _corrupt(path: tuple[str, ...], bad: Any, base: dict[str, Any] = RAW) -> tuple[dict[str, Any], list[str]]:
    """The corrupted mapping and the dotted keys a refusal may name (a misspelt key: either name)."""
    raw = copy.deepcopy(base)
    node = raw
    for key in path[:-1]:
        node = node[key]
    if bad is RENAME:
        node[path[-1] + "_x"] = node.pop(path[-1])
        return raw, [".".join((*path[:-1], path[-1] + "_x")), ".".join(path)]
    node[path[-1]] = bad
    return raw, [".".join(path)]


def _train_prebuild(raw: dict[str, Any]) -> str | None:
    """What `lmforge train` runs before it builds anything (build_trainer's first step)."""
    try:
        preflight(load_config(raw), 1)
    except LmforgeError as exc:
        return str(exc)
    return None


def test_the_skeleton_itself_is_accepted_by_both(capsys: Any) -> None:
    assert _train_prebuild(copy.deepcopy(RAW)) is None
    assert main(["check", "--config", str(SKELETON)]) == 0, capsys.readouterr().err


@pytest.mark.slow
@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=st.sampled_from(CASES), bad=CORRUPTIONS)
def test_single_key_corruption_check_and_train_agree(
    case: tuple[str, tuple[str, ...]], bad: Any, tmp_path: Path, capsys: Any
) -> None:
    base, path = case
    raw, names = _corrupt(path, bad, BASES[base])
    train_error = _train_prebuild(raw)
    file = tmp_path / "corrupt.yaml"
    file.write_text(yaml.safe_dump(raw), encoding="utf-8")
    capsys.readouterr()
    status = main(["check", "--config", str(file)])
    check_error = capsys.readouterr().err
    assert (status == 0) == (train_error is None), (names, bad, train_error, check_error)
    if train_error is not None:
        assert status == 2
        assert any(name in train_error for name in names), (names, bad, train_error)
        assert any(name in check_error for name in names), (names, bad, check_error)
