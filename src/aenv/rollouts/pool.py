"""Groups of rollouts forked from a snapshot, kept ready ahead of use.

Owns: the pool's seed (one sandbox created from the snapshot, or the set-up sandbox itself
when the pool is given a `Setup`: no snapshot to take, nothing persisted; every group is one
`fork(count=N)` of it, so a group costs one capture of an idle sandbox and N restores), the
groups it made (ready or in use), the background refill, the pool-wide capacity, the retry of
a child whose sandbox failed, and the final sweep: every sandbox of a pool carries the pool's
metadata tag (forks inherit their parent's metadata), and closing the pool kills whatever
still carries it.
Must not touch: the snapshot itself (its owner deletes it), sandboxes of other pools.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Self, TypeVar

from e2b import AsyncSandbox, SandboxQuery

from aenv.rollouts.rollout import SANDBOX_FAILURES, Reward, Rollout, fork_children
from aenv.rollouts.snapshot import Setup, Snapshot
from aenv.rollouts.tracker import Capacity, SandboxTracker

log = logging.getLogger(__name__)
T = TypeVar("T")
POOL_TAG = "aenv-rollouts-pool"  # metadata key: the id of the pool a sandbox belongs to


class Group:
    """N rollouts forked at the same moment from the same state. Killed, with every branch
    made from them, when the `pool.group()` block ends."""

    def __init__(self, rollouts: list[Rollout], tracker: SandboxTracker,
                 replace: Callable[[SandboxTracker], Awaitable[Rollout]], retries: int) -> None:
        self.rollouts = rollouts
        self._tracker = tracker
        self._replace = replace
        self._retries = retries

    def __len__(self) -> int:
        return len(self.rollouts)

    async def map(self, work: Callable[[Rollout], Awaitable[T]]) -> list[T]:
        """`work(rollout)` on every rollout at once; results in the group's order. A rollout
        whose sandbox fails (see SANDBOX_FAILURES) is replaced by a fresh fork of the same
        state and its work run again, up to the pool's `retries`; any other exception cancels
        the others and propagates."""
        async def one(i: int) -> T:
            retries_left = self._retries
            while True:
                try:
                    return await work(self.rollouts[i])
                except SANDBOX_FAILURES as exc:
                    if not retries_left:
                        raise
                    retries_left -= 1
                    log.warning("rollout %s failed (%r): retrying on a fresh fork",
                                self.rollouts[i].sandbox_id, exc)
                    await self.rollouts[i].kill()
                    self.rollouts[i] = await self._replace(self._tracker)

        tasks = [asyncio.ensure_future(one(i)) for i in range(len(self.rollouts))]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:  # one failed (or we were cancelled): stop the rest
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def scores(self, reward: Reward) -> list[float]:
        return await self.map(reward)

    async def best(self, reward: Reward) -> tuple[Rollout, float]:
        scores = await self.scores(reward)
        top = max(range(len(scores)), key=scores.__getitem__)
        return self.rollouts[top], scores[top]

    async def close(self) -> None:
        await self._tracker.close()


class RolloutPool:
    """Keeps `ready_groups` groups of `group_size` forks of `source` ready: a snapshot (or its
    id), or a `Setup` that the pool runs once in its seed.

        async with RolloutPool(snapshot, group_size=16) as pool:
            async with pool.group() as group:
                rewards = await group.scores(Reward("pytest -q"))

    `max_sandboxes` bounds the sandboxes alive at once (seed, ready groups, groups in use and
    their branches); a request beyond it waits. `retries`: how many times a child that failed
    to start, or whose sandbox failed under its work, is replaced."""

    def __init__(self, source: Snapshot | str | Setup, group_size: int, *, ready_groups: int = 1,
                 max_sandboxes: int = 100, retries: int = 2, timeout_s: int = 600) -> None:
        if group_size < 1 or ready_groups < 0:
            raise ValueError("group_size must be >= 1 and ready_groups >= 0")
        if max_sandboxes < 1 + group_size * max(1, ready_groups):
            raise ValueError(f"max_sandboxes={max_sandboxes} cannot hold the seed and "
                             f"{max(1, ready_groups)} group(s) of {group_size}")
        self._source = source
        self.group_size = group_size
        self.pool_id = uuid.uuid4().hex[:16]
        self._ready_groups = ready_groups
        self._retries = retries
        self._timeout_s = timeout_s
        self._capacity = Capacity(max_sandboxes)
        self._tracker = SandboxTracker(self._capacity)  # the seed
        self._seed: AsyncSandbox | None = None
        self._groups: set[Group] = set()
        self._ready: asyncio.Queue[Group | Exception] = asyncio.Queue()
        self._ready_slots = asyncio.Semaphore(ready_groups)
        self._refill_task: asyncio.Task[None] | None = None

    @property
    def live_sandboxes(self) -> int:
        return self._capacity.in_use

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        try:
            self._seed = await self._make_seed()
        except BaseException:
            await self.close()
            raise
        if self._ready_groups:
            self._refill_task = asyncio.create_task(self._refill(), name=f"rollout-pool-{self.pool_id}")

    async def _make_seed(self) -> AsyncSandbox:
        tag = {POOL_TAG: self.pool_id}
        if isinstance(self._source, Setup):
            return await self._source.prepare(self._tracker, metadata=tag, timeout_s=self._timeout_s)
        template = self._source.snapshot_id if isinstance(self._source, Snapshot) else self._source
        return await self._tracker.request(
            lambda: AsyncSandbox.create(template, timeout=self._timeout_s, metadata=tag),
            lambda s: [s])

    @asynccontextmanager
    async def group(self) -> AsyncIterator[Group]:
        """A group of `group_size` running rollouts; all killed when the block ends."""
        if self._ready_groups:
            item = await self._ready.get()
            self._ready_slots.release()
            if isinstance(item, Exception):
                raise item
            group = item
        else:
            group = await self._make_group()
        try:
            yield group
        finally:
            self._groups.discard(group)
            await group.close()

    async def map(self, work: Callable[[Rollout], Awaitable[T]]) -> list[T]:
        """One group, `work` on each of its rollouts (see `Group.map`)."""
        async with self.group() as group:
            return await group.map(work)

    async def close(self) -> None:
        """Stop refilling, kill every group, the seed, and anything else tagged with this pool
        (e.g. children of a fork request that was interrupted)."""
        await asyncio.shield(self._close())

    async def _close(self) -> None:
        if self._refill_task is not None:
            self._refill_task.cancel()
            await asyncio.gather(self._refill_task, return_exceptions=True)
        await asyncio.gather(*[g.close() for g in list(self._groups)])
        self._groups.clear()
        await self._tracker.close()
        await self._sweep()

    async def _sweep(self) -> None:
        try:
            listing = AsyncSandbox.list(query=SandboxQuery(metadata={POOL_TAG: self.pool_id}), limit=100)
            left = [s.sandbox_id for s in await listing.next_items()]
            while listing.has_next:
                left += [s.sandbox_id for s in await listing.next_items()]
        except Exception as exc:  # noqa: BLE001 - a backstop: report, do not mask the real error
            log.warning("listing the sandboxes of pool %s failed: %r", self.pool_id, exc)
            return
        if left:
            log.warning("pool %s: killing %d sandbox(es) left behind", self.pool_id, len(left))
            await asyncio.gather(*[AsyncSandbox.kill(s) for s in left], return_exceptions=True)

    async def _refill(self) -> None:
        while True:
            await self._ready_slots.acquire()
            try:
                item: Group | Exception = await self._make_group()
            except Exception as exc:  # noqa: BLE001 - handed to the caller waiting for a group
                item = exc
                await asyncio.sleep(1)  # do not hammer a server that refuses
            await self._ready.put(item)

    async def _make_group(self) -> Group:
        assert self._seed is not None, "start() the pool first"
        # The seed idles between groups: keep it from reaching its timeout (and being paused).
        await self._seed.set_timeout(self._timeout_s)
        tracker = SandboxTracker(self._capacity)
        try:
            children = await fork_children(self._seed, self.group_size, tracker,
                                           retries=self._retries, timeout_s=self._timeout_s)
        except BaseException:
            await tracker.close()
            raise
        group = Group([self._rollout(c, tracker) for c in children], tracker, self._one_more,
                      self._retries)
        self._groups.add(group)
        return group

    async def _one_more(self, tracker: SandboxTracker) -> Rollout:
        """A replacement for a failed rollout: a fresh fork of the seed, in the same group."""
        assert self._seed is not None
        (child,) = await fork_children(self._seed, 1, tracker, retries=self._retries,
                                       timeout_s=self._timeout_s)
        return self._rollout(child, tracker)

    def _rollout(self, sandbox: AsyncSandbox, tracker: SandboxTracker) -> Rollout:
        return Rollout(sandbox, tracker, retries=self._retries, timeout_s=self._timeout_s)
