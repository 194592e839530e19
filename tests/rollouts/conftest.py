"""Fixtures for the rollout library's suite: the same real `aenv serve` session server, SDK
environment (`server.sdk_env()`, set by the session fixture), httpx clients and leak guard as
the e2e suite (tests/e2e/conftest.py), reused, not copied."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "e2e"))

from e2e.conftest import (  # noqa: F401 - fixtures re-exported for this suite
    _e2e_server,
    _no_leaked_sandboxes,
    api,
    raw_http,
    run_id,
)

from aenv.rollouts import Snapshot, setup

# A tiny Python project with a failing test, and a process that keeps counting in the
# background: what every fork of the setup must inherit.
# checked-hash bytecode: a candidate patch of a file's exact size, written within the second
# the .pyc was made, would otherwise run stale bytecode (a .pyc is checked by mtime and size).
COMPILE_ALL = "cd /home/user/proj && python3 -m compileall -q --invalidation-mode checked-hash ."
PROJECT = {
    "/home/user/proj/calc.py": "def add(a, b):\n    return a - b\n",
    "/home/user/proj/test_calc.py": (
        "import unittest\nfrom calc import add\n\n"
        "class T(unittest.TestCase):\n"
        "    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n\n"
        "    def test_zero(self):\n        self.assertEqual(add(0, 0), 0)\n\n"
        "if __name__ == '__main__':\n    unittest.main()\n"),
}
COUNTER = "sh -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/count; sleep 0.05; done'"
TESTS = "cd /home/user/proj && python3 -m unittest -q test_calc"


@pytest.fixture(scope="module")
async def project() -> AsyncIterator[Snapshot]:
    snapshot = await setup("base", [COMPILE_ALL],
                           files=PROJECT, background=[COUNTER])
    yield snapshot
    await snapshot.delete()
