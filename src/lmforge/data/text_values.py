"""Text values read from data files, checked before they are tokenized.

A value is used only when it is what the format says it is: a string of valid Unicode. Anything else
(``null``, a number, an object, a list holding non-strings, a lone UTF-16 surrogate such as
``"\\ud800"`` that JSON allows but no UTF-8 text can hold) is refused with the file and line, never
turned into the text ``"None"``, a Python repr, or a traceback inside the tokenizer.
"""

from __future__ import annotations

from typing import Any

from lmforge.errors import DataError


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", dict: "an object", list: "a list"}.get(
        type(value), type(value).__name__
    )


def check_unicode(text: str, where: str, key: str) -> str:
    """``text`` itself, unless it holds a code point UTF-8 cannot encode (a lone surrogate)."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise DataError(
            f"{where}: '{key}' holds an invalid Unicode code point (U+{ord(text[exc.start]):04X}, a lone "
            f"surrogate, at character {exc.start}); JSON escapes such as \\ud800 must come in valid pairs. "
            "Fix or remove the record."
        ) from None
    return text


def text_value(value: Any, where: str, key: str, *, allow_list: bool = False) -> str:
    """The string ``value`` of field ``key`` (with ``allow_list``: a list of strings, joined)."""
    if isinstance(value, list) and allow_list:
        bad = next((v for v in value if not isinstance(v, str)), ...)
        if bad is ...:
            return check_unicode("".join(value), where, key)
        raise DataError(
            f"{where}: '{key}' is a list holding {_kind(bad)} ({str(bad)[:40]!r}); a list must hold only strings "
            "(its sentences, joined). Fix or remove the record."
        )
    if not isinstance(value, str):
        expected = "a string or a list of strings" if allow_list else "a string"
        raise DataError(
            f"{where}: '{key}' is {_kind(value)}, not {expected}; lmforge does not turn other values into text. "
            "Fix or remove the record."
        )
    return check_unicode(value, where, key)
