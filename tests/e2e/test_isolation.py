"""Isolation and resource limits of the container runtime, seen through the official SDK.

Each check has a positive control where it matters (the marker is visible where it should be),
so that a test cannot pass just because the probe itself is broken.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import CommandExitException, FileNotFoundException, Sandbox, SandboxException
from e2e_helpers import container_only, wait_until

from aenv.devserver import ServerProcess


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Sandbox, Sandbox]]:
    tag = {"suite": "e2e-isolation", "owner": uuid.uuid4().hex[:10]}
    a = Sandbox.create(metadata={**tag, "name": "a"}, timeout=600)
    try:
        b = Sandbox.create(metadata={**tag, "name": "b"}, timeout=600)
    except BaseException:
        a.kill()
        raise
    try:
        yield a, b
    finally:
        a.kill()
        b.kill()


def run_rc(sbx: Sandbox, cmd: str, **kw: object) -> tuple[int, str, str]:
    """Run a command; return (exit code, stdout, stderr) whatever the exit code."""
    try:
        r = sbx.commands.run(cmd, **kw)  # type: ignore[arg-type]
        return r.exit_code, r.stdout, r.stderr
    except CommandExitException as exc:
        return exc.exit_code, exc.stdout, exc.stderr


def host_pids() -> int:
    return sum(1 for p in os.listdir("/proc") if p.isdigit())


# ------------------------------------------------------------------ processes


@container_only
def test_cannot_see_host_processes(pair: tuple[Sandbox, Sandbox]) -> None:
    a, _ = pair
    marker = f"aenv-e2e-host-{uuid.uuid4().hex}"
    host = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", marker])
    try:
        # positive control: the marker is visible in the host's /proc (once exec is done)
        wait_until(lambda: marker in Path(f"/proc/{host.pid}/cmdline").read_text(), timeout=10,
                   what="the host marker process to exec")
        out = a.commands.run("ps -e -o pid=,args=", user="root").stdout
        lines = [ln for ln in out.splitlines() if ln.strip()]
        assert len(lines) < 15, f"a sandbox should see only its own few processes:\n{out}"
        assert marker not in out
        assert "pytest" not in out and "aenv.cli.main" not in out
        # nor through /proc directly (pid numbers are namespaced)
        rc, out, _ = run_rc(a, "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '", user="root")
        assert marker not in out and "pytest" not in out
        rc, _, _ = run_rc(a, f"kill -0 {os.getpid()}", user="root")
        assert rc != 0 or os.getpid() < 50  # tiny host pids could collide with sandbox ones
    finally:
        host.kill()
        host.wait()


def test_cannot_see_sibling_processes(pair: tuple[Sandbox, Sandbox]) -> None:
    a, b = pair
    marker = f"e2esib{uuid.uuid4().hex[:10]}"
    handle = a.commands.run(f"exec -a {marker} sleep 120", background=True)
    try:
        wait_until(lambda: marker in a.commands.run("ps -e -o args=").stdout, 10,
                   what="marker process in its own sandbox")  # positive control
        assert marker not in b.commands.run("ps -e -o args=", user="root").stdout
        assert marker not in run_rc(b, "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '",
                                    user="root")[1]
    finally:
        a.commands.kill(handle.pid)


def test_hostname_is_sandbox_id_and_basics(pair: tuple[Sandbox, Sandbox]) -> None:
    a, b = pair
    assert a.commands.run("hostname").stdout.strip() == a.sandbox_id
    assert b.commands.run("hostname").stdout.strip() == b.sandbox_id
    out = a.commands.run("uname -s; uname -m; cat /etc/os-release | head -n 3").stdout
    assert out.startswith("Linux\n") and "Debian" in out
    tools = a.commands.run("python3 --version; git --version; curl --version | head -n 1; "
                           "bash --version | head -n 1").stdout
    assert "Python 3" in tools and "git version" in tools and "curl" in tools
    assert a.commands.run("sudo -n id -u").stdout == "0\n"
    rc, _, err = run_rc(a, "touch /etc/e2e-not-allowed")
    assert rc != 0 and "denied" in err.lower()


# ------------------------------------------------------------------ filesystem


def test_cannot_read_host_files(pair: tuple[Sandbox, Sandbox]) -> None:
    a, _ = pair
    secret = uuid.uuid4().hex
    paths = [Path(f"/tmp/aenv-e2e-secret-{secret[:8]}"), Path(f"/root/aenv-e2e-secret-{secret[:8]}")]
    for p in paths:
        p.write_text(secret)
    try:
        for p in paths:
            assert p.read_text() == secret  # the host can read it
            rc, out, _ = run_rc(a, f"cat {p}", user="root")
            assert rc != 0 and secret not in out
            with pytest.raises(FileNotFoundException):
                a.files.read(str(p), user="root")
            # a symlink inside the sandbox resolves inside the sandbox
            link = f"/home/user/link-{secret[:8]}-{p.parent.name}"
            a.commands.run(f"ln -sf {p} {link}", user="root")
            with pytest.raises(FileNotFoundException):
                a.files.read(link, user="root")
        rc, out, _ = run_rc(a, f"grep -rs {secret} /tmp /root /home /var/tmp", user="root")
        assert secret not in out
    finally:
        for p in paths:
            p.unlink(missing_ok=True)


def test_cannot_read_sibling_files(pair: tuple[Sandbox, Sandbox]) -> None:
    a, b = pair
    name = f"sibling-{uuid.uuid4().hex[:10]}"
    a.files.write(f"/home/user/{name}", "a's data")
    a.commands.run(f"echo a-tmp > /tmp/{name}")
    assert a.files.read(f"/home/user/{name}") == "a's data"  # positive control
    assert b.files.exists(f"/home/user/{name}") is False
    assert b.files.exists(f"/tmp/{name}") is False
    _, out, _ = run_rc(b, f"find / -xdev -name '{name}*' 2>/dev/null", user="root")
    assert name not in out
    # b writing the same path does not touch a's file
    b.files.write(f"/home/user/{name}", "b's data")
    assert a.files.read(f"/home/user/{name}") == "a's data"


def test_sandbox_loopback_is_not_the_hosts(pair: tuple[Sandbox, Sandbox],
                                           server: ServerProcess) -> None:
    a, _ = pair
    # the host answers on its loopback...
    assert httpx.get(server.url + "/health", timeout=5).status_code == 204
    # ...but 127.0.0.1 inside the sandbox is the sandbox's own network namespace
    rc, out, _ = run_rc(a, f"curl -s -m 3 -o /dev/null -w '%{{http_code}}' {server.url}/health")
    assert rc != 0 and out.strip() in ("", "000")


# ------------------------------------------------------------------ limits


def test_memory_hog_is_oom_killed(pair: tuple[Sandbox, Sandbox], server: ServerProcess) -> None:
    a, b = pair
    started = time.monotonic()
    rc, out, _ = run_rc(a, "python3 -c \"b = b'x' * (2 << 30); print('allocated', len(b))\"",
                        timeout=120)
    assert rc != 0, "allocating 2 GiB inside a 512 MiB sandbox must fail"
    assert "allocated" not in out
    assert time.monotonic() - started < 100
    # the sandbox, its sibling and the server are fine afterwards
    assert a.commands.run("echo still-here").stdout == "still-here\n"
    assert b.commands.run("echo sibling-ok").stdout == "sibling-ok\n"
    assert httpx.get(server.url + "/health", timeout=5).status_code == 204
    # a smaller allocation within the limit works
    ok = a.commands.run("python3 -c \"b = b'x' * (100 << 20); print(len(b))\"", timeout=60)
    assert ok.stdout.strip() == str(100 << 20)


PIDS_MAX = 1024  # the server's default per-sandbox process limit (config sandbox.pids_max)


def _watch_host(seconds: float, server: ServerProcess, baseline: int) -> int:
    """Sample the host's process count for `seconds` while checking the server answers."""
    peak = baseline
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        peak = max(peak, host_pids())
        assert httpx.get(server.url + "/health", timeout=10).status_code == 204
        time.sleep(0.25)
    return peak


@pytest.mark.slow
@container_only
def test_fork_bomb_is_contained(pair: tuple[Sandbox, Sandbox], server: ServerProcess) -> None:
    """The classic bash bomb returns at once and keeps forking in the background: the pids
    limit caps it, the server, envd and sibling sandboxes keep working, and killing the
    sandbox frees every process."""
    _, sibling = pair
    baseline = host_pids()
    s = Sandbox.create(metadata={"suite": "e2e-isolation", "kind": "fork-bomb"}, timeout=300)
    try:
        s.commands.run("bash -c ':(){ :|:& };:'", timeout=30)
        peak = _watch_host(4, server, baseline)
        # the pids limit bounds the bomb on the host (slack: warm-pool refills, the server)
        assert peak - baseline < PIDS_MAX + 300, f"host pids grew from {baseline} to {peak}"
        assert peak - baseline > 200, "the bomb did not run at all: the probe is broken"
        # a sibling sandbox is unaffected
        started = time.monotonic()
        assert sibling.commands.run("echo sibling-ok", timeout=20).stdout == "sibling-ok\n"
        assert time.monotonic() - started < 10
        # envd in the saturated sandbox still answers requests that spawn nothing
        assert s.is_running() is True
        s.files.write("/home/user/during-bomb.txt", "still here")
        assert s.files.read("/home/user/during-bomb.txt") == "still here"
        assert s.get_info().state.value == "running"
    finally:
        killed = s.kill()
    assert killed is True
    # killing the sandbox frees every process of the bomb
    wait_until(lambda: host_pids() - baseline < 50, 20, what="bomb processes to be reaped")


@pytest.mark.slow
@container_only
def test_bounded_fork_bomb_then_recovers(server: ServerProcess) -> None:
    """A fork bomb that `timeout` can stop: afterwards the sandbox runs commands again."""
    baseline = host_pids()
    s = Sandbox.create(metadata={"suite": "e2e-isolation", "kind": "bounded-bomb"}, timeout=300)
    try:
        bomb = ("import os\n"
                "while True:\n"
                "    try:\n"
                "        os.fork()\n"
                "    except OSError:\n"
                "        pass\n")
        s.files.write("/tmp/bomb.py", bomb)
        handle = s.commands.run("timeout -s KILL 6 python3 /tmp/bomb.py", background=True,
                                timeout=60)
        peak = _watch_host(4, server, baseline)
        assert 200 < peak - baseline < PIDS_MAX + 300, f"host pids grew from {baseline} to {peak}"
        with pytest.raises(CommandExitException) as exc_info:
            handle.wait()
        assert exc_info.value.exit_code != 0

        def responds() -> bool:
            try:
                return s.commands.run("echo alive", timeout=10).stdout == "alive\n"
            except SandboxException:
                return False

        wait_until(responds, 20, interval=0.5, what="the sandbox to run commands again")
        assert int(s.commands.run("ps -e --no-headers | wc -l", user="root").stdout) < 15
    finally:
        assert s.kill() is True
