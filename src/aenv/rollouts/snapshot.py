"""`setup`: prepare an environment once (files, commands, background processes) and capture it
as a snapshot that rollouts fork from; `Setup`, the description of that preparation.

Owns: the setup sandbox (created, driven and, in `setup()`, always killed here) and the
`Snapshot` value.
Must not touch: sandboxes created from the snapshot (pools and groups own those).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from e2b import AsyncSandbox

from aenv.rollouts.rollout import Outcome, Rollout
from aenv.rollouts.tracker import SandboxTracker


class SetupFailed(Exception):
    """A setup command exited non-zero; the setup sandbox is gone, the outcome says why."""

    def __init__(self, command: str, outcome: Outcome) -> None:
        super().__init__(f"setup command {command!r} exited {outcome.exit_code}: "
                         f"{(outcome.stderr or outcome.stdout)[-2000:]}")
        self.command = command
        self.outcome = outcome


@dataclass(frozen=True)
class Snapshot:
    """A captured environment: `snapshot_id` is a template id for `AsyncSandbox.create`."""

    snapshot_id: str
    template: str
    setup_seconds: float  # the whole setup() call, create_snapshot() included
    capture_seconds: float  # create_snapshot() alone
    metadata: Mapping[str, str] = field(default_factory=dict)

    async def delete(self) -> bool:
        """Remove the snapshot (sandboxes made from it keep running)."""
        return await AsyncSandbox.delete_snapshot(self.snapshot_id)


@dataclass(frozen=True)
class Setup:
    """How to prepare an environment: a sandbox of `template`, `files` written, `commands` run
    in order (each must exit 0), then the `background` commands started (they keep running in
    every fork). `setup()` captures the result as a snapshot; a `RolloutPool` given a `Setup`
    forks the set-up sandbox itself (nothing persisted, no snapshot to take)."""

    template: str = "base"
    commands: Sequence[str] = ()
    files: Mapping[str, str | bytes] = field(default_factory=dict)
    background: Sequence[str] = ()
    cwd: str | None = None
    envs: Mapping[str, str] = field(default_factory=dict)
    command_timeout_s: float = 900

    async def prepare(self, tracker: SandboxTracker, *, metadata: Mapping[str, str],
                      timeout_s: int) -> AsyncSandbox:
        """A set-up sandbox, owned by `tracker` (which kills it with its scope)."""
        sandbox = await tracker.request(
            lambda: AsyncSandbox.create(self.template, timeout=timeout_s, metadata=dict(metadata),
                                        envs=dict(self.envs)),
            lambda s: [s])
        rollout = Rollout(sandbox, tracker)
        if self.files:
            await rollout.write(self.files)
        for command in self.commands:
            outcome = await rollout.run(command, cwd=self.cwd, timeout_s=self.command_timeout_s)
            if not outcome.ok:
                raise SetupFailed(command, outcome)
        for command in self.background:
            handle = await sandbox.commands.run(command, background=True, cwd=self.cwd, timeout=0)
            await handle.disconnect()  # the process runs on; no stream held open in a capture
        return sandbox


async def setup(template: str = "base", commands: Sequence[str] = (), *,
                files: Mapping[str, str | bytes] | None = None, background: Sequence[str] = (),
                cwd: str | None = None, envs: Mapping[str, str] | None = None,
                name: str | None = None, metadata: Mapping[str, str] | None = None,
                command_timeout_s: float = 900, sandbox_timeout_s: int = 3600) -> Snapshot:
    """Prepare the environment (see `Setup`) and snapshot it. The setup sandbox is killed
    whatever happens, cancellation included."""
    started = time.monotonic()
    plan = Setup(template, tuple(commands), dict(files or {}), tuple(background), cwd,
                 dict(envs or {}), command_timeout_s)
    tracker = SandboxTracker()
    try:
        sandbox = await plan.prepare(tracker, metadata=dict(metadata or {}),
                                     timeout_s=sandbox_timeout_s)
        capture_started = time.monotonic()
        info = await sandbox.create_snapshot(name)
        capture_seconds = time.monotonic() - capture_started
    finally:
        await tracker.close()
    return Snapshot(info.snapshot_id, template, time.monotonic() - started, capture_seconds,
                    dict(metadata or {}))
