"""Finding 5 of issue 11: no seccomp filter. Hostile code reached every syscall: the default
user made a user namespace and mounted in it (`unshare -Urm`), opened keyrings, perf
counters and io_urings. Attacks through the official SDK, as the default user and as root;
each reports the errno it got, and ordinary work runs alongside as positive controls. The
filter must stay in force across pause/resume and in fork children (CRIU restores it).

Against a server started with AENV_SECURITY_SECCOMP=0 (the code before the fix) every attack
here succeeds or fails with the kernel's own errno, and these tests fail.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from e2b import CommandExitException, PtySize, Sandbox
from e2e_helpers import container_only, wait_until

pytestmark = container_only  # the microVM runtime's boundary is its guest kernel

PROBE = (Path(__file__).parent / "seccomp_probe.py").read_text()

# What each attack must get under the filter: EPERM, as Docker's default profile answers;
# clone3 ENOSYS, so that libc falls back to clone (whose flags the filter can check).
REFUSED = {
    "unshare_user_mount": "EPERM", "unshare_user": "EPERM", "clone_newuser": "EPERM",
    "setns": "EPERM", "mount_missing_target": "EPERM", "pivot_root_missing": "EPERM",
    "fsopen_bad_flags": "EPERM", "keyctl_join_session": "EPERM", "add_key": "EPERM",
    "request_key": "EPERM", "bpf_bad_command": "EPERM", "perf_event_open": "EPERM",
    "userfaultfd_user_mode": "EPERM", "io_uring_setup": "EPERM", "open_by_handle_at": "EPERM",
    "kcmp_bad_type": "EPERM", "clone3_null": "ENOSYS", "personality_no_aslr": "EPERM",
    "socket_alg": "EPERM", "socket_vsock": "EPERM", "socket_tipc": "EPERM",
}
# The same interfaces as ordinary programs use them.
ALLOWED = ("personality_query", "socket_unix", "socket_inet", "socket_inet6", "socket_netlink")


def run(sbx: Sandbox, cmd: str, user: str = "user", timeout: float = 60) -> tuple[int, str]:
    """exit code and stdout+stderr of `cmd`, whatever the exit code."""
    try:
        res = sbx.commands.run(cmd, user=user, timeout=timeout)
        return res.exit_code, res.stdout + res.stderr
    except CommandExitException as exc:
        return exc.exit_code, exc.stdout + exc.stderr


def seccomp_mode(status: str) -> str:
    match = re.search(r"^Seccomp:\s+(\d)", status, re.MULTILINE)
    assert match, status
    return match.group(1)


def probe(sbx: Sandbox, user: str) -> dict[str, Any]:
    sbx.files.write("/tmp/seccomp_probe.py", PROBE)
    code, out = run(sbx, "python3 /tmp/seccomp_probe.py", user=user)
    assert code == 0, out
    result: dict[str, Any] = json.loads(out)
    return result


def assert_filtered(sbx: Sandbox, user: str = "user") -> dict[str, Any]:
    """Every attack refused with its errno; every control worked."""
    seen = probe(sbx, user)
    got = {name: seen[name] for name in REFUSED}
    assert got == REFUSED, f"as {user}, {seen['status']}: " + ", ".join(
        f"{name}: {seen[name]!r}" for name in REFUSED if seen[name] != REFUSED[name])
    assert seen["status"]["Seccomp"].strip() == "2", seen["status"]
    assert all(isinstance(seen[name], int) for name in ALLOWED), seen
    return seen


@pytest.fixture(scope="module")
def sbx() -> Iterator[Sandbox]:
    sandbox = Sandbox.create(metadata={"security": "seccomp"}, timeout=600)
    try:
        yield sandbox
    finally:
        sandbox.kill()


def test_envd_and_every_command_run_under_the_filter(sbx: Sandbox) -> None:
    assert seccomp_mode(sbx.files.read("/proc/1/status")) == "2"  # envd, pid 1
    for user in ("user", "root"):
        code, out = run(sbx, "cat /proc/self/status", user=user)
        assert code == 0 and seccomp_mode(out) == "2", out
    # A background process and its children inherit it (nothing starts unfiltered).
    code, out = run(sbx, "bash -c 'sleep 30 & cat /proc/$!/status; kill $!'")
    assert code == 0 and seccomp_mode(out) == "2", out


@pytest.mark.parametrize("user", ["user", "root"])
def test_unshare_command_is_refused(sbx: Sandbox, user: str) -> None:
    for cmd in ("unshare -Urm true", "unshare -U true", "unshare -m true"):
        code, out = run(sbx, cmd, user=user)
        assert code != 0 and "Operation not permitted" in out, (user, cmd, code, out)
    # Positive control: the binary itself runs; only the syscall is refused.
    code, out = run(sbx, "unshare --version", user=user)
    assert code == 0 and "util-linux" in out, out


@pytest.mark.parametrize("user", ["user", "root"])
def test_kernel_attack_surface_is_refused_with_the_expected_errno(sbx: Sandbox,
                                                                   user: str) -> None:
    assert_filtered(sbx, user)


def test_ordinary_work_still_runs(sbx: Sandbox) -> None:
    script = r"""
set -e
cd /tmp && rm -rf work && mkdir work && cd work
python3 - <<'EOF'
import concurrent.futures, multiprocessing, os, subprocess, tarfile, threading, zipfile
# pip-style file work: a wheel-like zip unpacked, a tarball, renames, modes, symlinks
with zipfile.ZipFile("pkg.whl", "w") as z:
    z.writestr("pkg/__init__.py", "VALUE = 42\n")
    z.writestr("pkg-1.0.dist-info/RECORD", "")
zipfile.ZipFile("pkg.whl").extractall("site")
os.rename("site/pkg", "site/pkg2"); os.symlink("pkg2", "site/pkg")
os.chmod("site/pkg2/__init__.py", 0o644); os.utime("site/pkg2/__init__.py")
with tarfile.open("src.tgz", "w:gz") as t: t.add("site")
tarfile.open("src.tgz").extractall("unpacked")
os.setxattr("pkg.whl", "user.origin", b"probe")
assert os.getxattr("pkg.whl", "user.origin") == b"probe"
import sys; sys.path.insert(0, "unpacked/site"); import pkg; assert pkg.VALUE == 42
with concurrent.futures.ThreadPoolExecutor(8) as pool:  # threads: clone without clone3
    assert sum(pool.map(lambda x: x * x, range(100))) == 328350
with multiprocessing.Pool(2) as pool:  # fork, semaphores in /dev/shm
    assert pool.map(abs, [-1, -2]) == [1, 2]
assert subprocess.run(["true"]).returncode == 0  # posix_spawn / vfork
print("python ok")
EOF
ps aux | grep -q '[p]s aux'
git init -q repo && cd repo && git config user.email a@b && git config user.name a
echo hi > f && git add f && git commit -qm one && git log --oneline | grep -q one
echo "git ok"
sudo -n true && echo "sudo ok"
"""
    sbx.files.write("/tmp/ordinary-work.sh", script)
    code, out = run(sbx, "bash /tmp/ordinary-work.sh", timeout=120)
    assert code == 0, out
    for marker in ("python ok", "git ok", "sudo ok"):
        assert marker in out, out


def test_a_pty_session_works_under_the_filter(sbx: Sandbox) -> None:
    handle = sbx.pty.create(PtySize(rows=24, cols=80), timeout=60)
    buf = bytearray()
    lock = threading.Lock()

    def reader() -> None:
        for _stdout, _stderr, pty in handle:
            if pty:
                with lock:
                    buf.extend(pty)

    threading.Thread(target=reader, daemon=True).start()
    try:
        sbx.pty.send_stdin(handle.pid, b"grep Seccomp: /proc/self/status | sed 's/^/MODE:/'; "
                                       b"tty | sed 's/^/TTY:/'\n")

        def seen() -> re.Match[str] | None:
            with lock:
                text = buf.decode(errors="replace")
            return re.search(r"TTY:/dev/pts/\d+", text) and re.search(r"MODE:Seccomp:\s+2",
                                                                       text)
        wait_until(seen, 15, what="the pty shell's answer")
    finally:
        sbx.pty.kill(handle.pid)


def test_filter_survives_pause_and_resume() -> None:
    s = Sandbox.create(metadata={"security": "seccomp-pause"}, timeout=180)
    try:
        # A process started before the pause must come back filtered, not just new ones.
        run(s, "nohup sleep 600 >/dev/null 2>&1 & echo $! > /tmp/sleeper")
        sleeper = s.files.read("/tmp/sleeper").strip()
        assert s.pause() is True
        s = Sandbox.connect(s.sandbox_id)
        assert seccomp_mode(s.files.read("/proc/1/status")) == "2"
        code, out = run(s, f"cat /proc/{sleeper}/status")
        assert code == 0 and seccomp_mode(out) == "2", out
        assert_filtered(s)
        code, out = run(s, "unshare -Urm true")
        assert code != 0 and "Operation not permitted" in out, out
    finally:
        s.kill()


def test_filter_is_in_force_in_fork_children() -> None:
    parent = Sandbox.create(metadata={"security": "seccomp-fork"}, timeout=180)
    children: list[Sandbox] = []
    try:
        results = parent.fork(count=2)
        children = [c for c in results if isinstance(c, Sandbox)]
        assert len(children) == 2, results
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(assert_filtered, children))
        for child in children:
            assert seccomp_mode(child.files.read("/proc/1/status")) == "2"
        assert_filtered(parent)  # the snapshot's dump left the parent filtered too
    finally:
        with ThreadPoolExecutor(3) as pool:
            list(pool.map(lambda s: s.kill(), [parent, *children]))
