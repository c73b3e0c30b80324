"""Reading and writing ``train.yaml``: YAML 1.1 (PyYAML safe loader) with two additions.

* ``1e-8`` is a float. YAML 1.1 reads an exponent without a dot as a string, a trap users of the
  original fell into (its loader then rejected the "string" in a float field); scientific notation
  without a dot is resolved as a float here.
* Mapping nesting deeper than 10 levels is refused before the document is constructed, as in the
  original (sequences do not count).
* Hostile documents are refused before they are constructed: a file over ``MAX_YAML_BYTES`` (before
  it is read), anchors/aliases that expand to more than ``MAX_EXPANDED_NODES`` nodes (a "billion
  laughs" bomb) or more than ``MAX_EXPANDED_BYTES`` of scalar text (one large string aliased many
  times) or refer to themselves, and nesting too deep for the parser.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from lmforge.errors import ConfigError

MAX_MAPPING_DEPTH = 10
# A real train.yaml has a few hundred nodes; aliases may repeat a section, not multiply it a million times.
# (Pure-Python parsing costs ~0.1 ms a node on a loaded CPU: 20,000 keep the worst accepted file ~2 s.)
MAX_EXPANDED_NODES = 20_000
# A train.yaml is kilobytes (a chat template included); the file and its expansion are bounded so that a
# hostile or mistaken file is refused in well under a second instead of taking minutes and gigabytes
# (the resolved config is also written into output_dir and every checkpoint).
MAX_YAML_BYTES = 256 << 10
MAX_EXPANDED_BYTES = 1 << 20


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


# Collections nested deeper than this (brackets or indentation) are refused before the recursive
# composer sees them; a train.yaml needs a handful.
MAX_NESTING = 100


class _Bounds:
    """Sizes of the document as the parser streams it, aliases expanded: refuses as soon as a bound is
    passed. Iterative over parser events (libyaml's C parser when available: a 1 MB document takes
    milliseconds), so the recursive pure-Python composer only ever sees bounded documents."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.anchors: dict[str, tuple[int, int, int]] = {}  # anchor -> (nodes, characters, mapping depth)
        self.open_anchors: set[str] = set()
        # Open collections: [nodes, characters, mapping depth below, anchor, is a mapping].
        self.stack: list[list[Any]] = []

    def add(self, item: tuple[int, int, int]) -> None:
        if not self.stack:
            self._check(item[0], item[1])
            return
        parent = self.stack[-1]
        parent[0] += item[0]
        parent[1] += item[1]
        parent[2] = max(parent[2], item[2])
        self._check(parent[0], parent[1])

    def _check(self, nodes: int, chars: int) -> None:
        if nodes > MAX_EXPANDED_NODES or chars > MAX_EXPANDED_BYTES:
            what = (
                f"{MAX_EXPANDED_NODES:,} values"
                if nodes > MAX_EXPANDED_NODES
                else f"{MAX_EXPANDED_BYTES:,} characters of text"
            )
            raise ConfigError(
                f"{self.source} expands to more than {what} once its anchors and aliases are resolved (an "
                "alias-expansion bomb, or a config far larger than any train.yaml); refused before building it. "
                "Write the repeated sections out, or use fewer nested aliases."
            )

    def event(self, event: yaml.Event, too_deep: ConfigError) -> None:
        if isinstance(event, yaml.CollectionStartEvent):
            self.stack.append([1, 0, 0, event.anchor, isinstance(event, yaml.MappingStartEvent)])
            if event.anchor:
                self.open_anchors.add(event.anchor)
            if len(self.stack) > MAX_NESTING:
                raise too_deep
            return
        anchor = None
        if isinstance(event, yaml.ScalarEvent):
            item, anchor = (1, len(event.value), 0), event.anchor
        elif isinstance(event, yaml.AliasEvent):
            if event.anchor in self.open_anchors:
                raise ConfigError(
                    f"{self.source}: a YAML alias refers to the node that contains it (a recursive structure); "
                    "a train.yaml must be a tree. Remove the self-referencing alias."
                )
            if event.anchor not in self.anchors:
                return  # an undefined alias: the composer reports it with its line
            item = self.anchors[event.anchor]
        elif isinstance(event, yaml.CollectionEndEvent):
            nodes, chars, depth, anchor, is_mapping = self.stack.pop()
            item = (nodes, chars, depth + int(is_mapping))
            if anchor:
                self.open_anchors.discard(anchor)
        else:
            return
        if anchor:
            self.anchors[anchor] = item
        self.add(item)


def _check_bounds(text: str, source: str, too_deep: ConfigError) -> None:
    """Refuse a document whose alias expansion or nesting passes the bounds, before composing it.
    Syntax errors are left to the composer, which reports them with their line and column."""
    bounds = _Bounds(source)
    try:
        for event in yaml.parse(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
            bounds.event(event, too_deep)
    except yaml.YAMLError:
        return


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
    """Parse one YAML document with the size, expansion and depth checks; syntax errors become
    ConfigError with a line."""
    if len(text) > MAX_YAML_BYTES:
        raise ConfigError(
            f"{source} is longer than {MAX_YAML_BYTES:,} characters (the limit for a train.yaml, which is "
            "kilobytes); refused without parsing it."
        )
    too_deep = ConfigError(
        f"{source} is nested too deeply to be a train.yaml (hundreds of levels of brackets or indentation); "
        f"a config needs at most {MAX_MAPPING_DEPTH} levels of mappings."
    )
    _check_bounds(text, source, too_deep)
    loader = ConfigLoader(text)  # parsed once: composed, checked, then constructed from the same nodes
    try:
        node = loader.get_single_node()
        depth = _mapping_depth(node)
        if depth > MAX_MAPPING_DEPTH:
            raise ConfigError(
                f"YAML nesting depth {depth} exceeds the maximum allowed value of {MAX_MAPPING_DEPTH} in {source}: "
                "a train.yaml never needs more than a few levels of mappings."
            )
        return loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as exc:
        raise _syntax_error(source, exc) from None
    except RecursionError:
        raise too_deep from None
    finally:
        loader.dispose()


def read_yaml_file(path: str | Path) -> Any:
    """The parsed document of a YAML file; missing or unreadable files are ConfigError."""
    path = Path(path)
    if not path.is_file():
        if path.is_dir():
            what = "is a directory, not a file"
        elif path.is_symlink():  # exists() follows the link: a dangling link or a loop reads as absent
            what = "is a symbolic link to nothing: its target does not exist, or the links form a loop"
        elif path.exists():
            what = "is not a regular file (a device, FIFO or socket)"
        else:
            what = "does not exist"
        raise ConfigError(
            f"Config file not found: {path} ({what}). Pass the path of a train.yaml to --config."
        )
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_YAML_BYTES + 1)  # never more: a file may grow, or be a device
        if len(data) > MAX_YAML_BYTES:
            raise ConfigError(
                f"Config file {path} is larger than {MAX_YAML_BYTES:,} bytes (the limit for a train.yaml, which "
                "is kilobytes); refused without parsing it. Check that --config names the YAML file, not data."
            )
        text = data.decode("utf-8")
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
