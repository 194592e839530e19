"""The gymnasium adapter against a real server: gymnasium's own checker, an episode that
solves the task, resets that start from the setup again, and nothing left after close()."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import gymnasium
import pytest
from conftest import PROJECT, TESTS
from e2b import Sandbox
from gymnasium.utils.env_checker import check_env

from aenv.rollouts import Reward, Snapshot
from aenv.rollouts.gym import SandboxEnv

ENV_ID = "aenv-tests/Sandbox-v0"
FIX = "sed -i 's/a - b/a + b/' /home/user/proj/calc.py"


@pytest.fixture(scope="module")
def registered() -> Iterator[str]:
    gymnasium.register(id=ENV_ID, entry_point="aenv.rollouts.gym:SandboxEnv")
    yield ENV_ID
    gymnasium.registry.pop(ENV_ID, None)


def alive(sandbox_id: str | None) -> bool:
    return sandbox_id is not None and sandbox_id in {s.sandbox_id for s in Sandbox.list().next_items()}


async def test_check_env_passes(project: Snapshot, registered: str) -> None:
    # through gymnasium.make, so the checker also exercises the render modes and a double close
    env = gymnasium.make(registered, snapshot=project, reward=Reward(TESTS), max_steps=4,
                         observe="cat /home/user/proj/calc.py", render_mode="ansi")
    try:
        await asyncio.to_thread(check_env, env.unwrapped)
    finally:
        await asyncio.to_thread(env.close)


async def test_an_episode_solves_the_task_and_reset_starts_over(project: Snapshot) -> None:
    env = SandboxEnv(project, reward=Reward(TESTS), max_steps=3,
                     observe="cat /home/user/proj/calc.py")
    try:
        obs, info = await asyncio.to_thread(env.reset, seed=1)
        assert obs == PROJECT["/home/user/proj/calc.py"] and info == {}
        first = env.sandbox_id
        obs, reward, terminated, truncated, info = await asyncio.to_thread(env.step, "echo nope; exit 1")
        assert (obs, reward, terminated, truncated, info) == ("nope\n", 0.0, False, False, {"exit_code": 1})
        obs, reward, terminated, truncated, info = await asyncio.to_thread(
            env.step, f"{FIX} && cat /home/user/proj/calc.py")
        assert "a + b" in obs and reward == 1.0 and terminated and not truncated
        # a new episode is a fresh fork of the setup: the fix is gone, the old sandbox too
        obs, _ = await asyncio.to_thread(env.reset)
        assert obs == PROJECT["/home/user/proj/calc.py"]
        assert env.sandbox_id != first and not alive(first)
        # output outside the text space is replaced, long output cut to its end
        obs, *_ = await asyncio.to_thread(env.step, "printf 'caf\\xc3\\xa9 '; seq 1 5000")
        assert obs.endswith("4999\n5000\n") and len(obs) == env.observation_space.max_length
        obs, *_ = await asyncio.to_thread(env.step, "printf 'caf\\xc3\\xa9\\n'")
        assert obs == "caf?\n" and obs in env.observation_space
        _, _, terminated, truncated, _ = await asyncio.to_thread(env.step, "true")
        assert truncated and not terminated  # max_steps
        last = env.sandbox_id
    finally:
        await asyncio.to_thread(env.close)
    assert not alive(last)
    with pytest.raises(gymnasium.error.ClosedEnvironmentError):
        env.reset()
