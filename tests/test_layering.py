"""Imports point downward only (DESIGN.md §3): cli → train → tools → parallel → models | data | optim | lr →
config → utils, and the four building blocks never import each other. Read from the source, so an
import inside a function counts too."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import lmforge

RANK = {
    "cli": 6,
    "train": 5,
    "tools": 4,
    "parallel": 3,
    "models": 2,
    "data": 2,
    "optim": 2,
    "lr": 2,
    "config": 1,
    "utils": 0,
}
BUILDING_BLOCKS = 2


@functools.cache
def _source(path: Path) -> tuple[str, ast.Module]:
    """A file's text and syntax tree, read once for all the checks of this module."""
    text = path.read_text(encoding="utf-8")
    return text, ast.parse(text)


def _imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(_source(path)[1]):
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
    (tmp_path / "tools").mkdir()  # tools sit below train: the offline doctor must not reach the live one
    (tmp_path / "tools" / "d.py").write_text("from lmforge.train.callbacks import doctor_live\n")
    (tmp_path / "utils").mkdir()
    (tmp_path / "utils" / "z.py").write_text("from lmforge.errors import ConfigError\n")
    assert upward_imports(tmp_path) == [
        "models/y.py: models imports lmforge.data.tokenizer",
        "tools/d.py: tools imports lmforge.train.callbacks",
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
    package = Path(lmforge.__file__).parent / "train" / "checkpoint" / "compat" / "__init__.py"
    assert "Removed in lmforge 0.3." in ast.get_docstring(_source(package)[1])
    assert 'REMOVED_IN = "0.3"' in _source(package)[0]  # the version the load's warning names


MAX_FUNCTION_LINES = 100
MAX_MODULE_LINES = 600


def oversized(root: Path) -> list[str]:
    """``file: name (n lines)`` for every function over 100 lines and every module over 600 lines."""
    bad = []
    for path in sorted(root.rglob("*.py")):
        text, tree = _source(path)
        where = path.relative_to(root)
        if len(text.splitlines()) > MAX_MODULE_LINES:
            bad.append(f"{where}: module ({len(text.splitlines())} lines)")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    bad.append(f"{where}: {node.name} ({lines} lines)")
    return bad


def test_no_function_over_100_lines_and_no_module_over_600():
    assert oversized(Path(lmforge.__file__).parent) == []


def test_the_size_check_sees_a_long_function_and_a_long_module(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES - 1))
    (tmp_path / "ok.py").write_text(f"def f():\n{body}")  # exactly 100 lines
    method = "".join(f"    {line}\n" for line in body.splitlines())
    (tmp_path / "long.py").write_text(f"class C:\n    async def g(self):\n{method}        pass\n")
    (tmp_path / "big.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    assert oversized(tmp_path) == ["big.py: module (601 lines)", "long.py: g (101 lines)"]
