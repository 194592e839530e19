"""Snapshots and fork through the official SDK: a running sandbox captured with a brief pause,
new sandboxes started from the capture, and forks that inherit memory, processes, files and
environment while staying independent of each other and of the parent."""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox, SandboxQuery
from e2e_helpers import container_only, wait_until
from test_pause_resume import HOLDER, ask

from aenv.devserver import ServerProcess
from aenv.runtime.container import linux
from aenv.runtime.container.layers import remove_layer


def _sealed_roots(server: ServerProcess, snapshot_id: str) -> list[Path]:
    """The local sealed layers of a snapshot (directories under the home's layers/)."""
    tpl = httpx.get(f"{server.url}/snapshots/{snapshot_id}",
                    headers={"X-API-Key": server.api_key}).json()
    assert tpl["snapshotID"] == snapshot_id, tpl
    return sorted({server.home / "layers" / layer.split("/")[0] for layer in tpl["layers"]
                   if layer.startswith("seal-")})


def _setup_parent(run_id: str) -> tuple[Sandbox, int, str, int]:
    """A parent with a file, a live shell holding an exported variable, and a python process
    holding a secret in memory. Returns (parent, shell pid, secret, requests answered)."""
    parent = Sandbox.create(metadata={"e2e-fork": run_id}, envs={"FROM_CREATE": "yes"},
                            timeout=180)
    parent.files.write("/home/user/setup.txt", "expensive setup done")
    shell = parent.commands.run("bash", background=True, stdin=True, timeout=0)
    parent.commands.send_stdin(shell.pid, "export LIVE=set-in-a-live-shell\n")
    shell.disconnect()
    parent.commands.run(HOLDER)
    wait_until(lambda: parent.files.exists("/tmp/ask"), 10, what="the holder's fifo")
    secret, n = ask(parent)
    return parent, shell.pid, secret, n


def _live_var(s: Sandbox, shell_pid: int) -> str:
    s.commands.send_stdin(shell_pid, "echo $LIVE > /tmp/live\n")
    wait_until(lambda: s.files.exists("/tmp/live") and s.files.read("/tmp/live").strip(), 10,
               what="the live shell to answer")
    return s.files.read("/tmp/live").strip()


@pytest.mark.slow
def test_fork_sixteen_children_inherit_everything_and_stay_independent(run_id: str) -> None:
    parent, shell_pid, secret, n = _setup_parent(run_id)
    children: list[Sandbox] = []
    try:
        results = parent.fork(count=16)
        children = [c for c in results if isinstance(c, Sandbox)]
        assert len(children) == 16, [r for r in results if not isinstance(r, Sandbox)]
        ids = {c.sandbox_id for c in children}
        assert len(ids) == 16 and parent.sandbox_id not in ids

        def check(child: Sandbox) -> None:
            assert child.files.read("/home/user/setup.txt") == "expensive setup done"
            assert _live_var(child, shell_pid) == "set-in-a-live-shell"
            assert ask(child) == (secret, n + 1)  # memory carried over, process kept running
            assert child.commands.run("echo $FROM_CREATE; hostname").stdout.split() == [
                "yes", child.sandbox_id]

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(check, children))
        children[0].files.write("/home/user/only-in-child-0.txt", "mine")
        assert not any(c.files.exists("/home/user/only-in-child-0.txt") for c in children[1:4])
        assert not parent.files.exists("/home/user/only-in-child-0.txt")
        # the parent kept running with its own state
        assert ask(parent) == (secret, n + 1)
        assert _live_var(parent, shell_pid) == "set-in-a-live-shell"
        listed = Sandbox.list(query=SandboxQuery(metadata={"e2e-fork": run_id}),
                              limit=100).next_items()
        assert len(listed) == 17
    finally:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda s: s.kill(), [parent, *children]))


def test_snapshot_create_from_it_list_and_delete(run_id: str) -> None:
    source = Sandbox.create(metadata={"e2e-snap": run_id}, timeout=120)
    copies: list[Sandbox] = []
    try:
        source.files.write("/home/user/state.txt", "v1")
        snap = source.create_snapshot(name=f"snap-{run_id}")
        assert snap.names == [f"snap-{run_id}"]
        source.files.write("/home/user/state.txt", "v2 after the snapshot")
        listed = Sandbox.list_snapshots(sandbox_id=source.sandbox_id).next_items()
        assert [x.snapshot_id for x in listed] == [snap.snapshot_id]
        for template in (snap.snapshot_id, f"snap-{run_id}"):  # by id and by name
            copy = Sandbox.create(template, timeout=60)
            copies.append(copy)
            assert copy.files.read("/home/user/state.txt") == "v1"
            assert copy.commands.run("hostname").stdout.strip() == copy.sandbox_id
        copies[0].files.write("/home/user/state.txt", "changed in a copy")
        assert copies[1].files.read("/home/user/state.txt") == "v1"
        assert source.files.read("/home/user/state.txt") == "v2 after the snapshot"
        assert Sandbox.delete_snapshot(snap.snapshot_id) is True
        assert Sandbox.delete_snapshot(snap.snapshot_id) is False
        assert Sandbox.list_snapshots(sandbox_id=source.sandbox_id).next_items() == []
        # sandboxes made from a deleted snapshot keep running
        assert copies[0].commands.run("echo ok").stdout == "ok\n"
    finally:
        for s in (source, *copies):
            s.kill()


def test_fork_of_a_paused_or_unknown_sandbox_is_refused(run_id: str) -> None:
    s = Sandbox.create(metadata={"e2e-fork-bad": run_id}, timeout=60)
    try:
        assert s.pause() is True
        with pytest.raises(Exception, match="409|paused"):
            s.fork(count=2)
        with pytest.raises(Exception, match="count"):
            Sandbox.connect(s.sandbox_id).fork(count=0)
    finally:
        s.kill()


@container_only
def test_snapshot_is_in_the_repository_and_survives_a_wiped_cache(
        run_id: str, server: ServerProcess, api: httpx.Client) -> None:
    source = Sandbox.create(metadata={"e2e-repo": run_id}, timeout=120)
    copies: list[Sandbox] = []
    try:
        source.files.write("/home/user/big.bin", os.urandom(4 << 20))
        first = source.create_snapshot()
        source.files.write("/home/user/small.txt", "a small change")
        second = source.create_snapshot()
        # Listed at once, pushed to the repository in the background, in order.
        for snap in (first, second):
            wait_until(lambda s=snap: api.get(f"/snapshots/{s.snapshot_id}").json()[
                "inRepository"], 120, what=f"snapshot {snap.snapshot_id} in the repository")
        info1 = api.get(f"/snapshots/{first.snapshot_id}").json()
        info2 = api.get(f"/snapshots/{second.snapshot_id}").json()
        # incremental: the second snapshot stores only what changed since the first
        assert info1["storedBytes"] > 4 << 20
        assert info2["storedBytes"] < info2["sizeBytes"] / 4, (info1, info2)
        # the local cache is only a cache: wipe it (the image and its sealed layer), and the
        # snapshot comes back from the repository
        shutil.rmtree(server.home / "cache" / "snapshots" / second.snapshot_id)
        (sealed,) = _sealed_roots(server, second.snapshot_id)
        remove_layer(sealed)
        copy = Sandbox.create(second.snapshot_id, timeout=60)
        copies.append(copy)
        assert copy.files.read("/home/user/small.txt") == "a small change"
        assert len(copy.files.read("/home/user/big.bin", format="bytes")) == 4 << 20
        assert sealed.is_dir()  # pulled back
        for snap in (first, second):
            assert Sandbox.delete_snapshot(snap.snapshot_id) is True
    finally:
        for s in (source, *copies):
            s.kill()


@container_only
def test_a_snapshot_seals_the_writable_layer_and_copies_share_it(
        run_id: str, server: ServerProcess) -> None:
    """No copy: the source's writable layer becomes a read-only layer (on btrfs a subvolume
    snapshot) that every copy stacks under its own, empty, writable layer."""
    source = Sandbox.create(metadata={"e2e-seal": run_id}, timeout=120)
    copies: list[Sandbox] = []
    try:
        source.files.write("/home/user/shared.bin", os.urandom(1 << 20))
        snap = source.create_snapshot()
        (sealed,) = _sealed_roots(server, snap.snapshot_id)
        assert (sealed / "upper/home/user/shared.bin").stat().st_size == 1 << 20
        if linux.on_btrfs(str(server.home)):
            assert linux.is_subvolume(str(sealed))
            with pytest.raises(OSError, match="Read-only"):
                (sealed / "upper/tmp-probe").write_text("x")
        copies = [Sandbox.create(snap.snapshot_id, timeout=60) for _ in range(2)]
        for copy in copies:
            upper = server.home / "sandboxes" / copy.sandbox_id / "upper"
            assert not (upper / "home/user/shared.bin").exists()  # not copied up
            assert len(copy.files.read("/home/user/shared.bin", format="bytes")) == 1 << 20
        copies[0].files.write("/home/user/shared.bin", "rewritten")
        assert (server.home / "sandboxes" / copies[0].sandbox_id / "upper/home/user/shared.bin"
                ).read_text() == "rewritten"
        assert len(copies[1].files.read("/home/user/shared.bin", format="bytes")) == 1 << 20
        assert Sandbox.delete_snapshot(snap.snapshot_id) is True
        assert sealed.exists()  # copies still run on it
        for copy in copies:
            copy.kill()
        assert not sealed.exists()  # the last user is gone: the layer is collected
    finally:
        for s in (source, *copies):
            s.kill()


@container_only
def test_a_chain_of_snapshots_is_compacted_past_the_depth_limit(
        run_id: str, server: ServerProcess) -> None:
    """Snapshot of a copy of a snapshot of ... : each adds a sealed layer on top; past
    snapshot.max_sealed_layers (8) they are merged into one, with the same view of the files
    (additions, rewrites and deletions across layers, an opaque directory)."""
    # Sealed layers of templates other suites left on the session server (code-interpreter-v1)
    # are not this test's.
    sealed_before = set((server.home / "layers").glob("seal-*"))
    sandbox = Sandbox.create(metadata={"e2e-chain": run_id}, timeout=120)
    made: list[Sandbox] = [sandbox]
    snaps: list[str] = []
    try:
        for level in range(10):
            sandbox.files.write(f"/home/user/level-{level}.txt", f"written at {level}")
            sandbox.files.write("/home/user/latest.txt", str(level))
            if level:
                sandbox.files.remove(f"/home/user/level-{level - 1}.txt")
            if level == 4:  # a directory of the base replaced wholesale: opaque in the upper
                sandbox.commands.run("sudo rm -rf /etc/apt && sudo mkdir /etc/apt && "
                                     "sudo touch /etc/apt/only-this")
            sandbox.commands.run("sudo rm -f /etc/debian_version" if level == 2 else "true")
            snap = sandbox.create_snapshot()
            snaps.append(snap.snapshot_id)
            sandbox = Sandbox.create(snap.snapshot_id, timeout=120)
            made.append(sandbox)
        roots = _sealed_roots(server, snaps[-1])
        assert len(roots) <= 8, roots  # compacted
        assert any(r.name.endswith("-merged") for r in roots)
        def out(cmd: str) -> list[str]:
            return sandbox.commands.run(cmd).stdout.split()

        assert out("ls /home/user") == ["latest.txt", "level-9.txt"]
        assert out("ls /etc/apt") == ["only-this"]  # the base's /etc/apt stays hidden
        assert out("cat /home/user/latest.txt; echo; test -e /etc/debian_version || echo gone"
                   ) == ["9", "gone"]
        assert sandbox.files.read("/home/user/level-9.txt") == "written at 9"
    finally:
        for s in made:
            s.kill()
        for snapshot_id in snaps:
            Sandbox.delete_snapshot(snapshot_id)
    left = set((server.home / "layers").glob("seal-*")) - sealed_before
    assert not left, f"sealed layers left behind: {sorted(p.name for p in left)}"
