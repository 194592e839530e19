"""`make soak` in small: about a minute of one worker cycling create -> write -> pause -> resume
-> fork -> snapshot -> create from it -> kill, with one server `kill -9` (landing between SDK
calls: `--kill-mode between`; the soak itself defaults to `anywhere`), then the soak's own
invariants: no 5xx, no committed file lost, nothing left on the host once everything is killed.

The soak runs as a subprocess with its own home and server (`aenv.bench.soak`); its JSON report
is printed when an invariant fails.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from e2e_helpers import container_only


@container_only
@pytest.mark.slow
def test_soak_smoke(tmp_path: Path) -> None:
    report_path = tmp_path / "soak.json"
    cmd = [sys.executable, "-m", "aenv.bench.soak", "--minutes", "0.9", "--sandboxes", "1",
           "--kill-every", "30", "--kill-mode", "between", "--files", "100", "--seed", "12",
           "--json", str(report_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
    assert report_path.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(report_path.read_text())
    details = json.dumps({k: report[k] for k in ("invariants", "faults", "files", "lost", "five_xx",
                                                   "errors", "leaks", "unusable_snapshots")},
                         indent=1)[:6000]
    assert report["faults"]["kills"] == 1, details
    assert report["cycles"] >= 1 and report["files"]["verified"] > 0, details
    assert report["invariants"]["no_5xx"], details
    assert report["invariants"]["nothing_lost"], details
    assert report["invariants"]["listed_snapshots_usable"], details
    assert report["invariants"]["nothing_leaked"], details
    assert not report["errors"], details
    assert done.returncode == 0, done.stdout[-3000:]
