"""Filesystem-only pauses through the official SDK: `pause(mode="filesystem")`,
`connect(on_resume="reboot")`, `lifecycle={"on_timeout": {"action": "pause", "mode":
"filesystem"}}` (the API's `autoPauseMemory`), and `pauseMode` in the detail. Only the
writable layer is kept: the resume boots a fresh sandbox on it (files there, processes gone).
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox, SandboxException, Template
from e2e_helpers import assert_json_error, container_only, wait_until

from aenv.devserver import ServerProcess

pytestmark = container_only

HOLD_MEMORY = ("python3 -c 'import time; b = bytearray(150 * 2**20); "
               "b[::4096] = b\"x\" * len(b[::4096]); time.sleep(3600)'")


def _tree_bytes(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total


def _detail(api: httpx.Client, sandbox_id: str) -> dict[str, object]:
    resp = api.get(f"/sandboxes/{sandbox_id}")
    assert resp.status_code == 200, resp.text
    body: dict[str, object] = resp.json()
    return body


def _pids(sbx: Sandbox, pattern: str) -> str:
    # [x]yz: the pattern does not match the shell running pgrep itself
    return sbx.commands.run(f"pgrep -f '[{pattern[0]}]{pattern[1:]}' || true").stdout.strip()


def test_filesystem_pause_keeps_files_not_processes(api: httpx.Client, server: ServerProcess
                                                    ) -> None:
    sbx = Sandbox.create(timeout=120)
    sid = sbx.sandbox_id
    try:
        sbx.files.write("/home/user/notes.txt", "written before the pause")
        sbx.commands.run("sleep 3600", background=True)
        assert _pids(sbx, "sleep 3600")
        assert _detail(api, sid).get("pauseMode") is None  # running: no pause mode
        assert sbx.pause(mode="filesystem") is True
        detail = _detail(api, sid)
        assert detail["state"] == "paused" and detail["pauseMode"] == "filesystem"
        checkpoints = server.home / "sandboxes" / sid / "checkpoints"
        assert not checkpoints.exists() or _tree_bytes(checkpoints) == 0  # no memory image
        # Traffic does not wake it (auto-resume would need its memory): connect does.
        resumed = Sandbox.connect(sid, timeout=120)
        assert resumed.files.read("/home/user/notes.txt") == "written before the pause"
        assert _pids(resumed, "sleep 3600") == ""  # a fresh boot: no process survived
        assert resumed.commands.run("echo alive").stdout == "alive\n"
        assert _detail(api, sid).get("pauseMode") is None
        events = [e["fields"]["event"] for e in
                  api.get(f"/v2/sandboxes/{sid}/logs").json()["logs"] if "event" in e["fields"]]
        assert events[-2:] == ["paused", "resumed"], events
        # and it pauses and resumes as usual afterwards, with its memory this time
        resumed.commands.run("sleep 3601", background=True)
        resumed.pause()
        assert _detail(api, sid)["pauseMode"] == "full"
        again = Sandbox.connect(sid, timeout=120)
        assert _pids(again, "sleep 3601")
    finally:
        Sandbox.kill(sid)


def test_the_start_command_runs_again(api: httpx.Client) -> None:
    name = f"fsboot-{uuid.uuid4().hex[:8]}"
    Template.build(Template().from_template("base").set_start_cmd(
        "date +%s%N >> /tmp/starts; exec sleep 3603", "test -s /tmp/starts"), name)
    try:
        sbx = Sandbox.create(name, timeout=120)
        try:
            assert len(sbx.files.read("/tmp/starts").split()) == 1  # from the build
            sbx.pause(mode="filesystem")
            back = Sandbox.connect(sbx.sandbox_id, timeout=120)
            assert len(back.files.read("/tmp/starts").split()) == 2  # started again
            assert _pids(back, "sleep 3603")
        finally:
            Sandbox.kill(sbx.sandbox_id)
    finally:
        api.delete(f"/templates/{name}")


def test_reboot_of_a_full_pause(api: httpx.Client) -> None:
    sbx = Sandbox.create(timeout=120)
    sid = sbx.sandbox_id
    try:
        sbx.files.write("/tmp/kept.txt", "kept")
        sbx.commands.run("sleep 3602", background=True)
        sbx.pause()
        assert _detail(api, sid)["pauseMode"] == "full"
        rebooted = Sandbox.connect(sid, timeout=120, on_resume="reboot")
        assert rebooted.files.read("/tmp/kept.txt") == "kept"
        assert _pids(rebooted, "sleep 3602") == ""
    finally:
        Sandbox.kill(sid)


def test_timeout_pauses_without_memory(api: httpx.Client) -> None:
    sbx = Sandbox.create(timeout=3, lifecycle={"on_timeout": {"action": "pause",
                                                              "mode": "filesystem"}})
    sid = sbx.sandbox_id
    try:
        sbx.files.write("/home/user/at-expiry.txt", "x")
        # (`pauseMode` shows once the pause has finished; "paused" covers pausing too)
        wait_until(lambda: "pauseMode" in _detail(api, sid), 20, what="the auto-pause")
        assert _detail(api, sid)["pauseMode"] == "filesystem"
        logs = api.get(f"/v2/sandboxes/{sid}/logs", params={"search": "paused"}).json()["logs"]
        assert logs and logs[-1]["fields"]["reason"] == "timeout", logs
        # the proxy refuses to auto-resume it (E2B's rule), connect boots it
        resp = httpx.get(f"{api.base_url}/health", headers={"E2b-Sandbox-Id": sid})
        assert resp.status_code == 502, resp.text
        back = Sandbox.connect(sid, timeout=60)
        assert back.files.read("/home/user/at-expiry.txt") == "x"
    finally:
        Sandbox.kill(sid)
    # autoPauseMemory false cannot go with autoResume
    assert_json_error(api.post("/v2/sandboxes", json={
        "templateID": "base", "autoPause": True, "autoPauseMemory": False,
        "autoResume": {"enabled": True}}), 400)


def test_filesystem_snapshot_is_refused() -> None:
    sbx = Sandbox.create(timeout=60)
    try:
        with pytest.raises(SandboxException, match="501"):
            sbx.create_snapshot(mode="filesystem")
    finally:
        sbx.kill()


def test_size_and_time_next_to_a_full_pause(server: ServerProcess) -> None:
    """A sandbox holding 150 MiB in a process and 20 MiB of files, paused both ways."""
    rows = []
    for mode in ("full", "filesystem"):
        sbx = Sandbox.create(timeout=120)
        sid = sbx.sandbox_id
        try:
            sbx.commands.run("head -c 20M /dev/urandom > /home/user/data.bin")
            sbx.commands.run(HOLD_MEMORY, background=True)
            wait_until(lambda s=sbx: _pids(s, "bytearray"), 20, what="the memory holder")
            time.sleep(1)
            t0 = time.monotonic()
            sbx.pause(mode=mode)  # type: ignore[arg-type]
            paused_s = time.monotonic() - t0
            workspace = server.home / "sandboxes" / sid
            image = _tree_bytes(workspace / "checkpoints")
            upper = _tree_bytes(workspace / "upper")
            t0 = time.monotonic()
            back = Sandbox.connect(sid, timeout=120)
            resumed_s = time.monotonic() - t0
            assert back.commands.run("wc -c < /home/user/data.bin").stdout.strip() == "20971520"
            rows.append((mode, paused_s, resumed_s, image, upper))
        finally:
            Sandbox.kill(sid)
    for mode, paused_s, resumed_s, image, upper in rows:
        print(f"{mode:10s} pause {paused_s * 1e3:7.1f} ms  resume {resumed_s * 1e3:7.1f} ms  "
              f"memory image {image / 2**20:6.1f} MiB  writable layer {upper / 2**20:5.1f} MiB")
    full, fs = rows
    assert full[3] > 100 * 2**20 and fs[3] == 0  # the memory image is what is not written
    assert abs(full[4] - fs[4]) < 5 * 2**20  # the same writable layer either way
