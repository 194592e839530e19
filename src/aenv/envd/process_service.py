"""The `process.Process` Connect service: Start, Connect, List, SendInput, StreamInput,
SendSignal, Update (PTY resize) and CloseStdin.

Owns: turning requests into `Supervisor` calls — the user, environment, working
directory and executable a command runs with — and turning a process's output into the
`ProcessEvent` stream (start first, then data/keepalive, then end).

Environment: PATH (a fixed default), HOME, USER, LOGNAME and SHELL from the user, then the
sandbox-wide `EnvdSettings.env_vars`, then the request's envs; later values win.

The SDK runs everything through `/bin/bash -l -c CMD` (commands) and `/bin/bash -i -l`
(PTY). Userlands without bash (Alpine, distroless with busybox) get `/bin/sh` instead,
with the same arguments: dash and busybox ash accept `-l`, `-i` and `-c` too.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from aenv.envd.connect import Call, Method, ServerStream, client_stream, server_stream, unary
from aenv.envd.entries import resolve_path
from aenv.envd.errors import RpcError, invalid, not_found
from aenv.envd.log import log
from aenv.envd.process import Process, SpawnError, Subscriber
from aenv.envd.proto import (
    Msg,
    b64,
    get_bytes,
    get_enum,
    get_int,
    get_msg,
    get_opt_bool,
    get_opt_str,
    get_str,
    get_str_list,
    get_str_map,
    has,
)
from aenv.envd.users import User

if TYPE_CHECKING:
    from aenv.envd.server import App

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
SIGNALS = {"SIGNAL_UNSPECIFIED": 0, "SIGNAL_SIGTERM": 15, "SIGNAL_SIGKILL": 9}


def build_env(user: User, sandbox_env: dict[str, str], request_env: dict[str, str]) -> dict[str, str]:
    env = {
        "PATH": DEFAULT_PATH,
        "HOME": user.home,
        "USER": user.name,
        "LOGNAME": user.name,
        "SHELL": user.shell,
    }
    env.update(sandbox_env)
    env.update(request_env)
    return env


def find_executable(cmd: str, path: str) -> str:
    if cmd == "/bin/bash" and not os.access(cmd, os.X_OK):
        return "/bin/sh"
    if "/" in cmd:
        return cmd  # relative ones are resolved by execve after the chdir
    for directory in path.split(":"):
        candidate = os.path.join(directory or ".", cmd)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    raise invalid(f"error starting process '{cmd}': exec: \"{cmd}\": executable file not found in $PATH")


async def pump(subscriber: Subscriber, stream: ServerStream, keepalive: float) -> None:
    """Forward a process's events to a stream until (and including) its end event."""
    while True:
        item = await subscriber.get(keepalive)
        if item is None:
            await stream.send({"event": {"keepalive": {}}})
            continue
        kind, payload = item
        if kind == "end":
            await stream.send({"event": {"end": payload}})
            return
        assert isinstance(payload, bytes)
        await stream.send({"event": {"data": {kind: b64(payload)}}})


async def follow(process: Process, stream: ServerStream, keepalive: float) -> None:
    """A process stream: its `start` event first (flushed at once), then its events to the end."""
    subscriber = process.subscribe()
    try:
        await stream.send({"event": {"start": {"pid": process.pid}}})
        await pump(subscriber, stream, keepalive)
    finally:
        subscriber.close()


def _encodable(*texts: str) -> bool:
    """Whether each text has bytes for execve (a lone surrogate from JSON has none)."""
    try:
        for text in texts:
            os.fsencode(text)
    except UnicodeEncodeError:
        return False
    return True


def _selector(message: Msg) -> tuple[int | None, str | None]:
    selector = get_msg(message, "process")
    if has(selector, "pid"):
        return get_int(selector, "pid"), None
    if has(selector, "tag"):
        return None, get_str(selector, "tag")
    raise RpcError("unimplemented", "invalid process selector")


class ProcessService:
    def __init__(self, app: App) -> None:
        self.app = app

    def methods(self) -> dict[str, Method]:
        prefix = "/process.Process/"
        return {
            prefix + "Start": server_stream(self.start),
            prefix + "Connect": server_stream(self.connect),
            prefix + "List": unary(self.list),
            prefix + "SendInput": unary(self.send_input),
            prefix + "StreamInput": client_stream(self.stream_input),
            prefix + "SendSignal": unary(self.send_signal),
            prefix + "Update": unary(self.update),
            prefix + "CloseStdin": unary(self.close_stdin),
        }

    def _get(self, message: Msg) -> Process:
        pid, tag = _selector(message)
        process = self.app.supervisor.find(pid, tag)
        if process is None:
            if pid is not None:
                raise not_found(f"process with pid {pid} not found")
            raise not_found(f"process with tag {tag} not found")
        return process

    async def start(self, call: Call, message: Msg, stream: ServerStream) -> None:
        settings = self.app.settings
        user = self.app.user(call.username)
        config = get_msg(message, "process")
        cmd = get_str(config, "cmd")
        args = get_str_list(config, "args")
        envs = get_str_map(config, "envs")
        cwd = get_opt_str(config, "cwd")
        tag = get_opt_str(message, "tag")
        stdin = get_opt_bool(message, "stdin")
        pty_size = None
        if has(message, "pty"):
            size = get_msg(get_msg(message, "pty"), "size")
            pty_size = (get_int(size, "cols"), get_int(size, "rows"))
        if not cmd:
            raise invalid("process cmd must not be empty")
        for key, value in envs.items():
            if not key or "=" in key or "\0" in key or "\0" in value or not _encodable(key, value):
                raise invalid(f"invalid environment variable {key!r}")
        if any("\0" in arg for arg in (cmd, *args)):
            raise invalid("arguments must not contain NUL bytes")
        if not _encodable(cmd, *args):
            raise invalid("arguments must be representable as bytes (no lone surrogates)")

        workdir = resolve_path(cwd or "", user, settings.default_workdir)
        if not os.path.exists(workdir):
            raise invalid(f"cwd '{workdir}' does not exist")
        env = build_env(user, settings.env_vars, envs)
        executable = find_executable(cmd, env.get("PATH", DEFAULT_PATH))
        argv = [executable if cmd == "/bin/bash" else cmd, *args]

        stored: Msg = {"cmd": cmd, "args": args, "envs": envs}
        if cwd is not None:
            stored["cwd"] = cwd
        try:
            process = self.app.supervisor.start(
                executable=executable,
                argv=argv,
                env=env,
                cwd=workdir,
                user=user,
                config=stored,
                tag=tag,
                stdin=stdin is not False,
                pty_size=pty_size,
                # Connect-Timeout-Ms is the process's lifetime, whether or not the
                # client stays connected: envd kills it when the time is up.
                lifetime=call.timeout,
            )
        except SpawnError as e:
            raise invalid(f"error starting process '{' '.join([cmd, *args])[:200]}': {e}") from None
        except OSError as e:
            raise RpcError("internal", f"error starting process: {e.strerror}") from None
        # One line per process: the sandbox's log (GET /sandboxes/{id}/logs on the host).
        log(f"process {process.pid} started as {user.name}"
            f"{f' (tag {tag})' if tag else ''}: {' '.join([cmd, *args])[:200]}")
        await follow(process, stream, call.keepalive)

    async def connect(self, call: Call, message: Msg, stream: ServerStream) -> None:
        pid, tag = _selector(message)
        process = self.app.supervisor.find(pid, tag)
        if process is None:
            retained = self.app.supervisor.retained(pid, tag)
            if retained is None:
                if pid is not None:
                    raise not_found(f"process with pid {pid} not found")
                raise not_found(f"process with tag {tag} not found")
            retained_pid, end = retained
            await stream.send({"event": {"start": {"pid": retained_pid}}})
            await stream.send({"event": {"end": end}})
            return
        # The Connect deadline bounds this stream only; the process keeps running.
        await follow(process, stream, call.keepalive)

    async def list(self, call: Call, message: Msg) -> Msg:
        processes = [p.info() for p in self.app.supervisor.processes.values() if p.end is None]
        return {"processes": processes} if processes else {}

    async def _input(self, process: Process, payload: Msg, call: Call) -> None:
        if has(payload, "stdin"):
            write = process.write_stdin(get_bytes(payload, "stdin"))
        elif has(payload, "pty"):
            write = process.write_pty(get_bytes(payload, "pty"))
        else:
            raise RpcError("unimplemented", "invalid input type")
        remaining = call.remaining()
        if remaining is None:
            await write
            return
        try:
            await asyncio.wait_for(write, remaining)
        except TimeoutError:
            raise RpcError("deadline_exceeded", "context deadline exceeded") from None

    async def send_input(self, call: Call, message: Msg) -> Msg:
        process = self._get(message)
        await self._input(process, get_msg(message, "input"), call)
        return {}

    async def stream_input(self, call: Call, messages: AsyncIterator[Msg]) -> Msg:
        process: Process | None = None
        async for event in messages:
            if has(event, "start"):
                process = self._get(get_msg(event, "start"))
            elif has(event, "data"):
                if process is None:
                    raise RpcError("failed_precondition", "input stream must open with a start event")
                await self._input(process, get_msg(get_msg(event, "data"), "input"), call)
            elif has(event, "keepalive"):
                pass
            else:
                raise RpcError("unimplemented", "invalid event type")
        return {}

    async def send_signal(self, call: Call, message: Msg) -> Msg:
        process = self._get(message)
        number = get_enum(message, "signal", SIGNALS)
        if number == 9:
            process.signal(signal.SIGKILL)
        elif number == 15:
            process.signal(signal.SIGTERM)
        else:
            raise RpcError("unimplemented", f"invalid signal: {message.get('signal')}")
        return {}

    async def update(self, call: Call, message: Msg) -> Msg:
        process = self._get(message)
        if has(message, "pty"):
            size = get_msg(get_msg(message, "pty"), "size")
            try:
                process.resize(get_int(size, "cols"), get_int(size, "rows"))
            except OSError as e:
                raise RpcError("internal", f"error resizing tty: {e.strerror}") from None
        return {}

    async def close_stdin(self, call: Call, message: Msg) -> Msg:
        process = self._get(message)
        await process.close_stdin()
        return {}
