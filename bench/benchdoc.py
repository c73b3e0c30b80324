"""docs/benchmarks.md: each benchmark script rewrites only its own ``## ...`` section."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"


def replace_section(doc: str, title: str, body: str) -> str:
    """``doc`` with the section headed ``title`` replaced by ``body`` (which starts with that heading).

    The section runs to the next ``## `` heading; a missing section is appended at the end.
    """
    body = body.strip("\n") + "\n"
    pattern = re.compile(rf"^{re.escape(title)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(doc):
        doc = pattern.sub(lambda _: body + "\n", doc, count=1)
    else:
        doc = doc.rstrip("\n") + "\n\n" + body
    return doc.rstrip("\n") + "\n"


def write_section(title: str, body: str, path: Path = DOC) -> None:
    doc = path.read_text() if path.is_file() else "# Benchmarks\n"
    path.write_text(replace_section(doc, title, body))
