"""A `gymnasium.Env` over rollouts, for RL frameworks that expect one.

`reset()` hands out a fresh fork of the setup snapshot (a pool of size-1 groups keeps the next
one ready, so a reset does not wait for a restore), `step(action)` runs the action as a shell
command and observes its output, the `Reward` hook scores the state after each step.
Observations and actions are `gymnasium.spaces.Text` over printable ASCII; other characters of
a command's output are replaced by "?", and an output longer than the space is cut to its end
(where errors are). gymnasium's API is synchronous: the env runs its own event loop in a thread
of its own, so it works from plain code and from inside another event loop alike.
Owns: that loop and thread, the pool, and the current episode's sandbox.
Must not touch: the snapshot (its owner deletes it).
"""

from __future__ import annotations

import asyncio
import string
import threading
from collections.abc import Coroutine
from contextlib import AbstractAsyncContextManager
from typing import Any, SupportsFloat, TypeVar

import gymnasium
from gymnasium import spaces

from aenv.rollouts.pool import Group, RolloutPool
from aenv.rollouts.rollout import Outcome, Reward, Rollout
from aenv.rollouts.snapshot import Setup, Snapshot

T = TypeVar("T")
CHARSET = frozenset(string.printable)


def to_observation(outcome: Outcome, max_length: int) -> str:
    text = "".join(c if c in CHARSET else "?" for c in outcome.stdout + outcome.stderr)
    return text[-max_length:] if max_length else ""


class SandboxEnv(gymnasium.Env[str, str]):
    """One episode = one fork of `snapshot`.

    `reward` scores the sandbox after every step (0.0 without one); the episode terminates
    once the reward reaches `success_reward` and is truncated after `max_steps` steps.
    `observe`, if given, is a command whose output is the first observation (e.g. the task)."""

    metadata: dict[str, Any] = {"render_modes": ["ansi"], "render_fps": 1}  # noqa: RUF012 (gymnasium API)

    def __init__(self, snapshot: Snapshot | str | Setup, *, reward: Reward | None = None,
                 success_reward: float = 1.0, max_steps: int = 32, observe: str | None = None,
                 cwd: str | None = None, command_timeout_s: float = 60,
                 max_observation: int = 4096, max_action: int = 1024,
                 render_mode: str | None = None, sandbox_timeout_s: int = 600) -> None:
        if max_steps < 2:
            raise ValueError("max_steps must be at least 2")
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode {render_mode!r} is not one of {self.metadata['render_modes']}")
        self._max_observation = max_observation
        self.observation_space = spaces.Text(max_length=max_observation, min_length=0, charset=CHARSET)
        self.action_space = spaces.Text(max_length=max_action, min_length=1, charset=CHARSET)
        self.render_mode = render_mode
        self._snapshot = snapshot
        self._reward = reward
        self._success = success_reward
        self._max_steps = max_steps
        self._observe = observe
        self._cwd = cwd
        self._command_timeout_s = command_timeout_s
        self._sandbox_timeout_s = sandbox_timeout_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="aenv-sandbox-env",
                                        daemon=True)
        self._thread.start()
        self._pool: RolloutPool | None = None
        self._episode: AbstractAsyncContextManager[Group] | None = None
        self._rollout: Rollout | None = None
        self._steps = 0
        self._last = ""
        self._closed = False

    @property
    def sandbox_id(self) -> str | None:
        """The current episode's sandbox (None before the first reset)."""
        return self._rollout.sandbox_id if self._rollout is not None else None

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
              ) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        if self._closed:
            raise gymnasium.error.ClosedEnvironmentError("reset() on a closed SandboxEnv")
        self._rollout = self._run(self._next_episode())
        self._steps = 0
        self._last = ""
        if self._observe is not None:
            outcome = self._run(self._rollout.run(self._observe, cwd=self._cwd,
                                                  timeout_s=self._command_timeout_s))
            self._last = to_observation(outcome, self._max_observation)
        return self._last, {}

    def step(self, action: str) -> tuple[str, SupportsFloat, bool, bool, dict[str, Any]]:
        if self._rollout is None:
            raise gymnasium.error.ResetNeeded("step() before reset()")
        rollout = self._rollout

        async def act() -> tuple[Outcome, float]:
            outcome = await rollout.run(action, cwd=self._cwd, timeout_s=self._command_timeout_s)
            return outcome, (await self._reward(rollout) if self._reward is not None else 0.0)

        outcome, reward = self._run(act())
        self._steps += 1
        self._last = to_observation(outcome, self._max_observation)
        terminated = self._reward is not None and reward >= self._success
        truncated = not terminated and self._steps >= self._max_steps
        return self._last, reward, terminated, truncated, {"exit_code": outcome.exit_code}

    def render(self) -> str | None:
        return self._last if self.render_mode == "ansi" else None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._run(self._shutdown())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
            self._loop.close()

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _next_episode(self) -> Rollout:
        await self._end_episode()
        if self._pool is None:
            self._pool = RolloutPool(self._snapshot, group_size=1, ready_groups=1, max_sandboxes=3,
                                     timeout_s=self._sandbox_timeout_s)
            await self._pool.start()
        self._episode = self._pool.group()
        group = await self._episode.__aenter__()
        return group.rollouts[0]

    async def _end_episode(self) -> None:
        episode, self._episode, self._rollout = self._episode, None, None
        if episode is not None:
            await episode.__aexit__(None, None, None)

    async def _shutdown(self) -> None:
        await self._end_episode()
        if self._pool is not None:
            await self._pool.close()
