"""The crash-consistency suite: container runtime only (criu, cgroups, overlays)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "e2e"))

from faults_helpers import Node, sandbox_cgroups

from aenv.devserver import free_port, prepare_home, remove_home


@pytest.fixture
def node() -> Iterator[Node]:
    home = prepare_home("aenv-faults-")
    n = Node(home=home, port=free_port())
    try:
        yield n
    finally:
        if n.server is None or n.server.proc is None or n.server.proc.poll() is not None:
            n.start()
        assert n.server is not None
        n.server.shutdown()
        remove_home(home)


@pytest.fixture
def baseline() -> set[str]:
    return sandbox_cgroups()
