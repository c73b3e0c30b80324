"""Name rules of the ``optimizer`` section: exact name, substring or shell glob.

``weight_decay_include`` / ``weight_decay_exclude`` and ``lr_scale`` use all three forms (as the
original's ``get_param_groups``); Muon's ``adamw_include`` is a glob only (the original's
``fnmatch``), so it has its own helper.
"""

from __future__ import annotations

from collections.abc import Iterable
from fnmatch import fnmatchcase


def rule_matches(name: str, rule: str) -> bool:
    """True when ``rule`` equals ``name``, is a substring of it, or matches it as a glob."""
    return rule == name or rule in name or fnmatchcase(name, rule)


def first_matching_rule(names: Iterable[str], rules: Iterable[str]) -> str | None:
    """The first rule (in rule order) that matches any of ``names`` (a tied parameter has several)."""
    names = list(names)
    for rule in rules:
        if any(rule_matches(n, rule) for n in names):
            return rule
    return None


def first_matching_glob(names: Iterable[str], patterns: Iterable[str]) -> str | None:
    # Case-sensitive, like fnmatch on Linux where the original runs.
    names = list(names)
    for pat in patterns:
        if any(fnmatchcase(n, pat) for n in names):
            return pat
    return None
