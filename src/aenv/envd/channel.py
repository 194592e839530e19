"""A single-consumer queue whose `get` can time out without creating a task.

Owns: handing events from loop callbacks (process output, inotify) to the coroutine that
streams them to a client; the timeout is how streams know when to send a keepalive.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class Channel(Generic[T]):
    def __init__(self, limit: int = 0) -> None:
        self._items: deque[T] = deque(maxlen=limit or None)
        self._waiter: asyncio.Future[None] | None = None

    def __len__(self) -> int:
        return len(self._items)

    def push(self, item: T) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def drain(self) -> list[T]:
        items = list(self._items)
        self._items.clear()
        return items

    async def get(self, timeout: float | None) -> T | None:
        """The next item, or None if `timeout` seconds pass without one."""
        if not self._items:
            loop = asyncio.get_running_loop()
            waiter = loop.create_future()
            self._waiter = waiter
            timer = loop.call_later(timeout, _expire, waiter) if timeout is not None else None
            try:
                await waiter
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()
            if not self._items:
                return None
        item = self._items.popleft()
        self.consumed()
        return item

    def consumed(self) -> None:
        """Hook for subclasses: called after each item is taken."""


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
