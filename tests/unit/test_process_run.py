"""`aenv.runtime.process.run`: how the server runs helper programs (criu, qemu, qemu-img) from
its event loop, on plain asyncio and on uvloop (the server's loop)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
import uvloop

from aenv.runtime import process
from aenv.runtime.container import linux

LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def run_on(loop_name: str, coro: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    loop = LOOPS[loop_name]()
    try:
        return loop.run_until_complete(coro())
    finally:
        loop.close()


@pytest.fixture(params=sorted(LOOPS))
def loop_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_exit_status_and_interleaved_output(loop_name: str) -> None:
    done = run_on(loop_name, lambda: process.run(
        ["sh", "-c", "echo out; echo err >&2; exit 3"]))
    assert done.returncode == 3
    assert done.output.splitlines() == [b"out", b"err"]


def test_output_larger_than_a_pipe_does_not_stall(loop_name: str) -> None:
    # 1 MiB: a child writing more than the pipe holds (64 KiB) must be read while it runs.
    done = run_on(loop_name, lambda: process.run(
        ["sh", "-c", "head -c 1048576 /dev/zero"], timeout=20))
    assert done.returncode == 0 and len(done.output) == 1 << 20


def test_env_cwd_and_passed_fds(loop_name: str, tmp_path: Path) -> None:
    read_fd, write_fd = os.pipe()
    try:
        os.write(write_fd, b"through the fd")
        os.close(write_fd)
        done = run_on(loop_name, lambda: process.run(
            ["sh", "-c", f'echo "$GREETING $(pwd)"; cat /proc/self/fd/{read_fd}'],
            env={"GREETING": "hi", "PATH": os.environ["PATH"]}, cwd=str(tmp_path),
            pass_fds=(read_fd,)))
    finally:
        os.close(read_fd)
    assert done.output == f"hi {tmp_path}\nthrough the fd".encode()


def test_output_to_a_log_file(loop_name: str, tmp_path: Path) -> None:
    log = tmp_path / "log"
    with log.open("ab") as out:
        done = run_on(loop_name, lambda: process.run(["sh", "-c", "echo logged"], log=out))
    assert done.output == b"" and log.read_bytes() == b"logged\n"


def test_a_grandchild_holding_the_output_open_does_not_hold_up_the_caller(
        loop_name: str) -> None:
    started = time.monotonic()
    done = run_on(loop_name, lambda: process.run(
        ["sh", "-c", "sleep 5 & echo parent done"], timeout=10))
    assert done.output == b"parent done\n"
    assert time.monotonic() - started < 4


def test_missing_program_raises_file_not_found(loop_name: str) -> None:
    with pytest.raises(FileNotFoundError):
        run_on(loop_name, lambda: process.run(["/nonexistent/aenv-program"]))


def test_timeout_kills_the_program(loop_name: str, tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    with pytest.raises(TimeoutError):
        run_on(loop_name, lambda: process.run(
            ["sh", "-c", f"echo $$ > {pidfile}; exec sleep 30"], timeout=0.5))
    pid = int(pidfile.read_text())
    assert not Path(f"/proc/{pid}").exists()  # killed and reaped, no zombie


def test_cancelled_caller_kills_the_program(loop_name: str, tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"

    async def cancel_it() -> None:
        task = asyncio.ensure_future(process.run(
            ["sh", "-c", f"echo $$ > {pidfile}; exec sleep 30"]))
        while not pidfile.exists() or not pidfile.read_text().strip():
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run_on(loop_name, cancel_it)
    assert not Path(f"/proc/{int(pidfile.read_text())}").exists()


def test_kill_and_wait_returns_at_the_exit_even_before_the_parent_reaps(loop_name: str) -> None:
    """The exit is what counts (memory and namespaces released), not the reaping: here the
    parent (this test) reaps only afterwards."""
    import subprocess

    child = subprocess.Popen(["sleep", "100"])
    try:
        started = linux.proc_start_time(child.pid)
        t = time.monotonic()
        run_on(loop_name, lambda: process.kill_and_wait(child.pid, started, "sleep", timeout=5))
        assert time.monotonic() - t < 2
        assert child.wait(timeout=1) == -9  # a zombie until now, killed by SIGKILL
    finally:
        child.kill()
        child.wait()


def test_kill_and_wait_spares_a_process_with_another_start_time(loop_name: str) -> None:
    """A recorded (pid, start time) whose pid now names another process: not killed."""
    import subprocess

    child = subprocess.Popen(["sleep", "100"])
    try:
        started = linux.proc_start_time(child.pid)
        assert started is not None
        run_on(loop_name, lambda: process.kill_and_wait(child.pid, started - 1, "sleep"))
        assert child.poll() is None  # still running
        run_on(loop_name, lambda: process.kill_and_wait(child.pid, None, "sleep"))
        assert child.wait(timeout=1) == -9
    finally:
        child.kill()
        child.wait()
