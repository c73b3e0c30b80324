"""One matching rule for every key that names parameters or modules by pattern.

Used by ``optimizer.adamw_include``, ``optimizer.weight_decay_include`` / ``weight_decay_exclude``,
the keys of ``optimizer.lr_scale``, ``recompute.select_module``, ``recompute_comm.select_module`` and
``swap.op_swap``. A pattern matches a dotted name (``decoder.layers.0.self_attention.linear_qkv``,
``embedding.word_embeddings.weight``) when any of these holds:

1. it is the name;
2. its dot-separated parts are consecutive whole parts of the name (``word_embeddings``,
   ``output_layer``, ``layers.0.mlp``), each part equal to the name's part, standing for it in the
   original's naming (``attention`` = ``self_attention``, ``qkv`` = ``linear_qkv``, ``proj`` =
   ``linear_proj``, ``fc1`` / ``fc2`` = ``linear_fc1`` / ``linear_fc2``: the spec's
   ``attention.qkv`` names ``self_attention.linear_qkv``) or matching it as a glob (``layers.*.mlp``);
3. it matches the whole name as a shell glob (``*word_embeddings*``, ``*.bias``: the original's
   ``fnmatch`` for ``adamw_include``);
4. it matches the whole name as a regular expression (``self_attention|mlp``).

Parts are whole: ``mlp`` names ``decoder.layers.1.mlp``, not ``pre_mlp_layernorm`` (write
``*mlp*`` for a substring). The original's ``weight_decay_include`` / ``exclude`` also match bare
substrings; here a substring must be written as a glob. The spec's literal forms
(``["word_embeddings", "output_layer"]``) work as written. A
pattern that matches nothing is reported: an error for module lists (nothing would be recomputed
or swapped), a warning for parameter rules (``lmforge check`` and ``train`` both show it).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from fnmatch import fnmatchcase

# A part of a pattern -> the part of lmforge's (Megatron's) module names it also stands for.
PART_ALIASES: dict[str, str] = {
    "attention": "self_attention",
    "qkv": "linear_qkv",
    "proj": "linear_proj",
    "fc1": "linear_fc1",
    "fc2": "linear_fc2",
}


def _part_matches(part: str, pattern_part: str) -> bool:
    return part == pattern_part or PART_ALIASES.get(pattern_part) == part or fnmatchcase(part, pattern_part)


def _parts_match(name: str, pattern: str) -> bool:
    parts, wanted = name.split("."), pattern.split(".")
    n = len(wanted)
    return any(
        all(_part_matches(parts[i + j], wanted[j]) for j in range(n)) for i in range(len(parts) - n + 1)
    )


class NamePattern:
    """A compiled pattern; ``fullmatch(name)`` is truthy when the rule above matches ``name``."""

    def __init__(self, text: str) -> None:
        self.text = text
        try:
            self._regex: re.Pattern[str] | None = re.compile(text)
        except re.error:
            self._regex = None  # a glob such as '*.bias' or a plain name is not always a regex

    def fullmatch(self, name: str) -> bool:
        p = self.text
        if p == name or _parts_match(name, p) or fnmatchcase(name, p):
            return True
        return self._regex is not None and self._regex.fullmatch(name) is not None

    def __repr__(self) -> str:
        return f"NamePattern({self.text!r})"


def first_match(names: Iterable[str], patterns: Iterable[str]) -> str | None:
    """The first pattern (in pattern order) that matches any of ``names`` (a tied parameter has several)."""
    names = list(names)
    for pattern in patterns:
        compiled = NamePattern(pattern)
        if any(compiled.fullmatch(n) for n in names):
            return pattern
    return None


def unmatched(names: Iterable[str], patterns: Iterable[str]) -> list[str]:
    """The patterns that match none of ``names``."""
    names = list(names)
    return [p for p in patterns if not any(NamePattern(p).fullmatch(n) for n in names)]
