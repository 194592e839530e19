"""Paths and helpers shared by the deployment tests (tests/deploy/test_*.py import it)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
VENV_BIN = Path(sys.executable).parent


def tool(name: str) -> str | None:
    """A tool from this test venv (wheels that ship binaries: shellcheck, hadolint), else PATH."""
    local = VENV_BIN / name
    if local.exists():
        return str(local)
    return shutil.which(name)


def run(cmd: list[str], check: bool = True, timeout: float = 600,
        env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=timeout,
                          env=env, cwd=cwd)
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc
