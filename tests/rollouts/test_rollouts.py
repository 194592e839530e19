"""The rollout library against a real server through the official SDK: groups forked from a
set-up snapshot, branches, rewards, concurrency limits, retries of a failed child, and
cleanup when the caller's task is cancelled (checked on the server's own list)."""

from __future__ import annotations

import asyncio
import re

import pytest
from conftest import COMPILE_ALL, COUNTER, PROJECT, TESTS
from e2b import AsyncSandbox, SandboxQuery

from aenv.rollouts import (
    POOL_TAG,
    Outcome,
    Reward,
    Rollout,
    RolloutPool,
    Setup,
    SetupFailed,
    Snapshot,
    setup,
)

FIX = "def add(a, b):\n    return a + b\n"
WRONG = ["def add(a, b):\n    return a * b\n", "def add(a, b):\n    return 5\n", FIX,
         "def add(a, b):\n    return b\n"]


async def tagged(pool: RolloutPool) -> set[str]:
    """The pool's sandboxes as the server lists them (forks inherit the pool's tag)."""
    listing = AsyncSandbox.list(query=SandboxQuery(metadata={POOL_TAG: pool.pool_id}), limit=100)
    ids = {s.sandbox_id for s in await listing.next_items()}
    while listing.has_next:
        ids |= {s.sandbox_id for s in await listing.next_items()}
    return ids


async def count(r: Rollout) -> int:
    return int((await r.read("/tmp/count")).strip())


def fraction_passed(outcome: Outcome) -> float:
    """unittest's summary as a reward: the fraction of tests that passed."""
    text = outcome.stderr + outcome.stdout
    ran = int(m.group(1)) if (m := re.search(r"Ran (\d+) test", text)) else 0
    failed = sum(int(n) for n in re.findall(r"(?:failures|errors)=(\d+)", text))
    return (ran - failed) / ran if ran else 0.0


async def test_group_forks_inherit_the_setup_and_stay_independent(project: Snapshot) -> None:
    async with RolloutPool(project, group_size=4, ready_groups=1) as pool:
        async with pool.group() as group:
            assert len(group) == 4
            ids = {r.sandbox_id for r in group.rollouts}
            assert len(ids) == 4
            # files, the compileall output and the process of the setup are in every fork
            for r in group.rollouts:
                assert await r.read("/home/user/proj/calc.py") == PROJECT["/home/user/proj/calc.py"]
                assert (await r.run("ls /home/user/proj/__pycache__")).stdout.split() == [
                    "calc.cpython-311.pyc", "test_calc.cpython-311.pyc"]
            first = await asyncio.gather(*[count(r) for r in group.rollouts])
            await asyncio.sleep(0.5)
            later = await asyncio.gather(*[count(r) for r in group.rollouts])
            assert all(b > a for a, b in zip(first, later, strict=True)), (first, later)
            hostnames = await group.map(lambda r: r.run("hostname"))
            assert {o.stdout.strip() for o in hostnames} == ids
            # a write in one fork is seen by no other
            await group.rollouts[0].write({"/home/user/proj/calc.py": FIX, "/tmp/mine": "0"})
            outcomes = await group.map(lambda r: r.run(TESTS))
            assert [o.ok for o in outcomes] == [True, False, False, False]
            assert not any([(await r.run("test -e /tmp/mine")).ok for r in group.rollouts[1:]])
            assert ids <= await tagged(pool)
        # the group is gone at the end of its block; the next one was kept ready
        left = await tagged(pool)
        assert not ids & left
        assert len(left) == 1 + 4  # the seed and the ready group
    assert await tagged(pool) == set()


async def test_reward_hook_picks_the_candidate_that_passes(project: Snapshot) -> None:
    reward = Reward(TESTS, score=fraction_passed)
    async with RolloutPool(project, group_size=len(WRONG), ready_groups=0) as pool, pool.group() as group:
        base = await group.scores(reward)
        assert base == [0.5] * len(WRONG)  # add(0, 0) passes, add(2, 3) fails
        await asyncio.gather(*[r.write({"/home/user/proj/calc.py": patch})
                               for r, patch in zip(group.rollouts, WRONG, strict=True)])
        scores = await group.scores(reward)
        assert scores == [0.5, 0.5, 1.0, 0.5], scores
        best, score = await group.best(reward)
        assert best is group.rollouts[2] and score == 1.0
        # the default score: the command's exit code
        assert await best.score(Reward(TESTS)) == 1.0
        assert await group.rollouts[0].score(Reward(TESTS)) == 0.0


async def test_branch_forks_a_running_rollout_for_tree_search(project: Snapshot) -> None:
    async with RolloutPool(project, group_size=1, ready_groups=0) as pool, pool.group() as group:
        root = group.rollouts[0]
        await root.write({"/home/user/path": "root\n"})
        shell = await root.sandbox.commands.run("bash", background=True, stdin=True, timeout=0)
        await root.sandbox.commands.send_stdin(shell.pid, "export DEPTH=0\n")
        await shell.disconnect()
        node, path = root, ["root"]
        for depth in range(1, 4):
            children = await node.branch(2)
            assert len(children) == 2
            for i, child in enumerate(children):
                await child.run(f"echo d{depth}c{i} >> /home/user/path")
                # memory and processes come along: the counter goes on in every branch
                assert await count(child) > 0
                assert (await child.run(f"kill -0 {shell.pid}")).ok
            # each child sees its ancestors' writes and its own, not its sibling's
            seen = [(await c.read("/home/user/path")).split() for c in children]
            assert seen == [[*path, f"d{depth}c0"], [*path, f"d{depth}c1"]]
            assert (await node.read("/home/user/path")).split() == path  # nothing leaks up
            await children[1].kill()  # prune
            node, path = children[0], [*path, f"d{depth}c0"]
        assert len(await tagged(pool)) == 1 + 1 + 3  # seed, root, one kept child per depth
    assert await tagged(pool) == set()


async def test_a_child_whose_sandbox_fails_is_replaced_and_its_work_run_again(
        project: Snapshot) -> None:
    async with RolloutPool(project, group_size=3, ready_groups=0, retries=1) as pool:
        async with pool.group() as group:
            victim = group.rollouts[0].sandbox_id
            runs: list[str] = []

            async def work(r: Rollout) -> str:
                runs.append(r.sandbox_id)
                if r.sandbox_id == victim:
                    await AsyncSandbox.kill(victim)  # the sandbox dies under the rollout's work
                return (await r.run("hostname")).stdout.strip()

            answers = await group.map(work)
            assert len(runs) == 4 and runs.count(victim) == 1  # run again once, elsewhere
            assert victim not in answers and victim not in await tagged(pool)
            assert answers == [r.sandbox_id for r in group.rollouts] and len(set(answers)) == 3
            # the replacement is a fork of the same setup
            assert await group.rollouts[0].read("/home/user/proj/calc.py") == PROJECT[
                "/home/user/proj/calc.py"]

        # out of retries: the failure propagates, the group is still cleaned up
        async def always_dies(r: Rollout) -> str:
            await AsyncSandbox.kill(r.sandbox_id)
            return (await r.run("true")).stdout

        with pytest.raises(Exception, match="not found|killed"):
            async with pool.group() as group:
                await group.map(always_dies)
        assert len(await tagged(pool)) == 1  # only the seed
    assert await tagged(pool) == set()


async def test_cancelling_the_caller_leaves_no_sandbox_behind(project: Snapshot) -> None:
    pool = RolloutPool(project, group_size=4, ready_groups=1)
    forking = asyncio.Event()
    seen: set[str] = set()

    async def rollout_task() -> None:
        async with pool, pool.group() as group:
            seen.update(await tagged(pool))
            forking.set()
            await asyncio.gather(*[r.branch(3) for r in group.rollouts])  # 12 forks in flight
            await asyncio.sleep(3600)

    task = asyncio.create_task(rollout_task())
    await asyncio.wait_for(forking.wait(), 120)
    await asyncio.sleep(0.05)  # the fork requests are on the wire
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(seen) >= 1 + 4  # positive control: the tag lists the pool's sandboxes
    assert await tagged(pool) == set()
    assert pool.live_sandboxes == 0
    # The server finishes fork requests whose client went away: were any of them left running
    # (their ids never seen by the library), they would show up now.
    await asyncio.sleep(5)
    assert await tagged(pool) == set()


async def test_max_sandboxes_bounds_what_is_alive(project: Snapshot) -> None:
    async with RolloutPool(project, group_size=2, ready_groups=1, max_sandboxes=5) as pool:
        async with pool.group() as group:
            await asyncio.sleep(1)  # the refill takes the rest: seed 1 + this group 2 + ready 2
            assert pool.live_sandboxes == 5
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(group.rollouts[0].branch(1), 2)
            assert len(await tagged(pool)) == 5
        async with pool.group() as group:  # freed: the ready group, and a branch now fits
            await asyncio.sleep(1)
            await group.rollouts[1].kill()
            (child,) = await group.rollouts[0].branch(1)
            assert (await child.run("hostname")).stdout.strip() == child.sandbox_id
    assert await tagged(pool) == set()


async def test_a_failing_setup_command_raises_and_leaves_nothing(run_id: str) -> None:
    with pytest.raises(SetupFailed, match="exited 3") as failed:
        await setup("base", ["echo ok", "echo broken >&2; exit 3", "echo never"],
                    metadata={"h6-setup": run_id})
    assert failed.value.outcome.stderr.strip() == "broken"
    listing = AsyncSandbox.list(query=SandboxQuery(metadata={"h6-setup": run_id}))
    assert await listing.next_items() == []


async def test_a_pool_of_a_setup_forks_the_set_up_sandbox_without_a_snapshot(run_id: str) -> None:
    snapshots_before = {x.snapshot_id for x in await AsyncSandbox.list_snapshots().next_items()}
    plan = Setup("base", [COMPILE_ALL], files=PROJECT,
                 background=[COUNTER])
    async with RolloutPool(plan, group_size=3, ready_groups=0) as pool:
        async with pool.group() as group:
            outcomes = await group.map(lambda r: r.run(TESTS))
            assert [o.ok for o in outcomes] == [False] * 3  # the project's failing test, in each
            assert all([await count(r) > 0 for r in group.rollouts])
        assert len(await tagged(pool)) == 1  # the seed: the set-up sandbox itself
    assert await tagged(pool) == set()
    assert {x.snapshot_id for x in await AsyncSandbox.list_snapshots().next_items()} == snapshots_before
    # a failing setup fails the pool's start, and leaves nothing
    broken = RolloutPool(Setup("base", ["exit 7"]), group_size=1)
    with pytest.raises(SetupFailed, match="exited 7"):
        await broken.start()
    assert await tagged(broken) == set()
