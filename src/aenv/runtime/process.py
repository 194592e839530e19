"""Host processes that run sandboxes, as the drivers see them: identified by pid *and* start time
(so a reused pid is never mistaken for ours), sampled for CPU use, connected to inside their
network namespace, killed and waited for; and `run()`, how the server starts a helper program
(criu, qemu, ...) and waits for it without blocking the event loop.

Owns: driver-agnostic helpers over /proc and setns() for one such process (a container's
init, a QEMU process), and the helper processes `run()` starts. Each driver keeps what is
specific to it (cgroups, QMP, sockets) in its own record, which may extend `LiveProcess`.
Must not touch: any process it was not given.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import BinaryIO

from aenv.errors import AenvError, ErrorCode
from aenv.runtime.container import linux

CLK_TCK = os.sysconf("SC_CLK_TCK")


def uptime() -> float:
    """Seconds since the host booted."""
    with open("/proc/uptime") as f:
        return float(f.read().split()[0])


@dataclass
class LiveProcess:
    """What a driver remembers about a sandbox's process while the server runs (rebuilt on
    attach). `cpu_used` is cumulative CPU use in the driver's unit (see `cpu_percent`)."""

    pid: int
    start_time: int
    netns_fd: int | None = None
    cpu_used: int | None = None
    cpu_at: float = 0.0
    # OOM kills in the sandbox counted at the last two checks that found this process alive
    # (older first): a driver's `exit_reason` tells an OOM kill of it from other deaths by
    # the count rising since the older one (a process the OOM killer took still looks alive
    # while it exits, and the newer count may already include its own kill).
    oom_kills: tuple[int, int] = (0, 0)

    def close_netns(self) -> None:
        if self.netns_fd is not None:
            os.close(self.netns_fd)
            self.netns_fd = None

    def alive(self) -> bool:
        return linux.proc_start_time(self.pid) == self.start_time

    def cpu_percent(self, used: int, per_second: float) -> float:
        """Percent of one CPU used since the last call, given cumulative use `used` in units of
        which `per_second` make a second; the first call after a restart averages over the
        process' life."""
        now = time.monotonic()
        if self.cpu_used is None:
            self.cpu_used = 0
            self.cpu_at = now - max(uptime() - self.start_time / CLK_TCK, 1e-3)
        elapsed = max(now - self.cpu_at, 1e-6)
        pct = max(used - self.cpu_used, 0) / per_second / elapsed * 100.0
        self.cpu_used, self.cpu_at = used, now
        return pct

    async def connect(self, sandbox_id: str, host_netns: int, address: str, port: int,
                      timeout: float) -> socket.socket:
        """A TCP connection to `address:port` from inside the network namespace `netns_fd` (the
        driver opens it); `host_netns` is the server's own. AenvError(UNAVAILABLE) when the
        process is gone, AenvError(PORT_CLOSED) when it runs but nothing answers."""
        assert self.netns_fd is not None
        # A socket's network namespace is fixed at creation and setns() affects only this
        # thread: switch, create, switch back, with no await in between.
        linux.setns(self.netns_fd, linux.CLONE_NEWNET)
        try:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        finally:
            linux.setns(host_netns, linux.CLONE_NEWNET)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            await asyncio.wait_for(asyncio.get_running_loop().sock_connect(
                sock, (address, port)), timeout)
        except (OSError, TimeoutError) as exc:
            sock.close()
            if not self.alive():
                raise AenvError(ErrorCode.UNAVAILABLE,
                                f"sandbox {sandbox_id} is not running") from None
            raise AenvError(ErrorCode.PORT_CLOSED,
                            f"nothing listens on port {port} in sandbox {sandbox_id}: "
                            f"{exc!r}") from None
        return sock

async def kill_and_wait(pid: int, start_time: int | None, what: str,
                        timeout: float = 10.0) -> None:
    """SIGKILL `pid` if it is still the process that started at `start_time` (any, when None)
    and wait until it has exited (its memory, mounts and namespaces released; a pid
    namespace's init exits after every other process in it); whoever is its parent reaps it.
    Through a pidfd: no pid reuse between check and kill, and the exit is seen when it
    happens, not at the next poll. `what` names it in the error raised when it outlives
    `timeout`."""
    current = linux.proc_start_time(pid)
    if current is None or (start_time is not None and current != start_time):
        return
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        if linux.proc_start_time(pid) != current:
            return  # gone, and its pid reused, between the check and the open
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        try:
            await asyncio.wait_for(_exited(pidfd), timeout)
        except TimeoutError:
            raise AenvError(ErrorCode.INTERNAL, f"{what} {pid} did not die") from None
    finally:
        os.close(pidfd)


async def _exited(pidfd: int) -> None:
    """Until the process of `pidfd` has exited (the pidfd turns readable), on the loop."""
    loop = asyncio.get_running_loop()
    exited: asyncio.Future[None] = loop.create_future()

    def on_exit() -> None:
        if not exited.done():
            exited.set_result(None)

    loop.add_reader(pidfd, on_exit)
    try:
        await exited
    finally:
        loop.remove_reader(pidfd)


@dataclass(frozen=True)
class Finished:
    """How a program started by `run()` ended."""

    returncode: int
    output: bytes  # its stdout and stderr interleaved (empty when they went to a log file)


async def run(argv: Sequence[str], *, env: dict[str, str] | None = None,
              pass_fds: Sequence[int] = (), cwd: str | None = None,
              log: BinaryIO | None = None, new_session: bool = False,
              timeout: float | None = None) -> Finished:
    """Run `argv` to completion from the event loop: stdin /dev/null, stdout and stderr to
    `log` or captured. OSError if it cannot be started (FileNotFoundError: not installed);
    TimeoutError (the program killed) after `timeout` seconds; a cancelled caller kills it.

    Why not the loop's own subprocess support: the server runs on uvloop, whose spawn is a
    full fork() of the server (page tables and all: ~17 ms on a nested VM, and copy-on-write
    faults in the server afterwards). subprocess.Popen spawns with vfork+exec (~1.5 ms); its
    exit is then awaited through a pidfd and its output read as it comes (a full pipe would
    otherwise stall it), both on the loop."""
    loop = asyncio.get_running_loop()
    read_fd: int | None = None
    target: int | BinaryIO
    if log is None:
        read_fd, target = os.pipe2(os.O_CLOEXEC)
    else:
        target = log
    try:
        # Popen returns once the child has exec'd (~1.5 ms): no need for a thread.
        proc = subprocess.Popen(  # noqa: ASYNC220
            list(argv), stdin=subprocess.DEVNULL, stdout=target, stderr=subprocess.STDOUT,
            env=env, pass_fds=tuple(pass_fds), cwd=cwd, start_new_session=new_session)
    except BaseException:
        if read_fd is not None:
            os.close(read_fd)
        raise
    finally:
        if isinstance(target, int):
            os.close(target)
    pidfd = os.pidfd_open(proc.pid)
    chunks: list[bytes] = []

    def drain() -> None:
        assert read_fd is not None
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(read_fd, 65536):
                chunks.append(chunk)
            loop.remove_reader(read_fd)  # end of file

    if read_fd is not None:
        os.set_blocking(read_fd, False)
        loop.add_reader(read_fd, drain)
    try:
        async with asyncio.timeout(timeout):
            await _exited(pidfd)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        raise
    finally:
        os.close(pidfd)
        if read_fd is not None:
            drain()  # what is left (a grandchild holding the pipe open does not hold us up)
            loop.remove_reader(read_fd)
            os.close(read_fd)
        proc.wait()  # it has exited, or was just killed
    return Finished(proc.returncode, b"".join(chunks))
