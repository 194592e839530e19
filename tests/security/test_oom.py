"""A sandbox's memory runs out, or its init dies (issue 11, finding 7).

Before the fix, /dev/shm filled to the memory limit OOM-killed envd (tmpfs pages are charged
to the sandbox and no kill frees them), and a sandbox whose init had died stayed listed as
running for minutes; `connect` on it answered 500. Now a full /dev/shm and a memory hog kill
the hog, envd keeps answering; and a dead sandbox leaves the running list within seconds,
asking for it answers 404 saying why, and its host resources are gone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import CommandExitException, Sandbox, SandboxNotFoundException, SandboxQuery, SandboxState
from e2e_helpers import assert_json_error, container_only, wait_until
from sandbox_helpers import runtime_env

from aenv.devserver import ServerProcess, own_server

pytestmark = container_only

CGROUP_MEMORY = Path("/sys/fs/cgroup/memory")


@pytest.fixture
def sbx() -> Iterator[Sandbox]:
    sandbox = Sandbox.create(timeout=300)
    try:
        yield sandbox
    finally:
        try:
            sandbox.kill()
        except SandboxNotFoundException:
            pass  # the test killed it


def _init_of(sandbox_id: str) -> tuple[int, str]:
    """The host pid of the sandbox's init (envd: pid 1 of its pid namespace) and its memory
    cgroup, found through /proc as a host administrator would."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cgroups = (entry / "cgroup").read_text()
            status = (entry / "status").read_text()
        except OSError:
            continue
        memory = [line.split(":", 2)[2] for line in cgroups.splitlines()
                  if line.split(":", 2)[1] == "memory" and line.endswith("/" + sandbox_id)]
        nspid = [line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:")]
        if memory and nspid and nspid[0][-1] == "1":
            return int(entry.name), memory[0]
    raise AssertionError(f"no init process found for sandbox {sandbox_id}")


def _running_ids() -> set[str]:
    paginator = Sandbox.list(query=SandboxQuery(state=[SandboxState.RUNNING]), limit=1000)
    ids: set[str] = set()
    while paginator.has_next:
        ids |= {s.sandbox_id for s in paginator.next_items()}
    return ids


def test_full_dev_shm_and_a_memory_hog_do_not_kill_envd(sbx: Sandbox) -> None:
    envd_pid, _ = _init_of(sbx.sandbox_id)
    envd_start = (Path(f"/proc/{envd_pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    envd_adj = int(sbx.commands.run("cat /proc/1/oom_score_adj", user="root").stdout)
    command_adj = int(sbx.commands.run("cat /proc/self/oom_score_adj").stdout)
    assert envd_adj <= 0 < command_adj, (envd_adj, command_adj)  # envd goes last
    # The attack: fill /dev/shm far past the sandbox's memory, then eat the rest with a
    # process whose memory only grows (tail keeps the one endless line of /dev/zero).
    hog = sbx.commands.run("head -c 4G /dev/zero > /dev/shm/fill; tail /dev/zero",
                           background=True, user="root")
    with pytest.raises(CommandExitException) as ended:
        hog.wait()
    assert ended.value.exit_code != 0
    # envd is the same process and still answers; the hog is what died.
    assert sbx.commands.run("echo alive", timeout=60).stdout.strip() == "alive"
    assert Path(f"/proc/{envd_pid}/stat").read_text().rsplit(")", 1)[1].split()[19] == envd_start
    assert sbx.sandbox_id in _running_ids()
    shm = sbx.commands.run("du -sm /dev/shm/fill | cut -f1", user="root").stdout
    assert 0 < int(shm) < 512, shm  # filled, but never to the whole memory limit
    assert sbx.commands.run("pgrep -x tail || echo none").stdout.strip() == "none"


def test_a_dead_sandbox_is_not_running_and_says_why(sbx: Sandbox, api: httpx.Client) -> None:
    sid = sbx.sandbox_id
    pid, memory_cgroup = _init_of(sid)
    assert (CGROUP_MEMORY / memory_cgroup.lstrip("/")).is_dir()
    assert sid in _running_ids()  # control: listed while it runs
    os.kill(pid, signal.SIGKILL)  # a host administrator's (or a kernel's) kill of its init
    t0 = time.monotonic()
    wait_until(lambda: sid not in _running_ids(), timeout=5, interval=0.1,
               what="the dead sandbox to leave the running list")
    noticed = time.monotonic() - t0
    assert noticed < 5, noticed
    # E2B's shape: a sandbox that died is not found (the SDK words that message itself)...
    with pytest.raises(SandboxNotFoundException):
        Sandbox.connect(sid)
    # ...and the API's message says why.
    for resp in (api.get(f"/sandboxes/{sid}"), api.post(f"/sandboxes/{sid}/pause"),
                 api.post(f"/sandboxes/{sid}/connect", json={"timeout": 60})):
        body = assert_json_error(resp, 404)
        assert "stopped running" in body["message"], body
        assert "exited or was killed" in body["message"], body
    # Its host resources went with it (the memory cgroup stands for all of them).
    wait_until(lambda: not (CGROUP_MEMORY / memory_cgroup.lstrip("/")).exists(), timeout=10,
               what="the dead sandbox's cgroup to be removed")


def test_envd_killed_by_the_oom_killer_is_reported_as_such(sbx: Sandbox,
                                                           api: httpx.Client) -> None:
    sid = sbx.sandbox_id
    # The attack from inside (root may raise any score): make envd the OOM killer's first
    # choice, then run out of memory (/dev/shm first: the hog then stays smaller than envd's
    # score, so the kill cannot fall on the hog).
    sbx.commands.run("echo 1000 > /proc/1/oom_score_adj", user="root")
    sbx.commands.run("head -c 4G /dev/zero > /dev/shm/fill; tail /dev/zero", background=True,
                     user="root")
    wait_until(lambda: sid not in _running_ids(), timeout=60, interval=0.2,
               what="the sandbox whose envd the OOM killer took to leave the running list")
    body = assert_json_error(api.get(f"/sandboxes/{sid}"), 404)
    assert "out-of-memory" in body["message"], body


@pytest.fixture
def quick_checks() -> Iterator[ServerProcess]:
    """A server of its own that asks envd for /health every second and gives up after 3 s
    (the session server's defaults are 5 s and 60 s)."""
    with own_server("aenv-sec-envd-", runtime_env(
            AENV_SANDBOX_ENVD_CHECK_INTERVAL_S="1", AENV_SANDBOX_ENVD_UNANSWERED_S="3",
            AENV_RUNTIME_READY_POOL="0"), api_key="envd-health-key") as srv:
        yield srv


def test_a_hung_envd_gets_its_sandbox_reported_dead(quick_checks: ServerProcess) -> None:
    with httpx.Client(base_url=quick_checks.url, timeout=60,
                      headers={"X-API-Key": quick_checks.api_key}) as http:
        resp = http.post("/sandboxes", json={"templateID": "base", "timeout": 120})
        assert resp.status_code == 201, resp.text
        sid = resp.json()["sandboxID"]
        pid, _ = _init_of(sid)
        os.kill(pid, signal.SIGSTOP)  # alive, but answers nothing: only envd's health tells

        def listed() -> set[str]:
            running = http.get("/v2/sandboxes", params={"state": "running"}).json()
            return {s["sandboxID"] for s in running}

        try:
            assert sid in listed()  # control: a stopped envd is not noticed at once
            wait_until(lambda: sid not in listed(), timeout=20, interval=0.2,
                       what="the sandbox with a hung envd to leave the running list")
            body = assert_json_error(http.get(f"/sandboxes/{sid}"), 404)
            assert "has not answered" in body["message"], body
            assert not Path(f"/proc/{pid}").exists() or _state(pid) == "Z"  # killed by cleanup
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
