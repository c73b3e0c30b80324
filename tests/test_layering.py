"""Imports point downward only (DESIGN.md §3): cli → train → tools → parallel → models | data | optim | lr →
config → utils, and the four building blocks never import each other. Read from the source, so an
import inside a function counts too."""

from __future__ import annotations

import ast
from pathlib import Path

import lmforge

RANK = {
    "cli": 5,
    "train": 4,
    "parallel": 3,
    "models": 2,
    "data": 2,
    "optim": 2,
    "lr": 2,
    "config": 1,
    "utils": 0,
}
BUILDING_BLOCKS = 2


def _imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
    return found


def upward_imports(root: Path) -> list[str]:
    """``file: layer imports module`` for every import of a layer above, or of another building block."""
    bad = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        layer = parts[0] if len(parts) > 1 else None
        if layer not in RANK:
            continue
        for module in _imports(path):
            names = module.split(".")
            if names[0] != "lmforge" or len(names) < 2 or names[1] not in RANK or names[1] == layer:
                continue
            target = names[1]
            sideways = RANK[target] == RANK[layer] == BUILDING_BLOCKS
            if RANK[target] > RANK[layer] or sideways:
                bad.append(f"{path.relative_to(root)}: {layer} imports {module}")
    return bad


def test_imports_point_downward_only():
    assert upward_imports(Path(lmforge.__file__).parent) == []


def test_the_check_sees_an_upward_and_a_sideways_import(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "x.py").write_text("def f():\n    from lmforge.cli import malloc\n")
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "y.py").write_text("from lmforge.data.tokenizer import load_tokenizer\n")
    (tmp_path / "utils").mkdir()
    (tmp_path / "utils" / "z.py").write_text("from lmforge.errors import ConfigError\n")
    assert upward_imports(tmp_path) == [
        "models/y.py: models imports lmforge.data.tokenizer",
        "train/x.py: train imports lmforge.cli",
    ]


# Compatibility with lmforge's own earlier checkpoint formats (removed in lmforge 0.3) is reached from
# these places only: one call that detects and names the older formats, one fallback for pickled skeletons.
COMPAT = "lmforge.train.checkpoint.compat"
COMPAT_ENTRIES = ["train/checkpoint/load.py", "train/checkpoint/safe_load.py"]


def compat_importers(root: Path) -> list[str]:
    """Modules outside the compat package that import it."""
    inside = root / COMPAT.split(".", 1)[1].replace(".", "/")
    return sorted(
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if inside not in path.parents
        and any(m == COMPAT or m.startswith(COMPAT + ".") for m in _imports(path))
    )


def test_compatibility_with_older_checkpoints_is_reached_from_the_load_path_only():
    assert compat_importers(Path(lmforge.__file__).parent) == COMPAT_ENTRIES


def test_the_compat_package_states_its_removal_version():
    from lmforge.train.checkpoint import compat

    assert "Removed in lmforge 0.3" in compat.__doc__ and compat.REMOVED_IN == "0.3"
