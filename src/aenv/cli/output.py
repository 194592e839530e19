"""Table and JSON output for CLI verbs, and per-target reports of verbs over several ids."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from aenv.cli.client import ApiError


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


def each_target(targets: Iterable[str], act: Callable[[str], object]) -> int:
    """`act` on each target in turn: the target is printed when it succeeds, `aenv: target:
    message` goes to stderr when it raises ApiError. The exit code: 1 if any failed."""
    failed = 0
    for target in targets:
        try:
            act(target)
            print(target)
        except ApiError as exc:
            print(f"aenv: {target}: {exc.message}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0
