"""PTY sessions through the official SDK: create, input, resize, kill, connect."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from e2b import AsyncSandbox, CommandExitException, PtySize, Sandbox


class Collector:
    """Drains a PTY handle on a thread so the test can wait for text to appear."""

    def __init__(self, handle) -> None:  # type: ignore[no-untyped-def]
        self.handle = handle
        self.data = bytearray()
        self.error: BaseException | None = None
        self.result = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.result = self.handle.wait(on_pty=self.data.extend)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            self.error = e

    def wait_for(self, text: bytes, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.data:
            if time.monotonic() > deadline:
                raise AssertionError(f"{text!r} not in {bytes(self.data)!r}")
            time.sleep(0.02)

    def join(self) -> None:
        self.thread.join(10)
        assert not self.thread.is_alive()


def test_pty_input_resize_and_exit(sbx: Sandbox) -> None:
    handle = sbx.pty.create(PtySize(rows=24, cols=80))
    out = Collector(handle)
    sbx.pty.send_stdin(handle.pid, b"stty size; tty; echo MARK$((6*7))\n")
    out.wait_for(b"MARK42")
    assert b"24 80" in out.data
    assert b"/dev/pts/" in out.data
    sbx.pty.resize(handle.pid, PtySize(rows=30, cols=100))
    sbx.pty.send_stdin(handle.pid, b"stty size\n")
    out.wait_for(b"30 100")
    sbx.pty.send_stdin(handle.pid, b"exit 0\n")
    out.join()
    assert out.error is None
    assert out.result is not None and out.result.exit_code == 0


def test_pty_environment_and_user(sbx: Sandbox) -> None:
    handle = sbx.pty.create(PtySize(rows=10, cols=60))
    out = Collector(handle)
    sbx.pty.send_stdin(handle.pid, b'echo "T=$TERM U=$(id -un)"; exit\n')
    out.wait_for(b"T=xterm-256color U=aenvtest")
    out.join()


def test_pty_kill_and_stdin_rules(sbx: Sandbox) -> None:
    handle = sbx.pty.create(PtySize(rows=24, cols=80))
    out = Collector(handle)
    # stdin writes go to the terminal, not a pipe
    with pytest.raises(Exception, match="tty assigned"):
        sbx.commands.send_stdin(handle.pid, "x")
    assert sbx.pty.kill(handle.pid) is True
    out.join()
    assert isinstance(out.error, CommandExitException)
    assert out.error.exit_code == -1
    assert sbx.pty.kill(handle.pid) is False


async def test_async_pty_connect(asbx: AsyncSandbox) -> None:
    received = bytearray()
    handle = await asbx.pty.create(PtySize(rows=24, cols=80), on_data=received.extend)
    second = bytearray()
    other = await asbx.pty.connect(handle.pid, on_data=second.extend)
    await asbx.pty.send_stdin(handle.pid, b"echo CONNECTED\n")
    deadline = time.monotonic() + 10
    while b"CONNECTED" not in second and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert b"CONNECTED" in received and b"CONNECTED" in second
    await asbx.pty.send_stdin(handle.pid, b"exit 5\n")
    with pytest.raises(CommandExitException) as info:
        await handle.wait()
    assert info.value.exit_code == 5
    with pytest.raises(CommandExitException):
        await other.wait()
