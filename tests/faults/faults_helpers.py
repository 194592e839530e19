"""Helpers of the crash-consistency suite: a server that crashes at a named point
(`AENV_CRASH_AT`, aenv.faults), its restart on the same home and port, and the invariants
checked after every recovery: nothing lost, nothing frozen, nothing orphaned."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from e2b import Sandbox
from sandbox_helpers import runtime_env

from aenv.devserver import ServerProcess
from aenv.runtime.container.cgroups import CGROUP_ROOT
from aenv.runtime.container.network import NETNS_DIR

SETUP = ("mkdir -p /home/user/data && cd /home/user/data && "
         "for i in $(seq 1 200); do head -c $((RANDOM % 8192 + 1)) /dev/urandom > f$i; done && "
         "sha256sum f* | sha256sum")
SUMS = "cd /home/user/data && sha256sum f* | sha256sum"
COUNTER = ("i=0; while true; do i=$((i+1)); echo $i > /home/user/counter; sleep 0.1; done")


@dataclass
class Node:
    """One home and port; servers come and go on it."""

    home: Path
    port: int
    api_key: str = "faults-key"
    server: ServerProcess | None = None
    pids: list[int] = field(default_factory=list)  # of every server started on this node

    @property
    def opts(self) -> dict[str, Any]:
        url = f"http://127.0.0.1:{self.port}"
        return {"api_key": self.api_key, "api_url": url, "sandbox_url": url}

    def api(self) -> httpx.Client:
        return httpx.Client(base_url=f"http://127.0.0.1:{self.port}",
                            headers={"X-API-Key": self.api_key}, timeout=120)

    def start(self, crash_at: str | None = None) -> ServerProcess:
        env = runtime_env()
        if crash_at:
            env["AENV_CRASH_AT"] = crash_at
        self.server = ServerProcess(home=self.home, port=self.port, api_key=self.api_key,
                                    extra_env=env).start(ready_timeout=300)
        assert self.server.proc is not None
        self.pids.append(self.server.proc.pid)
        return self.server

    def wait_crashed(self, point: str, timeout: float = 60) -> None:
        """The server died at `point` (killed itself: SIGKILL), as the log says."""
        assert self.server is not None and self.server.proc is not None
        self.server.proc.wait(timeout)
        assert self.server.proc.returncode == -signal.SIGKILL, self.server.proc.returncode
        self.server.stop()
        log = (self.home / "server.log").read_text(errors="replace")
        assert f"crash point {point} reached" in log, log[-2000:]

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


def set_up_sandbox(node: Node) -> tuple[Sandbox, str]:
    """A sandbox with 200 files of random content (their checksum returned) and a process
    counting in the background."""
    sbx = Sandbox.create(timeout=600, **node.opts)
    sums = sbx.commands.run(SETUP, timeout=60).stdout.strip()
    assert len(sums.split()[0]) == 64, sums
    sbx.commands.run(COUNTER, background=True)
    time.sleep(0.3)
    return sbx, sums


def assert_intact(node: Node, sandbox_id: str, sums: str, processes: bool = True) -> Sandbox:
    """The sandbox answers (connect resumes it if paused), its files are unchanged and, with
    `processes`, its counter still counts."""
    sbx = Sandbox.connect(sandbox_id, timeout=600, **node.opts)
    assert sbx.commands.run(SUMS, timeout=30).stdout.strip() == sums
    if processes:
        # After a resume rolled back, the file may still hold what the rolled-back processes
        # wrote last: the counter restored from the image overwrites it within 0.1 s.
        time.sleep(0.3)
        first = int(sbx.commands.run("cat /home/user/counter", timeout=30).stdout)
        time.sleep(0.5)
        second = int(sbx.commands.run("cat /home/user/counter", timeout=30).stdout)
        assert second > first > 0, (first, second)
    return sbx


def listed(node: Node) -> dict[str, str]:
    """Sandbox id -> state, as the API lists them."""
    with node.api() as api:
        resp = api.get("/v2/sandboxes", params={"limit": 1000, "state": "running,paused"})
        assert resp.status_code == 200, resp.text
        return {s["sandboxID"]: s["state"] for s in resp.json()}


def snapshots(node: Node) -> list[dict[str, Any]]:
    with node.api() as api:
        resp = api.get("/snapshots")
        assert resp.status_code == 200, resp.text
        return list(resp.json())


def sandbox_cgroups() -> set[str]:
    base = CGROUP_ROOT / "pids" / "aenv"
    return {p.name for p in base.iterdir() if p.is_dir()
            and not p.name.startswith(("pool-", "warm-"))} if base.is_dir() else set()


def abandoned_slots(owners: list[int]) -> list[str]:
    """Network slots made by the (dead) servers `owners` that no process is in."""
    if not NETNS_DIR.is_dir():
        return []
    live = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                live.add(os.stat(f"/proc/{pid}/ns/net").st_ino)
            except OSError:
                pass
    out = []
    for entry in NETNS_DIR.iterdir():
        _, _, owner = entry.name.partition(".")
        if not owner.isdigit() or int(owner) not in owners or Path(f"/proc/{owner}").exists():
            continue
        try:
            if entry.stat().st_ino not in live:
                out.append(entry.name)
        except OSError:
            continue
    return out


def assert_converged(node: Node, baseline_cgroups: set[str]) -> dict[str, str]:
    """Nothing orphaned, nothing frozen, everything listed usable as far as state goes:
    - every workspace on disk belongs to a listed sandbox;
    - every cgroup that appeared since `baseline_cgroups` belongs to a listed sandbox;
    - no listed sandbox is frozen; no root overlay is left mounted in the host's namespace;
    - no network slot of a dead server is left with nobody in it.
    Returns what is listed."""
    sandboxes = listed(node)
    workspaces = node.home / "sandboxes"
    on_disk = {p.name for p in workspaces.iterdir()} if workspaces.is_dir() else set()
    assert on_disk <= set(sandboxes), f"orphan workspaces: {on_disk - set(sandboxes)}"
    leaked = sandbox_cgroups() - baseline_cgroups - set(sandboxes)
    assert not leaked, f"orphan cgroups: {leaked}"
    for sid in sandboxes:
        state = CGROUP_ROOT / "freezer" / "aenv" / sid / "freezer.state"
        if state.exists():
            assert state.read_text().strip() == "THAWED", f"{sid} is frozen"
    real = str(workspaces.resolve())
    with open("/proc/self/mountinfo") as f:
        mounted = [line.split()[4] for line in f if real in line.split()[4]]
    assert not mounted, f"mounts left under the home: {mounted}"
    left = abandoned_slots(node.pids)
    assert not left, f"network slots nobody uses: {left}"
    return sandboxes
