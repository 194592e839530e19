"""One rollout: a sandbox and the steps an agent takes in it (run a command, write files, read
a file), its reward, and `branch` (fork the running rollout, for tree search).

Owns: the `Rollout` handle over one `AsyncSandbox`, `Outcome` (what a command returned), the
`Reward` hook, and forking with retries of children that failed to start (`fork_children`).
Must not touch: the lifetime of sandboxes beyond registering them with the scope's
`SandboxTracker` (the pool or group that owns them kills them).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import httpx
from e2b import (
    AsyncSandbox,
    CommandExitException,
    GuestUnresponsiveException,
    NotFoundException,
    RateLimitException,
    SandboxException,
    SandboxNotFoundException,
    SandboxNotRunningException,
    SandboxUnreachableException,
    ServiceBusyException,
    TimeoutException,
)
from e2b.sandbox.filesystem.filesystem import WriteEntry
from e2b.sandbox.sandbox_api import MAX_FORK_COUNT

from aenv.rollouts.tracker import SandboxTracker

# Failures of the sandbox rather than of the agent's work: a child that hit one is replaced by
# a fresh fork and its work run again. A command's non-zero exit is an `Outcome`, never these.
SANDBOX_FAILURES: tuple[type[BaseException], ...] = (
    TimeoutException, NotFoundException, SandboxNotFoundException, SandboxNotRunningException,
    SandboxUnreachableException, GuestUnresponsiveException, RateLimitException,
    ServiceBusyException, httpx.TransportError)


class ForkFailed(Exception):
    """Children of a fork still failing to start after the retries."""

    def __init__(self, parent_id: str, wanted: int, errors: list[Exception]) -> None:
        super().__init__(f"fork of {parent_id}: {len(errors)} of {wanted} children failed to start "
                         f"after retries; last error: {errors[-1]!r}")
        self.parent_id = parent_id
        self.errors = errors


@dataclass(frozen=True)
class Outcome:
    """What a command returned. A non-zero exit is a result, not an exception."""

    exit_code: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


def passed(outcome: Outcome) -> float:
    """1.0 when the command exited 0, else 0.0 (a test suite as a reward)."""
    return 1.0 if outcome.ok else 0.0


@dataclass(frozen=True)
class Reward:
    """A reward hook: run `command` in the rollout and turn its outcome into a float."""

    command: str
    score: Callable[[Outcome], float] = passed
    cwd: str | None = None
    timeout_s: float = 120

    async def __call__(self, rollout: Rollout) -> float:
        return float(self.score(await rollout.run(self.command, cwd=self.cwd, timeout_s=self.timeout_s)))


class Rollout:
    """A running sandbox on a rollout's path. Created by a pool, a group or `branch`, never
    directly: its scope's tracker owns its lifetime."""

    def __init__(self, sandbox: AsyncSandbox, tracker: SandboxTracker, *, retries: int = 2,
                 timeout_s: int = 600) -> None:
        self.sandbox = sandbox
        self._tracker = tracker
        self._retries = retries
        self._timeout_s = timeout_s

    @property
    def sandbox_id(self) -> str:
        return self.sandbox.sandbox_id

    def __repr__(self) -> str:
        return f"Rollout({self.sandbox_id})"

    async def run(self, command: str, *, cwd: str | None = None, envs: Mapping[str, str] | None = None,
                  user: str | None = None, timeout_s: float = 60) -> Outcome:
        started = time.monotonic()
        try:
            result = await self.sandbox.commands.run(
                command, cwd=cwd, envs=dict(envs) if envs else None, user=user,
                timeout=timeout_s)
        except CommandExitException as exited:
            return Outcome(exited.exit_code, exited.stdout, exited.stderr, time.monotonic() - started)
        return Outcome(result.exit_code, result.stdout, result.stderr, time.monotonic() - started)

    async def write(self, files: Mapping[str, str | bytes]) -> None:
        """Write several files in one request (parent directories are created)."""
        await self.sandbox.files.write_files([WriteEntry(path=p, data=d) for p, d in files.items()])

    async def read(self, path: str) -> str:
        return await self.sandbox.files.read(path)

    async def score(self, reward: Reward) -> float:
        return await reward(self)

    async def branch(self, count: int) -> list[Rollout]:
        """`count` forks of this rollout as it is now (memory, processes, files), in the same
        scope. The rollout itself goes on unchanged: tree search keeps or drops it."""
        children = await fork_children(self.sandbox, count, self._tracker, retries=self._retries,
                                       timeout_s=self._timeout_s)
        return [Rollout(c, self._tracker, retries=self._retries, timeout_s=self._timeout_s)
                for c in children]

    async def kill(self) -> None:
        await self._tracker.kill(self.sandbox)


async def fork_children(parent: AsyncSandbox, count: int, tracker: SandboxTracker, *, retries: int,
                        timeout_s: int) -> list[AsyncSandbox]:
    """`count` running children of `parent`, every one registered with `tracker` as soon as the
    server returns it. Children that failed to start are asked for again, up to `retries`
    more times. The SDK sends at most MAX_FORK_COUNT (20) per fork call: larger counts are
    several calls at once (each captures the parent once; the server serialises captures)."""
    children: list[AsyncSandbox] = []
    errors: list[Exception] = []
    missing = count
    for _ in range(retries + 1):
        chunks = [min(MAX_FORK_COUNT, missing - i) for i in range(0, missing, MAX_FORK_COUNT)]
        results = await _gather_forks(parent, chunks, tracker, timeout_s)
        for result in results:
            if isinstance(result, AsyncSandbox):
                children.append(result)
            else:
                errors.append(result)
        missing = count - len(children)
        if not missing:
            return children
    raise ForkFailed(parent.sandbox_id, count, errors)


async def _gather_forks(parent: AsyncSandbox, chunks: list[int], tracker: SandboxTracker,
                        timeout_s: int) -> list[AsyncSandbox | Exception]:
    def one(n: int) -> Callable[[], Awaitable[list[AsyncSandbox | Exception]]]:
        async def call() -> list[AsyncSandbox | Exception]:
            try:
                return list(await parent.fork(count=n, timeout=timeout_s))
            except SandboxException as exc:  # the whole call failed: each child counts as failed
                if not isinstance(exc, SANDBOX_FAILURES):
                    raise
                return [exc] * n
        return call

    def started(results: list[AsyncSandbox | Exception]) -> list[AsyncSandbox]:
        return [r for r in results if isinstance(r, AsyncSandbox)]

    per_call = await asyncio.gather(*[tracker.request(one(n), started, reserve=n) for n in chunks])
    return [r for results in per_call for r in results]
