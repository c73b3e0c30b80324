"""Every problem of a configuration in one run of ``lmforge check``.

Loading stops at layers: pydantic reports every field of a pass at once, but checks that need other
sections (the lr schedule against ``training.steps``, the model against the data, the run plan) only
run once the sections they read are valid. So that a user sees all their mistakes at once rather
than one layer per attempt, ``check`` sets each key it found wrong aside (deletes it from a copy of
the file, so its default applies) and validates again, up to :data:`MAX_PASSES` times, then runs the
run plan. A later pass's message that names a key set aside is dropped: it may be about the stand-in
default rather than the user's value. ``train`` keeps its single pass: it refuses at the first layer.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import ValidationError

from lmforge.errors import ConfigError

MAX_PASSES = 6
_MANY = re.compile(r"Invalid configuration(?: in .*?)?, (\d+) problems: \(1\) ", re.S)
_DOTTED_KEY = re.compile(r"[A-Za-z_]\w*(?:(?:\.[A-Za-z_]\w*)|\[\d+\])+")
_REQUIRED_SECTIONS = ("model", "train_dataset", "lr_scheduler")
_ONE = re.compile(r"Invalid configuration(?: in \S+)?: ", re.S)


def split_problems(text: str) -> list[str]:
    """The single problems of a ConfigError's text (``..., 3 problems: (1) a; (2) b; (3) c``)."""
    many = _MANY.match(text)
    if many is None:
        one = _ONE.match(text)
        return [text[one.end() :] if one else text]
    count, rest, out = int(many.group(1)), text[many.end() :], []
    for k in range(2, count + 1):
        head, sep, tail = rest.partition(f"; ({k}) ")
        if not sep:  # not the shape expected: keep the remainder whole rather than guess
            break
        out.append(head)
        rest = tail
    return [*out, rest]


def _error_locations(raw: Mapping[str, Any]) -> list[tuple[str | int, ...]]:
    """The keys of ``raw`` to set aside for the problems pydantic finds in it: the keys each message
    names (a check of the whole model section names the fields it compared), else the place pydantic
    reports, but never a whole required section (nothing could stand in for it)."""
    from lmforge.config.schema import TrainConfig

    try:
        TrainConfig.model_validate(dict(raw))
    except ValidationError as exc:
        errors = exc.errors()
    else:
        return []
    out: list[tuple[str | int, ...]] = []
    for err in errors:
        where = _existing_prefix(raw, err["loc"])
        text = str((err.get("ctx") or {}).get("error", err["msg"]))
        named = [
            path
            for key in _DOTTED_KEY.findall(text)
            if (path := _existing_prefix(raw, _split(key)))[: len(where)] == where and len(path) > len(where)
        ]
        if named:
            out += named
        elif where and not (len(where) == 1 and where[0] in _REQUIRED_SECTIONS):
            out.append(where)
    return out


def _split(key: str) -> tuple[str | int, ...]:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"\.|\[|\]\.?", key) if p)


def _existing_prefix(raw: Any, loc: tuple[Any, ...]) -> tuple[str | int, ...]:
    """The longest prefix of ``loc`` that is a path into ``raw`` (pydantic adds type tags to locs)."""
    path: list[str | int] = []
    node = raw
    for part in loc:
        if (
            isinstance(node, Mapping)
            and part in node
            or isinstance(node, list)
            and isinstance(part, int)
            and 0 <= part < len(node)
        ):
            node = node[part]
        else:
            break
        path.append(part)
    return tuple(path)


def _delete(raw: dict[str, Any], path: tuple[str | int, ...]) -> None:
    node: Any = raw
    for part in path[:-1]:
        node = node[part]
    del node[path[-1]]


def _dotted(path: tuple[str | int, ...]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")


def _names_any(message: str, keys: list[str]) -> bool:
    return any(re.search(rf"(?<![\w.]){re.escape(key)}(?![\w])", message) for key in keys)


def find_problems(
    raw: Mapping[str, Any], source: str, plan_checks: Callable[[Any], Any]
) -> tuple[Any, Any, list[str]]:
    """``(cfg, plan, problems)``: the typed config and ``plan_checks(cfg)``'s result when there is no
    problem, else ``(None, None, every problem found)``."""
    from lmforge.config.load import validate_config

    current = copy.deepcopy(dict(raw))
    problems: list[str] = []
    set_aside: list[str] = []

    def add(exc: ConfigError) -> None:
        for message in split_problems(str(exc)):
            if not _names_any(message, set_aside) and message not in problems:
                problems.append(message)

    for _ in range(MAX_PASSES):
        try:
            cfg = validate_config(current, source, log_warnings=False)
        except ConfigError as exc:
            add(exc)
            paths = sorted({p for p in _error_locations(current) if p}, key=len, reverse=True)
            if not paths:
                break
            for path in paths:
                if not any(
                    _dotted(path).startswith(done + ".") or _dotted(path) == done for done in set_aside
                ):
                    _delete(current, path)
                    set_aside.append(_dotted(path))
            continue
        try:
            plan = plan_checks(cfg)
        except ConfigError as exc:
            add(exc)
            break
        if not problems:
            return cfg, plan, []
        break
    return None, None, problems


def raise_problems(problems: list[str], source: str) -> None:
    if len(problems) == 1:
        raise ConfigError(f"Invalid configuration in {source}: {problems[0]}")
    numbered = "; ".join(f"({i}) {p}" for i, p in enumerate(problems, 1))
    raise ConfigError(f"Invalid configuration in {source}, {len(problems)} problems: {numbered}")
