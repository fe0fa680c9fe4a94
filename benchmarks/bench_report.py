"""Where a benchmark's results go: one Markdown table and one JSON document beside each other."""

from __future__ import annotations

import json
from pathlib import Path


def write_report(out: str | Path, table: str, payload: dict) -> None:
    """Write ``payload`` to ``OUT.json`` (indent 1) and ``table`` plus a newline to ``OUT.md``,
    creating OUT's directory; ``out`` is the output path without suffix (a suffix it has is replaced).
    Returns nothing."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(payload, indent=1))
    out.with_suffix(".md").write_text(table + "\n")
