"""A bench script's record: its JSON and its Markdown under one dated name, ``OUT/<date>-<name>.json`` and
``.md`` (what bench/results/ holds)."""

from __future__ import annotations

import datetime
import json
import os


def write_record(out: str, name: str, doc: dict, lines: list[str] | str) -> str:
    """``doc`` as ``OUT/<today>-<name>.json`` and ``lines`` (a list of lines, or the text) as ``.md`` beside it;
    ``OUT`` made where missing. Returns the path without its suffix."""
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, f"{datetime.date.today()}-{name}")
    with open(stem + ".json", "w") as fh:
        json.dump(doc, fh, indent=1)
    with open(stem + ".md", "w") as fh:
        fh.write(lines if isinstance(lines, str) else "\n".join(lines) + "\n")
    return stem
