"""`aenv start` without --detach: an interactive terminal attached to a sandbox PTY via envd."""

from __future__ import annotations

import base64
import os
import shutil
import signal
import sys
import termios
import threading
import tty
from types import FrameType

from aenv.cli.client import ApiError, Client


def attach_shell(client: Client, sandbox_id: str, token: str | None) -> int:
    cols, rows = shutil.get_terminal_size()
    start = {"process": {"cmd": "/bin/bash", "args": ["-i", "-l"],
                         "envs": {"TERM": os.environ.get("TERM", "xterm-256color")}},
             "pty": {"size": {"cols": cols, "rows": rows}}}
    events = client.stream(sandbox_id, token, "process.Process/Start", start)
    first = next(events)
    pid = first["event"]["start"]["pid"]
    exit_code = [0]

    def pump_output() -> None:
        try:
            for msg in events:
                event = msg.get("event", {})
                if "data" in event and "pty" in event["data"]:
                    os.write(sys.stdout.fileno(), base64.b64decode(event["data"]["pty"]))
                elif "end" in event:
                    exit_code[0] = int(event["end"].get("exitCode", 0))
        except ApiError as exc:
            sys.stderr.write(f"\r\naenv: {exc}\r\n")
        finally:
            os.kill(os.getpid(), signal.SIGUSR1)  # wake the stdin loop

    def on_resize(_sig: int, _frame: FrameType | None) -> None:
        c, r = shutil.get_terminal_size()
        try:
            client.rpc(sandbox_id, token, "process.Process/Update",
                       {"process": {"pid": pid}, "pty": {"size": {"cols": c, "rows": r}}})
        except ApiError:
            pass

    finished = threading.Event()

    def on_done(_sig: int, _frame: FrameType | None) -> None:
        finished.set()
        raise InterruptedError

    reader = threading.Thread(target=pump_output, daemon=True)
    reader.start()
    signal.signal(signal.SIGWINCH, on_resize)
    signal.signal(signal.SIGUSR1, on_done)
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd) if os.isatty(fd) else None
    try:
        if saved is not None:
            tty.setraw(fd)
        while not finished.is_set():
            try:
                data = os.read(fd, 4096)
            except InterruptedError:
                break
            if not data:
                break
            client.rpc(sandbox_id, token, "process.Process/SendInput",
                       {"process": {"pid": pid}, "input": {"pty": base64.b64encode(data).decode()}})
    finally:
        if saved is not None:
            termios.tcsetattr(fd, termios.TCSADRAIN, saved)
    return exit_code[0]
