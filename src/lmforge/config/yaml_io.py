"""Reading and writing ``train.yaml``: YAML 1.1 (PyYAML safe loader) with two additions.

* ``1e-8`` is a float. YAML 1.1 reads an exponent without a dot as a string, a trap users of the
  original fell into (its loader then rejected the "string" in a float field); scientific notation
  without a dot is resolved as a float here.
* Mapping nesting deeper than 10 levels is refused before the document is constructed, as in the
  original (sequences do not count).
* Hostile documents are refused before they are constructed: anchors/aliases that expand to more
  than ``MAX_EXPANDED_NODES`` nodes (a "billion laughs" bomb) or refer to themselves, and nesting
  too deep for the parser.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from lmforge.errors import ConfigError

MAX_MAPPING_DEPTH = 10
# A real train.yaml has a few hundred nodes; aliases may repeat a section, not multiply it a million times.
MAX_EXPANDED_NODES = 100_000


class ConfigLoader(yaml.SafeLoader):
    """SafeLoader that reads ``1e-8`` / ``3E5`` as floats and refuses duplicate keys."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        # PyYAML (and the original) silently keep the last of two equal keys, so a setting written
        # twice loses its first value unnoticed. Merge keys (<<) may legitimately be overridden.
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                hash(key)
            except TypeError:
                continue
            if key in first_line:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"found duplicate key {key!r} (first written at line {first_line[key]}); keep only one",
                    key_node.start_mark,
                )
            first_line[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


class ConfigDumper(yaml.SafeDumper):
    """SafeDumper that quotes strings which ConfigLoader would read as floats (``"1e-8"``)."""


_EXPONENT_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")
for _cls in (ConfigLoader, ConfigDumper):
    _cls.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+0123456789"))


def _mapping_depth(node: yaml.Node | None) -> int:
    # Iterative, so that a hostile file cannot exhaust the Python stack before the limit is reached.
    deepest = 0
    stack: list[tuple[yaml.Node, int]] = [(node, 0)] if node is not None else []
    seen: set[int] = set()
    while stack:
        current, depth = stack.pop()
        if id(current) in seen:  # anchors/aliases share nodes
            continue
        seen.add(id(current))
        if isinstance(current, yaml.MappingNode):
            depth += 1
            deepest = max(deepest, depth)
            for key, value in current.value:
                stack.append((key, depth))
                stack.append((value, depth))
        elif isinstance(current, yaml.SequenceNode):
            stack.extend((item, depth) for item in current.value)
    return deepest


def _expanded_size(root: yaml.Node | None, source: str) -> int:
    """Number of nodes the document has once every alias is expanded (iterative, memoised by node)."""
    if root is None:
        return 0
    size: dict[int, int] = {}
    open_nodes: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        children: list[yaml.Node] = []
        if isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        if children_done:
            open_nodes.discard(key)
            size[key] = min(1 + sum(size[id(c)] for c in children), MAX_EXPANDED_NODES + 1)
            continue
        if key in size:
            continue
        if key in open_nodes:
            raise ConfigError(
                f"{source}: a YAML alias refers to the node that contains it (a recursive structure); "
                "a train.yaml must be a tree. Remove the self-referencing alias."
            )
        open_nodes.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in children if id(c) not in size)
    return size[id(root)]


def _syntax_error(source: str, exc: yaml.YAMLError) -> ConfigError:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(exc, "problem", None) or str(exc)
    context = getattr(exc, "context", None)
    detail = f"{context}; {problem}" if context else problem
    hint = ""
    if isinstance(exc, (yaml.scanner.ScannerError, yaml.parser.ParserError)):
        hint = " Fix the YAML syntax there (indentation, a missing ':' or an unclosed bracket or quote are the usual causes)."
    return ConfigError(f"YAML parse error in {source}{where}: {detail}.{hint}")


def parse_yaml_text(text: str, source: str = "<string>") -> Any:
    """Parse one YAML document with the depth check; syntax errors become ConfigError with a line."""
    too_deep = ConfigError(
        f"{source} is nested too deeply to be a train.yaml (hundreds of levels of brackets or indentation); "
        f"a config needs at most {MAX_MAPPING_DEPTH} levels of mappings."
    )
    try:
        node = yaml.compose(text, Loader=ConfigLoader)
    except yaml.YAMLError as exc:
        raise _syntax_error(source, exc) from None
    except RecursionError:
        raise too_deep from None
    if _expanded_size(node, source) > MAX_EXPANDED_NODES:
        raise ConfigError(
            f"{source} expands to more than {MAX_EXPANDED_NODES:,} values once its anchors and aliases are "
            "resolved (an alias-expansion bomb, or a config far larger than any train.yaml); refused before "
            "building it. Write the repeated sections out, or use fewer nested aliases."
        )
    depth = _mapping_depth(node)
    if depth > MAX_MAPPING_DEPTH:
        raise ConfigError(
            f"YAML nesting depth {depth} exceeds the maximum allowed value of {MAX_MAPPING_DEPTH} in {source}: "
            "a train.yaml never needs more than a few levels of mappings."
        )
    try:
        return yaml.load(text, Loader=ConfigLoader)  # noqa: S506 - ConfigLoader is a SafeLoader
    except yaml.YAMLError as exc:
        raise _syntax_error(source, exc) from None
    except RecursionError:
        raise too_deep from None


def read_yaml_file(path: str | Path) -> Any:
    """The parsed document of a YAML file; missing or unreadable files are ConfigError."""
    path = Path(path)
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "does not exist"
        raise ConfigError(
            f"Config file not found: {path} ({what}). Pass the path of a train.yaml to --config."
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"Cannot read config file {path}: {exc}") from None
    return parse_yaml_text(text, str(path))


def dump_yaml_text(data: Any) -> str:
    """YAML text that :func:`parse_yaml_text` (and plain PyYAML) reads back to the same data."""
    # allow_unicode=False: PyYAML writes some characters (U+0085 NEL, U+2028...) raw when unicode is
    # allowed, and reads them back as line breaks; escaped, every string round-trips exactly.
    return yaml.dump(
        data, Dumper=ConfigDumper, sort_keys=False, allow_unicode=False, default_flow_style=False, width=100
    )
