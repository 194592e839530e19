"""Tree search with aenv.rollouts: at every step, branch the current rollout (fork it, running
processes and all) into one child per candidate edit, score each child by the test suite, keep
the best child, drop the others, and go on from there until every test passes.
Run: `.venv/bin/python examples/tree_search.py` (uses E2B_API_URL or starts a server)."""

from __future__ import annotations

import asyncio
import time

from _server import aenv_server
from best_of_n import fraction_passed

from aenv.rollouts import Reward, RolloutPool, setup

# Three bugs, one per function; each edit fixes one, breaks one, or does nothing.
REPO = {
    "/home/user/repo/ops.py": (
        "def add(a, b):\n    return a - b\n\n"
        "def mul(a, b):\n    return a + b\n\n"
        "def neg(a):\n    return a\n"),
    "/home/user/repo/test_ops.py": (
        "import unittest\nfrom ops import add, mul, neg\n\n"
        "class TestOps(unittest.TestCase):\n"
        "    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n\n"
        "    def test_mul(self):\n        self.assertEqual(mul(2, 3), 6)\n\n"
        "    def test_neg(self):\n        self.assertEqual(neg(2), -2)\n"),
}
EDITS = [  # each edit touches one function only (a sed range from its `def` to its return)
    "sed -i '/def add/,/return/ s/a - b/a + b/' ops.py",
    "sed -i '/def mul/,/return/ s/a + b/a * b/' ops.py",
    "sed -i '/def neg/,/return/ s/return a/return -a/' ops.py",
    "sed -i '/def add/,/return/ s/a - b/b - a/' ops.py",
    "sed -i '/def neg/,/return/ s/return a/return a * 2/' ops.py",
]
# -B: no bytecode cache. An edit that keeps the file's size (a - b -> a + b) made within the
# same second as a cached .pyc would otherwise be ignored: Python checks mtime and size only.
TESTS = "cd /home/user/repo && python3 -B -m unittest -q test_ops"


async def main() -> None:
    snapshot = await setup("base", [], files=REPO)
    reward = Reward(TESTS, score=fraction_passed)
    try:
        async with RolloutPool(snapshot, group_size=1, ready_groups=0) as pool, \
                pool.group() as group:
            node = group.rollouts[0]
            score, path = await node.score(reward), []
            print(f"root {node.sandbox_id}: {score:.2f}")
            while score < 1.0 and len(path) < 5:
                t = time.perf_counter()
                children = await node.branch(len(EDITS))
                forked = time.perf_counter() - t
                outcomes = await asyncio.gather(*[c.run(e, cwd="/home/user/repo")
                                                  for c, e in zip(children, EDITS, strict=True)])
                assert all(o.ok for o in outcomes)
                scores = await asyncio.gather(*[c.score(reward) for c in children])
                best = max(range(len(scores)), key=scores.__getitem__)
                print(f"depth {len(path) + 1}: {len(children)} branches in {forked:.2f} s, scores "
                      f"{[round(s, 2) for s in scores]} -> edit {best}")
                if scores[best] <= score:
                    print("no edit improves: stop")
                    break
                await asyncio.gather(*[c.kill() for i, c in enumerate(children) if i != best],
                                     node.kill())
                node, score, path = children[best], scores[best], [*path, EDITS[best]]
            print(f"solved: {score == 1.0}, path: {path}")
            print((await node.read("/home/user/repo/ops.py")).strip())
    finally:
        await snapshot.delete()


if __name__ == "__main__":
    with aenv_server():
        asyncio.run(main())
