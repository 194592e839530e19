"""Firecracker processes: start one per microVM, find it again, stop it.

A microVM's process runs in a session of its own (it outlives the server, like a container
sandbox does), in the microVM's network namespace (`nsenter --net`, which then execs
Firecracker: the pid is Firecracker's), with its working directory set to the microVM's
directory. The driver gives Firecracker *relative* paths for the disk ("rootfs.ext4"), so a
snapshot records no host path: a copy loaded by another process in another directory opens
its own disk.

Owns: the processes it starts. Must not touch: any other process.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

from aenv.errors import AenvError, ErrorCode
from aenv.runtime.container import linux


def spawn(binary: str, cwd: Path, api_socket: Path, instance_id: str, netns: str | None,
          output: Path) -> subprocess.Popen[bytes]:
    """Start Firecracker; its serial console and own messages go to `output`."""
    argv = [binary, "--api-sock", str(api_socket), "--id", instance_id]
    if netns is not None:
        argv = ["nsenter", f"--net={netns}", "--", *argv]
    with contextlib.suppress(FileNotFoundError):
        api_socket.unlink()  # Firecracker refuses to start over an existing socket
    with open(output, "ab") as out:
        try:
            return subprocess.Popen(argv, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    close_fds=True)
        except OSError as exc:
            raise AenvError(ErrorCode.UNAVAILABLE, f"cannot start {binary}: {exc}") from None


def start_time(pid: int) -> int | None:
    return linux.proc_start_time(pid)


def alive(pid: int, started: int | None) -> bool:
    current = linux.proc_start_time(pid)
    return current is not None and (started is None or current == started)


async def kill_and_wait(pid: int, started: int | None, proc: subprocess.Popen[bytes] | None,
                        timeout: float = 10.0) -> None:
    """SIGKILL the process if it is still the one we started, and wait until it is gone
    (reaped through `proc` when we are its parent)."""
    if not alive(pid, started):
        if proc is not None:
            proc.poll()
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    delay = 0.001
    while True:
        if proc is not None and proc.poll() is not None:
            return
        if proc is None and not alive(pid, started):
            return
        if time.monotonic() > deadline:
            raise AenvError(ErrorCode.INTERNAL, f"firecracker process {pid} did not die")
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.05)


def tail(path: Path, size: int = 600) -> str:
    """The end of a log file, for error messages."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - size))
            return f.read().decode(errors="replace").strip()
    except OSError:
        return ""
