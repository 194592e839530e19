"""Table and JSON output for CLI verbs."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any


def emit(rows: Sequence[dict[str, Any]] | dict[str, Any], columns: Sequence[str],
         as_json: bool) -> None:
    if as_json:
        json.dump(rows, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
        return
    items = [rows] if isinstance(rows, dict) else list(rows)
    cells = [[str(item.get(c, "")) for c in columns] for item in items]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    print("  ".join(c.upper().ljust(w) for c, w in zip(columns, widths)).rstrip())
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())
