"""A minimal asyncio QMP (QEMU Machine Protocol) client.

Owns: one connection to one QEMU's QMP unix socket, for the duration of an `async with`.
Must not touch: anything but that socket. No module state: every call site opens its own
connection (QEMU accepts one QMP client at a time per monitor, so the driver serialises
its calls per VM with a lock).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from aenv.errors import AenvError, ErrorCode


class QmpError(AenvError):
    def __init__(self, command: str, error: dict[str, Any]) -> None:
        super().__init__(ErrorCode.INTERNAL,
                         f"qemu {command}: {error.get('class')}: {error.get('desc')}")
        self.error_class = str(error.get("class"))


class Qmp:
    """`async with Qmp(path) as qmp: await qmp.execute("stop")`."""

    def __init__(self, path: Path, timeout: float = 60.0) -> None:
        self.path = path
        self.timeout = timeout
        self.events: list[dict[str, Any]] = []
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def __aenter__(self) -> Self:
        try:
            self._reader, self._writer = await asyncio.wait_for(
                asyncio.open_unix_connection(str(self.path), limit=1 << 22), self.timeout)
            greeting = await asyncio.wait_for(self._read(), self.timeout)
            if "QMP" not in greeting:
                raise AenvError(ErrorCode.INTERNAL, f"qemu: unexpected QMP greeting {greeting}")
            await self.execute("qmp_capabilities")
        except (OSError, TimeoutError) as exc:
            await self.close()
            raise AenvError(ErrorCode.UNAVAILABLE, f"qemu monitor {self.path}: {exc!r}") from None
        return self

    async def __aexit__(self, et: type[BaseException] | None, ev: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(Exception):
                await self._writer.wait_closed()
            self._writer = None

    async def _read(self) -> dict[str, Any]:
        assert self._reader is not None
        line = await self._reader.readline()  # callers bound the wait
        if not line:
            raise AenvError(ErrorCode.UNAVAILABLE, f"qemu monitor {self.path} closed")
        msg: dict[str, Any] = json.loads(line)
        return msg

    async def execute(self, command: str, timeout: float | None = None,
                      **arguments: Any) -> Any:
        """Run one command and return its `return` value; events seen meanwhile are kept
        in `self.events`."""
        assert self._writer is not None
        req: dict[str, Any] = {"execute": command}
        if arguments:
            req["arguments"] = arguments
        self._writer.write(json.dumps(req).encode() + b"\n")
        await self._writer.drain()
        try:
            async with asyncio.timeout(timeout or self.timeout):
                while True:
                    msg = await self._read()
                    if "event" in msg:
                        self.events.append(msg)
                        continue
                    if "error" in msg:
                        raise QmpError(command, msg["error"])
                    return msg.get("return")
        except TimeoutError:
            raise AenvError(ErrorCode.TIMEOUT, f"qemu {command}: no answer from {self.path} "
                            f"in {timeout or self.timeout:.0f} s") from None

    async def wait_event(self, name: str, timeout: float) -> dict[str, Any]:
        for i, event in enumerate(self.events):
            if event.get("event") == name:
                return self.events.pop(i)
        try:
            async with asyncio.timeout(timeout):
                while True:
                    msg = await self._read()
                    if msg.get("event") == name:
                        return msg
                    if "event" in msg:
                        self.events.append(msg)
        except TimeoutError:
            raise AenvError(ErrorCode.TIMEOUT, f"qemu: no {name} event in {timeout:.0f} s"
                            ) from None
