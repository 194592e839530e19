"""Process supervision: spawning, output fan-out, input, signals, reaping.

Owns: forking and exec'ing commands as a sandbox user (own session, optional PTY as the
controlling terminal), reading their output without threads, delivering it to every
attached stream, writing stdin/PTY input, signals, the lifetime timer, exit statuses and
the retained end event a late `Connect` replays.

Why our own fork/exec and SIGCHLD handler instead of asyncio's child watchers: envd is
PID 1 of the sandbox's pid namespace, so every orphan in the sandbox is re-parented to it
and must be reaped. A `waitpid(-1, WNOHANG)` loop on SIGCHLD reaps everything, hands the
statuses of processes we track to them and silently drops the rest. (With
`EnvdSettings.is_init` false only tracked pids are waited for, so envd never steals
children it does not own.) The loop runs as an event-loop callback, never in signal
context, and a child is registered in the same callback that forks it, so no exit can be
lost between the fork and the registration.

Semantics follow the Go envd: output produced while no stream is attached is dropped;
`Connect` sees live output from then on; a SIGKILLed process ends with
`{exitCode:-1, exited:false, status:"signal: killed", error:"signal: killed"}`; the end
event stays available to `Connect` for 30 s after exit. Two deliberate differences:
signals go to the process group (the command's session), so `kill` also stops what a
shell started; and if descendants keep the output pipes open after the process exited
(`cmd &` without redirection), the end event is sent after a short grace period instead of
waiting for them, and their later output is drained and discarded.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import signal
import struct
import sys
import termios
from collections.abc import Callable
from typing import Any

from aenv.envd.channel import Channel
from aenv.envd.errors import RpcError
from aenv.envd.log import log_exception
from aenv.envd.proto import Msg
from aenv.envd.users import User

STD_CHUNK = 32 << 10
PTY_CHUNK = 16 << 10
QUEUE_HIGH = 64  # pause reading a process's output while a stream lags this many chunks
QUEUE_LOW = 16
EXIT_GRACE = 0.2  # how long output may trail the exit before the end event is sent
RETAIN_END = 30.0

# Go's signal descriptions, used in "signal: killed" and friends.
SIGNAL_NAMES = {
    1: "hangup",
    2: "interrupt",
    3: "quit",
    4: "illegal instruction",
    5: "trace/breakpoint trap",
    6: "aborted",
    7: "bus error",
    8: "floating point exception",
    9: "killed",
    10: "user defined signal 1",
    11: "segmentation fault",
    12: "user defined signal 2",
    13: "broken pipe",
    14: "alarm clock",
    15: "terminated",
    16: "stack fault",
    17: "child exited",
    18: "continued",
    19: "stopped (signal)",
    20: "stopped",
    21: "stopped (tty input)",
    22: "stopped (tty output)",
    23: "urgent I/O condition",
    24: "CPU time limit exceeded",
    25: "file size limit exceeded",
    26: "virtual timer expired",
    27: "profiling timer expired",
    28: "window changed",
    29: "I/O possible",
    30: "power failure",
    31: "bad system call",
}

# An item on a subscriber's queue: ("stdout"|"stderr"|"pty", bytes) or ("end", end-event).
Item = tuple[str, bytes | Msg]


class SpawnError(Exception):
    pass


def end_event(status: int) -> Msg:
    """The EndEvent Go's `ProcessState` would produce for a wait status."""
    if os.WIFEXITED(status):
        code = os.WEXITSTATUS(status)
        text = f"exit status {code}"
        end: Msg = {"exitCode": code, "exited": True, "status": text}
        if code:
            end["error"] = text
        return end
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        text = f"signal: {SIGNAL_NAMES.get(number, f'signal {number}')}"
        if os.WCOREDUMP(status):
            text += " (core dumped)"
        return {"exitCode": -1, "exited": False, "status": text, "error": text}
    return {"exitCode": -1, "exited": False, "status": f"unknown wait status {status}"}


class Subscriber(Channel[Item]):
    """One stream's view of a process: output chunks and, last, the end event."""

    def __init__(self, process: Process) -> None:
        super().__init__()
        self._process = process

    def consumed(self) -> None:
        if len(self) <= QUEUE_LOW:
            self._process.maybe_resume()

    def close(self) -> None:
        self._process.unsubscribe(self)


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class Process:
    def __init__(
        self,
        supervisor: Supervisor,
        pid: int,
        config: Msg,
        tag: str | None,
        outputs: dict[int, str],
        stdin_fd: int | None,
        pty_fd: int | None,
    ) -> None:
        self._supervisor = supervisor
        self._loop = asyncio.get_running_loop()
        self.pid = pid
        self.config = config
        self.tag = tag
        self._outputs = outputs  # fd → "stdout" | "stderr" | "pty"
        self._stdin_fd = stdin_fd
        self.pty_fd = pty_fd
        self._subscribers: list[Subscriber] = []
        self._paused = False
        self._discarding = False
        self.status: int | None = None
        self.end: Msg | None = None
        self._grace: asyncio.TimerHandle | None = None
        self._lifetime: asyncio.TimerHandle | None = None
        self._input_lock = asyncio.Lock()
        for fd in outputs:
            os.set_blocking(fd, False)
            self._loop.add_reader(fd, self._readable, fd)
        if stdin_fd is not None:
            os.set_blocking(stdin_fd, False)

    # -- streams ------------------------------------------------------------------------

    def subscribe(self) -> Subscriber:
        subscriber = Subscriber(self)
        self._subscribers.append(subscriber)
        return subscriber

    def unsubscribe(self, subscriber: Subscriber) -> None:
        if subscriber in self._subscribers:
            self._subscribers.remove(subscriber)
        self.maybe_resume()

    def _dispatch(self, item: Item) -> None:
        lagging = False
        for subscriber in self._subscribers:
            subscriber.push(item)
            lagging = lagging or len(subscriber) > QUEUE_HIGH
        if lagging and not self._paused:
            # Back-pressure: stop reading so the pipe fills and the process blocks,
            # instead of buffering unbounded output for a slow client.
            self._paused = True
            for fd in self._outputs:
                self._loop.remove_reader(fd)

    def maybe_resume(self) -> None:
        if not self._paused:
            return
        if any(len(s) > QUEUE_LOW for s in self._subscribers):
            return
        self._paused = False
        for fd in self._outputs:
            self._loop.add_reader(fd, self._readable, fd)

    # -- output -------------------------------------------------------------------------

    def _readable(self, fd: int) -> None:
        kind = self._outputs.get(fd)
        if kind is None:
            return
        try:
            data = os.read(fd, PTY_CHUNK if kind == "pty" else STD_CHUNK)
        except BlockingIOError:
            return
        except OSError:
            # EIO is how a PTY master reports that the last slave fd was closed.
            data = b""
        if not data:
            self._close_output(fd)
            return
        if not self._discarding:
            self._dispatch((kind, data))

    def _close_output(self, fd: int) -> None:
        self._loop.remove_reader(fd)
        del self._outputs[fd]
        if fd != self.pty_fd:
            os.close(fd)
        elif self.end is not None:
            self._close_pty()
        if not self._outputs and self.status is not None:
            self._finish()

    # -- lifecycle ----------------------------------------------------------------------

    def exited(self, status: int) -> None:
        """Called by the supervisor with the wait status."""
        self.status = status
        if self._lifetime is not None:
            self._lifetime.cancel()
        if not self._outputs:
            self._finish()
        else:
            self._grace = self._loop.call_later(EXIT_GRACE, self._grace_over)

    def _grace_over(self) -> None:
        self._grace = None
        if self.end is not None:
            return
        if self._paused:
            # A slow client is still catching up; that output is the process's own.
            self._grace = self._loop.call_later(EXIT_GRACE, self._grace_over)
            return
        # Descendants still hold the output open: report the exit now and drain the rest.
        self._discarding = True
        self._finish()

    def _finish(self) -> None:
        if self.end is not None or self.status is None:
            return
        if self._grace is not None:
            self._grace.cancel()
            self._grace = None
        self.end = end_event(self.status)
        for subscriber in self._subscribers:
            subscriber.push(("end", self.end))
        if self._stdin_fd is not None:
            os.close(self._stdin_fd)
            self._stdin_fd = None
        if self.pty_fd is not None and self.pty_fd not in self._outputs:
            self._close_pty()
        self._supervisor.finished(self)

    def _close_pty(self) -> None:
        if self.pty_fd is not None:
            os.close(self.pty_fd)
            self.pty_fd = None

    def set_lifetime(self, seconds: float) -> None:
        self._lifetime = self._loop.call_later(seconds, self.signal, signal.SIGKILL)

    # -- control ------------------------------------------------------------------------

    def signal(self, number: int) -> None:
        if self.end is not None:
            return
        try:
            os.killpg(self.pid, number)
            return
        except (ProcessLookupError, PermissionError):
            pass  # it left its process group (setsid/setpgid): signal just the process
        try:
            os.kill(self.pid, number)
        except ProcessLookupError:
            pass

    async def write_stdin(self, data: bytes) -> None:
        if self.pty_fd is not None:
            raise RpcError(
                "internal",
                "error writing to stdin: tty assigned to process — input should be "
                "written to the pty, not the stdin",
            )
        async with self._input_lock:
            if self._stdin_fd is None:
                raise RpcError("internal", "error writing to stdin: stdin not enabled or closed")
            await self._write_all(self._stdin_fd, data, "stdin")

    async def write_pty(self, data: bytes) -> None:
        if self.pty_fd is None:
            raise RpcError(
                "internal",
                "error writing to tty: tty not assigned to process — input should be "
                "written to the stdin, not the tty",
            )
        async with self._input_lock:
            if self.pty_fd is None:
                raise RpcError("internal", "error writing to tty: tty closed")
            await self._write_all(self.pty_fd, data, "tty")

    async def _write_all(self, fd: int, data: bytes, what: str) -> None:
        view = memoryview(data)
        while view:
            try:
                written = os.write(fd, view)
            except BlockingIOError:
                await self._writable(fd)
                continue
            except OSError as e:
                raise RpcError(
                    "internal",
                    f"error writing to {what} of process '{self.pid}': {e.strerror}",
                ) from None
            view = view[written:]

    async def _writable(self, fd: int) -> None:
        waiter: asyncio.Future[None] = self._loop.create_future()
        self._loop.add_writer(fd, _expire, waiter)
        try:
            await waiter
        finally:
            self._loop.remove_writer(fd)

    async def close_stdin(self) -> None:
        if self.pty_fd is not None:
            raise RpcError(
                "unknown",
                "error closing stdin: cannot close stdin for PTY process — send Ctrl+D (0x04) instead",
            )
        async with self._input_lock:
            if self._stdin_fd is not None:
                os.close(self._stdin_fd)
                self._stdin_fd = None

    def resize(self, cols: int, rows: int) -> None:
        if self.pty_fd is None:
            raise RpcError("internal", "error resizing tty: tty not assigned to process")
        set_winsize(self.pty_fd, cols, rows)

    def info(self) -> Msg:
        info: Msg = {"config": self.config, "pid": self.pid}
        if self.tag is not None:
            info["tag"] = self.tag
        return info


def set_winsize(fd: int, cols: int, rows: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows & 0xFFFF, cols & 0xFFFF, 0, 0))


class Supervisor:
    """All processes envd started, and the reaper."""

    def __init__(self, reap_all: bool) -> None:
        self._reap_all = reap_all
        self.processes: dict[int, Process] = {}
        self._retained: dict[int, tuple[str | None, Msg, asyncio.TimerHandle]] = {}

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.add_signal_handler(signal.SIGCHLD, self.reap)
        # Exits that happened before the handler was installed.
        loop.call_soon(self.reap)

    def reap(self) -> None:
        if self._reap_all:
            while True:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    return
                if pid == 0:
                    return
                self._deliver(pid, status)
        else:
            for pid, process in list(self.processes.items()):
                if process.status is not None:
                    continue
                try:
                    done, status = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    continue
                if done:
                    self._deliver(pid, status)

    def _deliver(self, pid: int, status: int) -> None:
        process = self.processes.get(pid)
        if process is not None and process.status is None:
            try:
                process.exited(status)
            except Exception as e:  # noqa: BLE001 - keep reaping the others
                log_exception(f"exit of process {pid}", e)
        # Anything else is an orphan re-parented to us (we are PID 1): reaping is all.

    def start(
        self,
        *,
        executable: str,
        argv: list[str],
        env: dict[str, str],
        cwd: str,
        user: User,
        config: Msg,
        tag: str | None,
        stdin: bool,
        pty_size: tuple[int, int] | None,
        lifetime: float | None,
    ) -> Process:
        child_fds: list[int] = []
        parent_fds: list[int] = []
        try:
            if pty_size is not None:
                master, slave = os.openpty()
                parent_fds.append(master)
                child_fds.append(slave)
                set_winsize(master, *pty_size)
                pid = _spawn(executable, argv, env, cwd, user, (slave, slave, slave), True)
                outputs = {master: "pty"}
                stdin_fd, pty_fd = None, master
            else:
                out_r, out_w = os.pipe2(os.O_CLOEXEC)
                parent_fds.append(out_r)
                child_fds.append(out_w)
                err_r, err_w = os.pipe2(os.O_CLOEXEC)
                parent_fds.append(err_r)
                child_fds.append(err_w)
                in_w: int | None = None
                if stdin:
                    in_r, in_w = os.pipe2(os.O_CLOEXEC)
                    parent_fds.append(in_w)
                else:
                    in_r = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
                child_fds.append(in_r)
                pid = _spawn(executable, argv, env, cwd, user, (in_r, out_w, err_w), False)
                outputs = {out_r: "stdout", err_r: "stderr"}
                stdin_fd, pty_fd = in_w, None
        except BaseException:
            for fd in parent_fds:
                os.close(fd)
            raise
        finally:
            for fd in child_fds:
                os.close(fd)

        stale = self._retained.pop(pid, None)  # a recycled pid: the old end is not ours
        if stale is not None:
            stale[2].cancel()
        process = Process(self, pid, config, tag, outputs, stdin_fd, pty_fd)
        self.processes[pid] = process
        if lifetime is not None:
            process.set_lifetime(lifetime)
        return process

    def finished(self, process: Process) -> None:
        if self.processes.get(process.pid) is process:
            del self.processes[process.pid]
        assert process.end is not None
        old = self._retained.pop(process.pid, None)
        if old is not None:
            old[2].cancel()
        timer = asyncio.get_running_loop().call_later(RETAIN_END, self._retained.pop, process.pid, None)
        self._retained[process.pid] = (process.tag, process.end, timer)

    def find(self, pid: int | None, tag: str | None) -> Process | None:
        if pid is not None:
            return self.processes.get(pid)
        for process in self.processes.values():
            if tag is not None and process.tag == tag:
                return process
        return None

    def retained(self, pid: int | None, tag: str | None) -> tuple[int, Msg] | None:
        """The end event of a recently exited process, for a late Connect."""
        for retained_pid, (retained_tag, end, _) in self._retained.items():
            if (pid is not None and retained_pid == pid) or (
                pid is None and tag is not None and retained_tag == tag
            ):
                return retained_pid, end
        return None

    def shutdown(self) -> None:
        for process in list(self.processes.values()):
            process.signal(signal.SIGKILL)


def _spawn(
    executable: str,
    argv: list[str],
    env: dict[str, str],
    cwd: str,
    user: User,
    stdio: tuple[int, int, int],
    controlling_tty: bool,
) -> int:
    global _fast_spawn_ok
    if not controlling_tty and _fast_spawn_ok:
        try:
            pid = _fast_spawn(executable, argv, env, cwd, user, stdio)
        except TypeError:
            # An interpreter whose private fork_exec has another signature: use the
            # portable path from now on.
            _fast_spawn_ok = False
        else:
            _adjust_oom(pid)
            return pid
    return _fork_exec(executable, argv, env, cwd, user, stdio, controlling_tty)


def _adjust_oom(pid: int) -> None:
    """Like Go envd: sandbox commands are killed before envd when memory runs out.

    A child inherits envd's -1000 (never an OOM victim) until this; written by envd, which
    has CAP_SYS_RESOURCE, it also raises the child's floor (`oom_score_adj_min`) to 100, so
    the command cannot lower itself back to -1000 later."""
    try:
        fd = os.open(f"/proc/{pid}/oom_score_adj", os.O_WRONLY)
    except OSError:
        return
    try:
        os.write(fd, b"100")
    except OSError:
        pass
    finally:
        os.close(fd)


# `_posixsubprocess.fork_exec` (what `subprocess` uses) forks in C — with vfork when no
# credentials change — so nothing in the child touches Python objects. That makes a
# spawn ~4x faster (0.7 ms instead of 3 ms) than os.fork() followed by Python code.
# Its signature is private and version-specific: only the one of CPython 3.11/3.12 is
# used, anything else takes the portable os.fork() path below.
_c_fork_exec: Callable[..., Any] | None
try:
    import _posixsubprocess

    _c_fork_exec = _posixsubprocess.fork_exec
except ImportError:  # pragma: no cover - not CPython
    _c_fork_exec = None
_fast_spawn_ok = _c_fork_exec is not None and sys.version_info[:2] in ((3, 11), (3, 12))


def _fast_spawn(
    executable: str,
    argv: list[str],
    env: dict[str, str],
    cwd: str,
    user: User,
    stdio: tuple[int, int, int],
) -> int:
    same = user.uid == os.geteuid() and user.gid == os.getegid()
    env_list = [os.fsencode(k) + b"=" + os.fsencode(v) for k, v in env.items()]
    report_r, report_w = os.pipe2(os.O_CLOEXEC)
    try:
        assert _c_fork_exec is not None
        pid = int(
            _c_fork_exec(
                [os.fsencode(a) for a in argv],
                (os.fsencode(executable),),
                True,  # close every other fd
                (),
                cwd,
                env_list,
                stdio[0], -1,  # stdin: child end, parent end
                -1, stdio[1],  # stdout
                -1, stdio[2],  # stderr
                report_r, report_w,
                True,  # restore SIGPIPE/SIGXFSZ, which Python ignores
                True,  # setsid: the command leads its own session and process group
                -1,  # no other process group
                -1 if same else user.gid,
                None if same else list(user.groups),
                -1 if same else user.uid,
                -1,  # umask unchanged
                None,  # no preexec_fn (it would rule out vfork)
                True,  # allow vfork
            )
        )
    finally:
        os.close(report_w)
    report = _failure_report(pid, report_r)
    if report:
        # "OSError:<hex errno>:<where>", as subprocess reads it
        _, _, rest = report.decode("utf-8", "replace").partition(":")
        hex_errno, _, where = rest.partition(":")
        try:
            reason = os.strerror(int(hex_errno, 16))
        except ValueError:
            reason = rest
        if where == "noexec:chdir":
            raise SpawnError(f"chdir {cwd}: {reason}")
        if where == "noexec":
            raise SpawnError(f"{reason}")
        raise SpawnError(f"exec {executable}: {reason}")
    return pid


def _failure_report(pid: int, report_r: int) -> bytes:
    """What a child wrote to the close-on-exec report pipe before dying (empty: exec worked).
    A child that failed is reaped here, since no one else knows about it."""
    try:
        report = _read_all(report_r)
    finally:
        os.close(report_r)
    if report:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
    return report


def _read_all(fd: int) -> bytes:
    out = bytearray()
    while True:
        chunk = os.read(fd, 4096)
        if not chunk:
            return bytes(out)
        out += chunk


def _fork_exec(
    executable: str,
    argv: list[str],
    env: dict[str, str],
    cwd: str,
    user: User,
    stdio: tuple[int, int, int],
    controlling_tty: bool,
) -> int:
    """fork + exec as `user` in a new session; errors in the child come back over a pipe.

    Only plain os calls run between fork and exec (envd has no threads, so no lock can be
    held by a thread that does not exist in the child).
    """
    switch_user = os.geteuid() == 0 or user.uid != os.geteuid()
    report_r, report_w = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child; its failures are reported below
        try:
            os.close(report_r)
            os.setsid()
            if controlling_tty:
                fcntl.ioctl(stdio[0], termios.TIOCSCTTY, 0)
            for target, fd in enumerate(stdio):
                os.dup2(fd, target)
            os.closerange(3, report_w)
            os.closerange(report_w + 1, 1 << 20)
            # Python ignores these; an ignored disposition would survive exec.
            for number in (signal.SIGPIPE, signal.SIGXFSZ):
                signal.signal(number, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_SETMASK, [])
            try:
                # Like Go envd: sandbox commands die before envd (-1000) when memory runs
                # out. Before dropping root: then the floor rises too (see _adjust_oom).
                fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY)
                os.write(fd, b"100")
                os.close(fd)
            except OSError:
                pass
            if switch_user:
                os.setgroups(list(user.groups))
                os.setgid(user.gid)
                os.setuid(user.uid)
            os.chdir(cwd)
            os.execve(executable, argv, env)
        except BaseException as e:  # noqa: BLE001
            try:
                os.write(report_w, f"{type(e).__name__}: {e}".encode("utf-8", "replace"))
            finally:
                os._exit(127)
        os._exit(127)
    os.close(report_w)
    report = _failure_report(pid, report_r)
    if report:
        raise SpawnError(report.decode("utf-8", "replace"))
    return pid

