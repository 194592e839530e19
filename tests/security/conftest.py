"""Fixtures for the attack suite: the same real `aenv serve` session server, SDK environment,
httpx clients and leak guard as the e2e suite (tests/e2e/conftest.py), reused, not copied.

Every test here is an attack that a hostile sandbox or a local host user would try; each one
failed on the code before its fix.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "e2e"))

from e2e.conftest import (  # noqa: F401 - fixtures re-exported for this suite
    _e2e_server,
    _no_leaked_sandboxes,
    api,
    raw_http,
    run_id,
)
