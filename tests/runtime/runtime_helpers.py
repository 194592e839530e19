"""Helpers for the container runtime suite: its sandbox defaults and the sandbox's cgroup files.
Talking to envd is in tests/sandbox_helpers.py, shared with the qemu suite."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import sandbox_helpers

from aenv.runtime.base import SandboxSpec

CGROUP = Path("/sys/fs/cgroup")


def spec_for(home: Path, rootfs: Path, **overrides: Any) -> SandboxSpec:
    """A small sandbox (1 cpu, 256 MiB, root by default) on `rootfs`, workspace under `home`;
    keyword arguments override any field."""
    return sandbox_helpers.spec_for(home, rootfs, **{
        "memory_mb": 256, "pids_max": 256, "allow_internet_access": True, **overrides})


def cgroup_read(sandbox_id: str, controller: str, name: str) -> str:
    return (CGROUP / controller / "aenv" / sandbox_id / name).read_text()
