"""Fork at its limits against a real server: one fork of 100 children (the API limit), and a
fork of a fork of a fork ... ten levels deep, which must stay correct (each level sees its
ancestors' files; its writes leak neither up nor sideways) and keep its layer stack bounded
(compaction past `snapshot.max_sealed_layers`)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from e2b import AsyncSandbox

from aenv.rollouts import Rollout, RolloutPool, Snapshot
from aenv.storage.repository.config import SnapshotConfig

MAX_SEALED = SnapshotConfig().max_sealed_layers


@pytest.mark.slow
async def test_fork_of_one_hundred_children_all_ready(api: httpx.Client, run_id: str) -> None:
    parent = await AsyncSandbox.create(metadata={"h6-fork100": run_id}, timeout=600)
    ids: list[str] = []
    try:
        await parent.files.write("/home/user/marker", run_id)
        started = time.monotonic()
        # The SDK sends at most 20 per call; the API takes 100, so this one goes over HTTP.
        resp = await asyncio.to_thread(api.post, f"/sandboxes/{parent.sandbox_id}/fork",
                                       json={"count": 100}, timeout=600)
        forked = time.monotonic() - started
        assert resp.status_code == 201, resp.text
        results = resp.json()
        ids = [r["sandbox"]["sandboxID"] for r in results if "sandbox" in r]
        assert len(ids) == 100, [r for r in results if "error" in r][:3]
        assert len(set(ids)) == 100 and parent.sandbox_id not in ids
        gate = asyncio.Semaphore(16)

        async def answer(sandbox_id: str) -> tuple[str, str]:
            async with gate:
                child = await AsyncSandbox.connect(sandbox_id)
                out = await child.commands.run("cat /home/user/marker; echo; hostname")
                marker, hostname = out.stdout.split()
                return marker, hostname

        answers = await asyncio.gather(*[answer(i) for i in ids])
        assert answers == [(run_id, i) for i in ids]
        print(f"fork x100: {forked:.2f} s to all ready, {time.monotonic() - started:.2f} s "
              "with every child answering")
    finally:
        await asyncio.gather(parent.kill(), *[AsyncSandbox.kill(i) for i in ids],
                             return_exceptions=True)


async def test_fork_tree_ten_levels_deep_stays_correct_and_bounded(
        project: Snapshot, api: httpx.Client) -> None:
    depth = 10
    pool = RolloutPool(project, group_size=1, ready_groups=0, max_sandboxes=32)
    async with pool, pool.group() as group:
        node: Rollout = group.rollouts[0]
        await node.write({"/home/user/tree/level-0": "0"})
        ancestors = ["level-0"]
        fork_s: list[float] = []
        for level in range(1, depth + 1):
            started = time.monotonic()
            child, sibling = await node.branch(2)
            fork_s.append(time.monotonic() - started)
            await child.write({f"/home/user/tree/level-{level}": str(level),
                               "/home/user/tree/level-0": f"overwritten at {level}"})
            await sibling.write({f"/home/user/tree/sibling-{level}": "x"})
            listed = (await child.run("ls /home/user/tree")).stdout.split()
            assert sorted(listed) == sorted([*ancestors, f"level-{level}"]), (level, listed)
            assert (await child.read("/home/user/tree/level-0")) == f"overwritten at {level}"
            # nothing leaks up (the parent) or sideways (the sibling)
            assert sorted((await node.run("ls /home/user/tree")).stdout.split()) == sorted(ancestors)
            assert (await node.read("/home/user/tree/level-0")) == (
                "0" if level == 1 else f"overwritten at {level - 1}")
            assert sorted((await sibling.run("ls /home/user/tree")).stdout.split()) == sorted(
                [*ancestors, f"sibling-{level}"])
            await sibling.kill()
            await node.kill()  # the tree keeps only its newest level alive
            node, ancestors = child, [*ancestors, f"level-{level}"]
        # the setup is still there at the bottom, and the counter still counts
        assert "return a - b" in await node.read("/home/user/proj/calc.py")
        first = int((await node.read("/tmp/count")).strip())
        await asyncio.sleep(0.3)
        assert int((await node.read("/tmp/count")).strip()) > first
        # the layer stack of the deepest level stays bounded by compaction
        snap = await node.sandbox.create_snapshot()
        try:
            info = (await asyncio.to_thread(api.get, f"/snapshots/{snap.snapshot_id}")).json()
            sealed = [layer for layer in info["layers"] if layer.startswith("seal-")]
            assert 1 <= len(sealed) <= MAX_SEALED, info["layers"]
        finally:
            await AsyncSandbox.delete_snapshot(snap.snapshot_id)
        print("fork per level (s): " + " ".join(f"{s:.2f}" for s in fork_s))
        # fast at every depth: the deepest forks cost about what the first ones did
        assert max(fork_s[-3:]) < max(3 * max(fork_s[:3]), 5.0), fork_s
