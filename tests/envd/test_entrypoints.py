"""The entry points a runtime uses: `run()` on a given socket after `preload()`, and
envd as PID 1 of a pid namespace, where it must reap orphans."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
from envd_helpers import SRC, TEST_USER, Envd, free_port, make_sandbox, start_envd


def test_run_on_a_given_socket_after_preload(session_tmp: Path, test_user: object) -> None:
    port = free_port()
    script = textwrap.dedent(
        f"""
        import os, socket, sys
        sys.path.insert(0, {str(SRC)!r})
        from aenv.envd.server import preload, run
        from aenv.envd.settings import EnvdSettings
        preload()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", {port}))
        sock.listen(16)
        if os.fork() == 0:  # like a fork server: the child serves
            run(EnvdSettings(access_token="fork-token", default_user={TEST_USER!r}, is_init=False), listen_socket=sock)
            os._exit(0)
        os.wait()
        """
    )
    log = open(session_tmp / "forked.log", "wb")  # noqa: SIM115
    process = subprocess.Popen([sys.executable, "-c", script], stdout=log, stderr=subprocess.STDOUT)
    envd = Envd(port, "fork-token", process, session_tmp / "forked.log", session_tmp)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if httpx.get(envd.url + "/health", timeout=1).status_code == 204:
                    break
            except httpx.HTTPError:
                time.sleep(0.05)
        sbx = make_sandbox(envd)
        assert sbx.commands.run("echo forked").stdout == "forked\n"
    finally:
        # SIGTERM reaches the waiting parent only; stop the serving child through its group.
        for line in subprocess.run(["pgrep", "-P", str(process.pid)], capture_output=True, text=True, check=False).stdout.split():
            os.kill(int(line), 15)
        envd.stop()


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
def test_reaps_orphans_as_pid_1(session_tmp: Path, test_user: object) -> None:
    envd = start_envd(session_tmp, extra=[], wrapper=["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"])
    try:
        sbx = make_sandbox(envd)
        init = sbx.commands.run("tr '\\0' ' ' < /proc/1/cmdline", user="root").stdout
        assert "aenv.envd" in init
        # The subshell exits at once; its `sleep` is orphaned, re-parented to PID 1 (envd),
        # and must be reaped there when it exits.
        for _ in range(5):
            sbx.commands.run("(sleep 0.2 &); true")
        time.sleep(0.8)
        table = sbx.commands.run("ps -eo stat=,pid=,ppid=,comm=", user="root").stdout
        zombies = [line for line in table.splitlines() if line.strip().startswith("Z")]
        assert zombies == [], table
        # tracked processes still get their own exit codes
        assert sbx.commands.run("exit 0").exit_code == 0
    finally:
        # unshare ignores SIGTERM while it waits; killing it kills envd (--kill-child).
        envd.process.kill()
        envd.process.wait()


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
def test_falls_back_to_sh_without_bash(session_tmp: Path, test_user: object) -> None:
    # In a private mount namespace, /bin/bash becomes a non-executable file.
    blocker = session_tmp / "not-bash"
    blocker.write_text("")
    os.chmod(blocker, 0o644)
    hide_bash = f'mount --bind {blocker} /bin/bash && exec "$@"'
    envd = start_envd(
        session_tmp, wrapper=["unshare", "--mount", "--propagation", "private", "sh", "-c", hide_bash, "sh"]
    )
    try:
        sbx = make_sandbox(envd)
        result = sbx.commands.run("readlink /proc/$$/exe; echo ok")
        assert result.stdout.splitlines()[-1] == "ok"
        assert not result.stdout.startswith("/usr/bin/bash")
    finally:
        envd.stop()
