"""Name rules of the ``optimizer`` section: the one rule of :mod:`lmforge.utils.name_patterns`.

``weight_decay_include`` / ``weight_decay_exclude``, ``lr_scale`` and Muon's ``adamw_include`` all
match parameter names the same way: exact name, part of the name (with the original's aliases),
shell glob or regular expression. The spec's literal ``["word_embeddings", "output_layer"]`` works.
"""

from __future__ import annotations

from collections.abc import Iterable

from lmforge.utils.name_patterns import first_match, name_matches


def rule_matches(name: str, rule: str) -> bool:
    """True when ``rule`` matches ``name`` (see :mod:`lmforge.utils.name_patterns`)."""
    return name_matches(name, rule)


def first_matching_rule(names: Iterable[str], rules: Iterable[str]) -> str | None:
    """The first rule (in rule order) that matches any of ``names`` (a tied parameter has several)."""
    return first_match(names, rules)


def first_matching_glob(names: Iterable[str], patterns: Iterable[str]) -> str | None:
    """``adamw_include``: the same rule as the other keys (it was a glob only, so the spec's literal
    ``word_embeddings`` matched nothing and the embedding trained with Muon)."""
    return first_match(names, patterns)
