"""Attack: a sandbox fills the disk. Its writable layer is bounded by its disk size (here a
server whose sandboxes have 256 MiB): writing past it fails inside the sandbox with
EDQUOT/ENOSPC, and the host's free space drops by about the quota at most. Before the fix a
sandbox advertising 4 GiB wrote 6 GiB and took exactly that from the host's free space.
The bound holds for fork children (each their own) and after a pause and resume.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TypedDict

import pytest
from e2b import Sandbox
from sandbox_helpers import runtime_env

from aenv.devserver import ServerProcess, own_server

DISK_MB = 256
FILL = "dd if=/dev/zero of=/home/user/fill bs=1M count={mb} conv=fsync 2>&1; echo rc=$?"
REFUSED = re.compile(r"Disk quota exceeded|No space left on device")


@pytest.fixture(scope="module")
def small_disks() -> Iterator[ServerProcess]:
    with own_server("aenv-sec-quota-", runtime_env(AENV_SANDBOX_DISK_SIZE_MB=str(DISK_MB)),
                    api_key="quota-key") as srv:
        yield srv


class ServerOpts(TypedDict):
    api_key: str
    api_url: str
    sandbox_url: str


def opts(srv: ServerProcess) -> ServerOpts:
    return {"api_key": srv.api_key, "api_url": srv.url, "sandbox_url": srv.url}


def host_free(path: Path) -> int:
    """Free bytes of the host filesystem that holds the server's home (and its database)."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fill(s: Sandbox, mb: int) -> tuple[str, int]:
    out = s.commands.run(FILL.format(mb=mb), timeout=120).stdout
    rc = int(out.rsplit("rc=", 1)[1])
    return out, rc


def assert_bounded(s: Sandbox, what: str) -> None:
    out, rc = fill(s, 4 * DISK_MB)
    assert rc != 0 and REFUSED.search(out), f"{what}: writing 4x the disk size succeeded: {out}"
    written = int(s.commands.run("stat -c %s /home/user/fill").stdout)
    assert written <= DISK_MB * 2**20, f"{what}: {written} bytes written past a {DISK_MB} MiB disk"
    # The sandbox keeps working once it deletes what filled it.
    again = s.commands.run("rm /home/user/fill && sync && echo fine > /home/user/after && "
                           "cat /home/user/after")
    assert again.stdout.strip() == "fine"


def test_writes_past_the_disk_size_fail_inside_and_spare_the_host(
        small_disks: ServerProcess) -> None:
    s = Sandbox.create(timeout=300, **opts(small_disks))
    try:
        # Positive control: writing within the disk works.
        out, rc = fill(s, DISK_MB // 4)
        assert rc == 0, out
        s.commands.run("rm /home/user/fill")
        before = host_free(small_disks.home.parent)
        out, rc = fill(s, 4 * DISK_MB)
        after = host_free(small_disks.home.parent)
        assert rc != 0 and REFUSED.search(out), f"no error writing 4x the disk: {out}"
        # Host-side slack: btrfs metadata, other tests' writes meanwhile.
        assert before - after < DISK_MB * 2**20 + (256 << 20), \
            f"host free space dropped by {(before - after) >> 20} MiB for a {DISK_MB} MiB disk"
        s.commands.run("rm /home/user/fill")
        assert_bounded(s, "a new sandbox")
    finally:
        s.kill()


def test_fork_children_and_a_resumed_sandbox_keep_the_limit(
        small_disks: ServerProcess) -> None:
    s = Sandbox.create(timeout=300, **opts(small_disks))
    children: list[Sandbox] = []
    try:
        # The parent already holds half its disk: a child's quota is its own writes only.
        out, rc = fill(s, DISK_MB // 2)
        assert rc == 0, out
        s.commands.run("mv /home/user/fill /home/user/parent-data")
        children = [c for c in s.fork(count=2) if isinstance(c, Sandbox)]
        assert len(children) == 2
        for i, child in enumerate(children):
            assert child.commands.run("stat -c %s /home/user/parent-data").stdout.strip() == \
                str(DISK_MB // 2 * 2**20)
            assert_bounded(child, f"copy {i}")
        assert s.pause() is True
        resumed = s.connect(timeout=300)
        resumed.commands.run("rm /home/user/parent-data")
        assert_bounded(resumed, "the resumed sandbox")
    finally:
        for child in children:
            child.kill()
        s.kill()
