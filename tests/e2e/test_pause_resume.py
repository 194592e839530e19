"""Pause and resume through the official SDK: processes keep running from where they were,
memory and files survive, and paused sandboxes survive a `kill -9` of the server."""

from __future__ import annotations

import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2b import Sandbox, SandboxQuery, SandboxState
from e2e_helpers import container_only, lose_local_state, wait_until
from sandbox_helpers import runtime_env

from aenv.devserver import ServerProcess, prepare_home, remove_home

# Written to a temporary file then renamed, so a reader never sees it half-written.
COUNTER = ("nohup bash -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/counter.tmp; "
           "mv /tmp/counter.tmp /tmp/counter; sleep 0.05; done' >/dev/null 2>&1 &")
# A python process keeping a value only in memory; it answers on a fifo with value and a
# request count, so a restart from scratch (count back to 1) would show.
HOLDER = r"""nohup python3 -c '
import os, random
secret = random.getrandbits(64); n = 0
os.mkfifo("/tmp/ask"); os.mkfifo("/tmp/answer")
while True:
    open("/tmp/ask").read(); n += 1
    with open("/tmp/answer", "w") as f: f.write(f"{secret} {n}")
' >/dev/null 2>&1 &"""
ASK = "echo > /tmp/ask & cat /tmp/answer"


def counter(s: Sandbox) -> int:
    return int(s.files.read("/tmp/counter").strip())


def keeps_counting(s: Sandbox, past: int) -> None:
    wait_until(lambda: counter(s) > past, 5, what="the counter to keep counting")


def ask(s: Sandbox) -> tuple[str, int]:
    secret, n = s.commands.run(ASK).stdout.split()
    return secret, int(n)


def test_pause_connect_resumes_processes_memory_and_files(run_id: str) -> None:
    s = Sandbox.create(metadata={"e2e-pause": run_id}, envs={"KEPT": "env"}, timeout=120)
    try:
        s.commands.run(COUNTER)
        s.commands.run(HOLDER)
        wait_until(lambda: s.files.exists("/tmp/ask"), 10, what="the holder's fifo")
        secret, n = ask(s)
        assert n == 1
        s.files.write("/home/user/before.txt", "written before pause")
        for cycle in range(2):
            before = counter(s)
            t0 = time.monotonic()
            assert s.pause() is True
            running = time.monotonic() - t0  # the counter may tick until the freeze
            assert s.get_info().state == SandboxState.PAUSED
            assert s.is_running() is False
            assert s.pause() is False  # already paused: 409 -> False
            time.sleep(1.0)  # a paused counter does not advance (20 ticks if it did)
            t0 = time.monotonic()
            s = Sandbox.connect(s.sandbox_id)
            after = counter(s)
            running += time.monotonic() - t0
            # continued, not restarted; advanced only while it ran (0.05 s a tick)
            assert before <= after <= before + 3 + running / 0.05, (before, after, running)
            keeps_counting(s, after)
            assert ask(s) == (secret, n + 1 + cycle)
            assert s.files.read("/home/user/before.txt") == "written before pause"
            assert s.commands.run("echo $KEPT").stdout == "env\n"
            assert s.get_info().state == SandboxState.RUNNING
    finally:
        s.kill()


def test_kill_a_paused_sandbox(run_id: str) -> None:
    s = Sandbox.create(metadata={"e2e-pause-kill": run_id}, timeout=60)
    assert s.pause() is True
    assert s.kill() is True
    assert Sandbox.list(query=SandboxQuery(metadata={"e2e-pause-kill": run_id})).next_items() == []


def test_expiry_with_auto_pause_false_deletes(run_id: str) -> None:
    meta = {"e2e-autopause": run_id}
    s = Sandbox.create(metadata=meta, timeout=2, lifecycle={"on_timeout": "kill"})
    try:
        wait_until(lambda: not Sandbox.list(query=SandboxQuery(metadata=meta)).next_items(), 15,
                   what="the sandbox to be deleted on expiry")
    finally:
        s.kill()


def test_connect_extends_a_running_sandbox(run_id: str) -> None:
    s = Sandbox.create(metadata={"e2e-extend": run_id}, timeout=30)
    try:
        end = s.get_info().end_at
        Sandbox.connect(s.sandbox_id, timeout=300)
        assert (s.get_info().end_at - end).total_seconds() > 200
        Sandbox.connect(s.sandbox_id, timeout=5)  # never shortens
        assert (s.get_info().end_at - end).total_seconds() > 200
    finally:
        s.kill()


@pytest.fixture
def own_home() -> Iterator[Path]:
    home = prepare_home("aenv-e2e-pause-")
    yield home
    remove_home(home)


@pytest.mark.slow
def test_paused_sandbox_survives_kill_9_of_the_server(own_home: Path) -> None:
    srv = ServerProcess(home=own_home, api_key="pause-key",
                        extra_env=runtime_env()).start(ready_timeout=300)
    opts = {"api_key": srv.api_key, "api_url": srv.url, "sandbox_url": srv.url}
    tag = {"e2e-pause-restart": uuid.uuid4().hex[:10]}
    try:
        s = Sandbox.create(metadata=tag, timeout=300, **opts)
        s.commands.run(COUNTER)
        s.files.write("/home/user/keep.txt", "survives")
        wait_until(lambda: s.files.exists("/tmp/counter"), 5, what="the counter")
        assert s.pause() is True
        srv.stop(sig=signal.SIGKILL)
        srv = ServerProcess(home=own_home, port=srv.port, api_key=srv.api_key,
                            extra_env=runtime_env()).start(ready_timeout=300)
        listed = Sandbox.list(query=SandboxQuery(metadata=tag), **opts).next_items()
        assert [(x.sandbox_id, x.state) for x in listed] == [(s.sandbox_id, SandboxState.PAUSED)]
        for _ in range(2):  # and it still pauses and resumes after the restart
            again = Sandbox.connect(s.sandbox_id, **opts)
            assert again.files.read("/home/user/keep.txt") == "survives"
            keeps_counting(again, counter(again))
            assert again.pause() is True
        assert Sandbox.kill(s.sandbox_id, **opts) is True
    finally:
        srv.shutdown()


def test_auto_resume_on_traffic(run_id: str) -> None:
    s = Sandbox.create(metadata={"e2e-autoresume": run_id}, timeout=60,
                       lifecycle={"on_timeout": "pause", "auto_resume": True})
    try:
        s.files.write("/home/user/a.txt", "still here")
        assert s.pause() is True
        # no connect(): the first envd request resumes it
        assert s.files.read("/home/user/a.txt") == "still here"
        assert s.get_info().state == SandboxState.RUNNING
    finally:
        s.kill()


def test_no_auto_resume_by_default(run_id: str) -> None:
    s = Sandbox.create(metadata={"e2e-noautoresume": run_id}, timeout=60)
    try:
        assert s.pause() is True
        assert s.is_running() is False  # traffic does not wake it
        assert s.get_info().state == SandboxState.PAUSED
    finally:
        s.kill()


# An open 4 MiB file whose name was removed: larger than CRIU's ghost-file limit (1 MiB), so
# the dump fails. A real, reproducible checkpoint failure.
UNDUMPABLE = ("nohup python3 -c 'import os, time; f = open(\"/tmp/gone\", \"w\"); "
              "f.write(\"x\" * (4 << 20)); f.flush(); os.unlink(\"/tmp/gone\"); "
              "time.sleep(1e9)' >/dev/null 2>&1 &")


@container_only
def test_a_failed_pause_loses_nothing(run_id: str) -> None:
    meta = {"e2e-pause-fails": run_id}
    s = Sandbox.create(metadata=meta, timeout=3)
    try:
        s.files.write("/home/user/precious.txt", "keep me")
        s.commands.run(UNDUMPABLE)
        time.sleep(0.5)
        with pytest.raises(Exception, match="500"):
            s.pause()
        assert s.get_info().state == SandboxState.RUNNING
        # on expiry the pause fails too: the sandbox keeps running and is retried later
        wait_until(lambda: s.get_info().end_at.timestamp() > time.time() + 10, 15,
                   what="the failed expiry pause to push the end time back")
        assert s.get_info().state == SandboxState.RUNNING
        assert s.files.read("/home/user/precious.txt") == "keep me"
    finally:
        s.kill()


def paused_entries(home: Path, sandbox_id: str) -> list[str]:
    """The repository's entries holding a paused sandbox's state (posix_fs: $home/repository)."""
    manifests = home / "repository" / "meta" / "manifests"
    return sorted(p.name for p in manifests.glob(f"paused-{sandbox_id}-*.json"))


@pytest.mark.slow
def test_a_paused_sandbox_survives_the_loss_of_its_local_files(own_home: Path) -> None:
    """After a pause, the sandbox's paused state goes to the snapshot repository in the
    background (a container: checkpoint image and writable layer, two entries; a VM: saved
    state, RAM and disk, one). A node that then loses the sandbox's workspace and cgroups,
    and restarts, still resumes it: processes, memory and files."""
    entries = 2 if "AENV_RUNTIME_DRIVER" not in runtime_env() else 1
    srv = ServerProcess(home=own_home, api_key="pause-key",
                        extra_env=runtime_env()).start(ready_timeout=300)
    opts = {"api_key": srv.api_key, "api_url": srv.url, "sandbox_url": srv.url}
    try:
        s = Sandbox.create(timeout=300, **opts)
        s.commands.run(COUNTER)
        s.commands.run(HOLDER)
        s.files.write("/home/user/keep.txt", "survives the disk")
        wait_until(lambda: s.files.exists("/tmp/ask"), 10, what="the holder's fifo")
        secret, _ = ask(s)
        before = counter(s)
        assert s.pause() is True
        wait_until(lambda: len(paused_entries(own_home, s.sandbox_id)) == entries, 30,
                   what="the paused state in the repository")
        srv.stop(sig=signal.SIGKILL)
        lose_local_state(own_home, s.sandbox_id)
        srv = ServerProcess(home=own_home, port=srv.port, api_key=srv.api_key,
                            extra_env=runtime_env(AENV_SNAPSHOT_GC_INTERVAL_S="2")
                            ).start(ready_timeout=300)
        again = Sandbox.connect(s.sandbox_id, **opts)
        assert again.files.read("/home/user/keep.txt") == "survives the disk"
        assert counter(again) >= before
        keeps_counting(again, counter(again))
        assert ask(again) == (secret, 2)  # the same process, its memory intact
        # Resumed: the copies in the repository are no longer needed.
        wait_until(lambda: not paused_entries(own_home, s.sandbox_id), 10,
                   what="the paused state to leave the repository")
        # Killing a paused sandbox removes its copy too.
        assert again.pause() is True
        wait_until(lambda: len(paused_entries(own_home, s.sandbox_id)) == entries, 30,
                   what="the second pause's state in the repository")
        blobs = own_home / "repository" / "blobs"
        assert any(p.is_file() for p in blobs.rglob("*"))
        assert Sandbox.kill(s.sandbox_id, **opts) is True
        wait_until(lambda: not paused_entries(own_home, s.sandbox_id), 10,
                   what="the killed sandbox's state to leave the repository")
        # ... and the server's periodic gc deletes the chunks nothing references any more.
        wait_until(lambda: not any(p.is_file() for p in blobs.rglob("*")), 20,
                   what="the repository gc to delete the unreferenced chunks")
    finally:
        srv.shutdown()
