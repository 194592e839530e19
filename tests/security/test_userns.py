"""Attacks through a sandbox's files on the host (issue 11, finding 1), and what user
namespaces change inside a sandbox.

Root in a sandbox writes into its writable layer, which sits in the server's home on the
host: `<home>/sandboxes/<id>/upper`. Before the fix a setuid-root copy of bash made there
(`cp /bin/bash /tmp/rb && chmod 4755 /tmp/rb`) gave any local user who ran it euid 0, and
device nodes made with `mknod` opened host devices. Now the home is mounted nosuid,nodev
(always), and with `security.userns` root inside is host uid 1000000: what it makes is
owned by that uid on disk. The attacker on the host is uid 65534 twice over: as a plain local
user, and with CAP_DAC_OVERRIDE (so that a 0700 home does not hide the file and only the
mount flags and the owner are tested). Positive controls: the setuid file exists with its
setuid bit; the same probe against a setuid copy on a filesystem that allows setuid does
give euid 0; setuid programs still work inside the sandbox.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2b import Sandbox
from sandbox_helpers import runtime_env

from aenv.devserver import ServerProcess, own_server, prepare_home, remove_home

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
# The same user, able to read and search every directory (a 0700 home hides nothing).
NOBODY_DAC = [*NOBODY, "--inh-caps=+dac_override", "--ambient-caps=+dac_override"]
ROOT_ID = 1_000_000  # SecurityConfig.userns_host_id's default
MAKE_SETUID_BASH = "cp /bin/bash /tmp/rb && chmod 4755 /tmp/rb"


def run_as(prefix: list[str], *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*prefix, *argv], capture_output=True, text=True, timeout=30,
                          check=False)


def euid_through(prefix: list[str], program: Path) -> str:
    """What `program -p -c 'id -u'` prints when a host user runs it ('' if it cannot)."""
    return run_as(prefix, str(program), "-p", "-c", "id -u").stdout.strip()


def upper_of(srv: ServerProcess, s: Sandbox) -> Path:
    upper = srv.home / "sandboxes" / s.sandbox_id / "upper"
    assert upper.is_dir(), f"no writable layer at {upper}"
    return upper


def opts(srv: ServerProcess) -> dict[str, str]:
    return {"api_key": srv.api_key, "api_url": srv.url, "sandbox_url": srv.url}


@pytest.fixture
def suid_probe_control() -> Iterator[Path]:
    """A setuid-root bash on a host filesystem that allows setuid (a 0700 directory only
    the DAC-capable attacker can enter): the probe must show euid 0 there."""
    with tempfile.TemporaryDirectory(prefix="aenv-suid-control-") as tmp:
        os.chmod(tmp, 0o700)
        rb = Path(tmp) / "rb"
        shutil.copy2("/bin/bash", rb)
        rb.chmod(0o4755)
        if os.statvfs(tmp).f_flag & os.ST_NOSUID:
            pytest.skip(f"{tmp} is on a nosuid filesystem: no positive control here")
        yield rb


def assert_inert_setuid(srv: ServerProcess, s: Sandbox, control: Path) -> Path:
    s.commands.run(MAKE_SETUID_BASH, user="root")
    rb = upper_of(srv, s) / "tmp" / "rb"
    # Positive controls: the file is there, setuid; the probe works on a setuid-able copy.
    st = rb.stat()
    assert st.st_mode & stat.S_ISUID and stat.S_IMODE(st.st_mode) == 0o4755, oct(st.st_mode)
    assert euid_through(NOBODY_DAC, control) == "0", "the setuid probe itself is broken"
    # Inside, the setuid bit still works (the root overlay is a mount of its own).
    inside = s.commands.run("/tmp/rb -p -c 'id -u'", user="user").stdout.strip()
    assert inside == "0", f"setuid inside the sandbox gave euid {inside}"
    # The attack: run it on the host as a local user.
    assert euid_through(NOBODY, rb) != "0", "a local user got euid 0 through a sandbox file"
    got = euid_through(NOBODY_DAC, rb)
    assert got == "65534", f"through the sandbox's file a host user ran with euid {got!r}"
    assert os.statvfs(rb).f_flag & os.ST_NOSUID, f"{rb} is on a mount that honours setuid"
    return rb


def assert_inert_device(srv: ServerProcess, s: Sandbox) -> None:
    """A character device made inside (1:5, /dev/zero: harmless if the fix is broken) is no
    way into the host's devices: either mknod fails inside, or the node cannot be opened
    through the home."""
    out = s.commands.run("mknod /tmp/dev c 1 5 2>&1; echo rc=$?", user="root").stdout
    node = upper_of(srv, s) / "tmp" / "dev"
    if "rc=0" not in out:
        assert not node.exists(), "mknod failed inside but a node is on the host"
        return
    st = node.stat()
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 5)  # it is there
    with pytest.raises(PermissionError):
        os.open(node, os.O_RDONLY)  # even host root, through the nodev home
    assert os.statvfs(node).f_flag & os.ST_NODEV, f"{node} is on a mount that opens devices"


# --------------------------------------------------------------------------- every server


def test_setuid_file_made_by_sandbox_root_is_inert_on_the_host(
        server: ServerProcess, suid_probe_control: Path) -> None:
    s = Sandbox.create(timeout=120)
    try:
        assert_inert_setuid(server, s, suid_probe_control)
    finally:
        s.kill()


def test_device_node_made_by_sandbox_root_is_inert_on_the_host(server: ServerProcess) -> None:
    s = Sandbox.create(timeout=120)
    try:
        assert_inert_device(server, s)
    finally:
        s.kill()


@pytest.fixture(scope="module")
def host_fs_server() -> Iterator[ServerProcess]:
    """A server whose sandbox storage is the home's own filesystem (the host's, which
    honours setuid and devices: no storage volume), as on an ext4 install with
    storage.volume = "off": the driver makes the home a nosuid,nodev bind mount."""
    saved = os.environ.get("AENV_TEST_FS")
    os.environ["AENV_TEST_FS"] = "host"
    try:
        home = prepare_home("aenv-sec-hostfs-")
    finally:
        if saved is None:
            os.environ.pop("AENV_TEST_FS")
        else:
            os.environ["AENV_TEST_FS"] = saved
    assert not os.statvfs(home).f_flag & os.ST_NOSUID, "the host filesystem is nosuid already"
    srv = ServerProcess(home=home, api_key="hostfs-key", extra_env=runtime_env(
        AENV_STORAGE_VOLUME="off", AENV_RUNTIME_READY_POOL="0"))
    try:
        srv.start(ready_timeout=300)
        yield srv
        srv.shutdown()
        assert not os.path.ismount(home), "the home's bind mount outlived the server"
    finally:
        srv.shutdown()
        remove_home(home)


def test_on_the_hosts_own_filesystem_too(host_fs_server: ServerProcess,
                                         suid_probe_control: Path) -> None:
    s = Sandbox.create(timeout=120, **opts(host_fs_server))
    try:
        assert_inert_setuid(host_fs_server, s, suid_probe_control)
        assert_inert_device(host_fs_server, s)
    finally:
        s.kill()


# --------------------------------------------------------------------------- user namespaces


@pytest.fixture(scope="module")
def userns_server() -> Iterator[ServerProcess]:
    # A small ready pool: sandboxes are claimed from it as on a default server.
    with own_server("aenv-sec-userns-", runtime_env(
            AENV_SECURITY_USERNS="1", AENV_RUNTIME_READY_POOL="2"), api_key="userns-key") as srv:
        yield srv


@pytest.fixture(scope="module")
def in_userns(userns_server: ServerProcess) -> Iterator[Sandbox]:
    s = Sandbox.create(timeout=300, **opts(userns_server))
    try:
        yield s
    finally:
        s.kill()


def test_root_inside_maps_to_the_node_range(in_userns: Sandbox) -> None:
    fields = in_userns.commands.run("cat /proc/self/uid_map /proc/self/gid_map").stdout.split()
    assert fields == ["0", str(ROOT_ID), "65536"] * 2, fields  # not "0 0 4294967295"
    ids = in_userns.commands.run("id -u; id -g", user="root").stdout.split()
    assert ids == ["0", "0"]


def test_files_made_inside_are_owned_by_shifted_ids_on_disk(
        userns_server: ServerProcess, in_userns: Sandbox) -> None:
    s = in_userns
    s.commands.run("echo r > /tmp/by-root", user="root")
    s.commands.run("echo u > /tmp/by-user", user="user")
    uid = int(s.commands.run("id -u", user="user").stdout)
    upper = upper_of(userns_server, s)
    assert (upper / "tmp/by-root").stat().st_uid == ROOT_ID
    assert (upper / "tmp/by-user").stat().st_uid == ROOT_ID + uid
    # The template's files (host uid 0 on disk) show as root's inside.
    assert s.commands.run("stat -c %u:%g /bin/bash /etc /").stdout.split() == ["0:0"] * 3


def test_setuid_file_made_by_sandbox_root_is_owned_by_an_unprivileged_uid(
        userns_server: ServerProcess, in_userns: Sandbox, suid_probe_control: Path) -> None:
    rb = assert_inert_setuid(userns_server, in_userns, suid_probe_control)
    assert rb.stat().st_uid == ROOT_ID  # even on a setuid mount: euid 1000000, not 0


def test_mknod_of_a_device_fails_inside(userns_server: ServerProcess,
                                        in_userns: Sandbox) -> None:
    out = in_userns.commands.run("mknod /tmp/blk b 7 0 2>&1; echo rc=$?", user="root").stdout
    assert "rc=0" not in out and "Operation not permitted" in out, out
    assert_inert_device(userns_server, in_userns)


def test_root_inside_still_works_as_root(in_userns: Sandbox) -> None:
    s = in_userns
    run = s.commands.run
    assert run("touch /tmp/c && chown 1000:1000 /tmp/c && stat -c %u:%g /tmp/c",
               user="root").stdout.strip() == "1000:1000"
    assert run("su -s /bin/sh -c 'id -u' user", user="root").stdout.strip() == "1000"
    assert run("sudo -n id -u", user="user").stdout.strip() == "0"  # setuid sudo
    served = run("python3 -c \"import socket; s = socket.socket(); s.bind(('0.0.0.0', 80)); "
                 "print('bound', s.getsockname()[1])\"", user="root").stdout.strip()
    assert served == "bound 80"
    # ping's ICMP datagram sockets (no CAP_NET_RAW needed: ping_group_range)
    pinged = run("python3 -c \"import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM, "
                 "socket.IPPROTO_ICMP); print('icmp ok')\"", user="user").stdout.strip()
    assert pinged == "icmp ok"


def test_pause_is_refused_with_the_reason(in_userns: Sandbox) -> None:
    """CRIU 4.2.1 cannot checkpoint these sandboxes (checkpoint.USERNS_NOT_CHECKPOINTABLE):
    the refusal says so, and the sandbox keeps running."""
    with pytest.raises(Exception, match="user namespace"):
        in_userns.pause()
    assert in_userns.commands.run("echo alive").stdout.strip() == "alive"
