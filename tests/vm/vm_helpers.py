"""Helpers for the qemu runtime suite: its sandbox defaults (512 MiB, no internet, envd token
`token-<id>`) and a longer command timeout for guests under TCG. Talking to envd is in
tests/sandbox_helpers.py, shared with the container suite."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import sandbox_helpers
from sandbox_helpers import Result, new_id

from aenv.runtime.base import RuntimeDriver, RuntimeHandle, SandboxSpec


async def run(driver: RuntimeDriver, handle: RuntimeHandle, cmd: str, token: str | None = None,
              user: str = "root", timeout: float = 120) -> Result:
    """`bash -c cmd` through envd's process service, waited for."""
    return await sandbox_helpers.run(driver, handle, cmd, user=user, timeout=timeout, token=token)


def spec_for(home: Path, rootfs: Path, **overrides: Any) -> SandboxSpec:
    sid = overrides.pop("sandbox_id", None) or new_id()
    return sandbox_helpers.spec_for(home, rootfs, **{
        "sandbox_id": sid, "memory_mb": 512, "pids_max": 1024, "envd_access_token": f"token-{sid}",
        "allow_internet_access": False, **overrides})
