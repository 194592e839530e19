"""Bookkeeping of the sandboxes a rollout scope (a pool, a group) made, so that none outlives it.

Owns: the set of live `AsyncSandbox`es of one scope and the creation requests in flight, and
killing them all when the scope ends, also when the caller's task is cancelled. A creation
request runs as a task of its own, shielded from the caller's cancellation: the server goes on
creating the sandboxes of a request whose client gave up, so the only way to know their ids is
to let the request finish, then kill what it returned.
Must not touch: sandboxes it did not create (other scopes, other users of the same server).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

from e2b import AsyncSandbox

log = logging.getLogger(__name__)
T = TypeVar("T")


class Capacity:
    """At most `limit` sandboxes alive at once, shared by the trackers of one pool: a request
    waits, first come first served, until the sandboxes it asks for fit."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"capacity must be at least 1, got {limit}")
        self.limit = limit
        self._free = limit
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    @property
    def in_use(self) -> int:
        return self.limit - self._free

    async def acquire(self, n: int) -> None:
        if n > self.limit:
            raise ValueError(f"{n} sandboxes asked for at once, the limit is {self.limit}")
        if not self._waiters and self._free >= n:
            self._free -= n
            return
        granted = asyncio.get_running_loop().create_future()
        self._waiters.append((n, granted))
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():  # granted as the caller was cancelled
                self.release(n)
            else:
                self._wake()  # it may have been the head of the queue, holding others back
            raise

    def release(self, n: int) -> None:
        self._free += n
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            n, granted = self._waiters[0]
            if granted.done():
                self._waiters.popleft()
            elif n <= self._free:
                self._waiters.popleft()
                self._free -= n
                granted.set_result(None)
            else:
                break


class SandboxTracker:
    def __init__(self, capacity: Capacity | None = None) -> None:
        self._live: dict[str, AsyncSandbox] = {}
        self._inflight: set[asyncio.Task[object]] = set()
        self._closed = False
        self._capacity = capacity

    @property
    def live(self) -> list[AsyncSandbox]:
        return list(self._live.values())

    def _adopt(self, sandbox: AsyncSandbox) -> None:
        self._live[sandbox.sandbox_id] = sandbox  # close() waits for requests in flight

    def _release(self, n: int) -> None:
        if self._capacity is not None and n:
            self._capacity.release(n)

    async def request(self, make: Callable[[], Awaitable[T]], adopt: Callable[[T], Iterable[AsyncSandbox]],
                      reserve: int = 1) -> T:
        """Run `make()` (a create or fork call of at most `reserve` sandboxes, counted against
        the capacity) so that the sandboxes it returns are adopted even if the caller is
        cancelled while it runs."""
        if self._closed:
            raise RuntimeError("this rollout scope has ended: its sandboxes were killed")
        if self._capacity is not None:
            await self._capacity.acquire(reserve)

        async def run() -> T:
            adopted = 0
            try:
                result = await make()
                for sandbox in adopt(result):
                    self._adopt(sandbox)
                    adopted += 1
                return result
            finally:
                self._release(reserve - adopted)

        task: asyncio.Task[T] = asyncio.ensure_future(run())
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)
        return await asyncio.shield(task)

    async def kill(self, sandbox: AsyncSandbox) -> None:
        if self._live.pop(sandbox.sandbox_id, None) is not None:
            self._release(1)
            await _kill_quietly(sandbox)

    async def close(self) -> None:
        """Wait for the requests in flight, then kill every sandbox of the scope. Shielded: a
        second cancellation of the caller does not stop the cleanup half-way."""
        await asyncio.shield(self._close())

    async def _close(self) -> None:
        self._closed = True
        while self._inflight:
            await asyncio.gather(*list(self._inflight), return_exceptions=True)
        await asyncio.gather(*[self.kill(s) for s in list(self._live.values())])


async def _kill_quietly(sandbox: AsyncSandbox) -> None:
    try:
        await sandbox.kill()
    except Exception as exc:  # noqa: BLE001 - cleanup goes on: one failed kill must not keep others alive
        log.warning("killing sandbox %s failed: %r", sandbox.sandbox_id, exc)
