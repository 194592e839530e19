"""Host processes that run sandboxes, as the drivers see them: identified by pid *and* start time
(so a reused pid is never mistaken for ours), sampled for CPU use, connected to inside their
network namespace, killed and waited for.

Owns: driver-agnostic helpers over /proc and setns() for one such process (a container's
init, a QEMU process). Each driver keeps what is specific to it (cgroups, QMP, sockets) in
its own record, which may extend `LiveProcess`. Must not touch: any process it was not given.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
from dataclasses import dataclass

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
    and wait until /proc no longer shows it; whoever is its parent reaps it. `what` names it in
    the error raised when it outlives `timeout`."""
    current = linux.proc_start_time(pid)
    if current is None or (start_time is not None and current != start_time):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    delay = 0.001
    while linux.proc_start_time(pid) == current:
        if time.monotonic() > deadline:
            raise AenvError(ErrorCode.INTERNAL, f"{what} {pid} did not die")
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.05)
