"""Best-of-N with aenv.rollouts: set up a small repository with a failing test once, fork it
N times, apply one candidate patch in each fork, score every fork by its test suite, keep the
best. Run: `.venv/bin/python examples/best_of_n.py` (uses E2B_API_URL or starts a server)."""

from __future__ import annotations

import asyncio
import re
import time

from _server import aenv_server

from aenv.rollouts import Outcome, Reward, Rollout, RolloutPool, setup

REPO = {
    "/home/user/repo/stats.py": (
        "def mean(xs):\n    return sum(xs) / len(xs) + 1\n\n"
        "def median(xs):\n    s = sorted(xs)\n    return s[len(s) // 2]\n"),
    "/home/user/repo/test_stats.py": (
        "import unittest\nfrom stats import mean, median\n\n"
        "class TestStats(unittest.TestCase):\n"
        "    def test_mean(self):\n        self.assertEqual(mean([1, 2, 3]), 2)\n\n"
        "    def test_median_odd(self):\n        self.assertEqual(median([3, 1, 2]), 2)\n\n"
        "    def test_median_even(self):\n        self.assertEqual(median([4, 1, 3, 2]), 2.5)\n"),
}
MEDIAN_EVEN = ("def median(xs):\n    s = sorted(xs)\n    n = len(s)\n"
               "    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2\n")
# What N samples of a model might propose for stats.py: some wrong, one right.
CANDIDATES = [
    "def mean(xs):\n    return sum(xs) / len(xs)\n\n" + MEDIAN_EVEN,
    "def mean(xs):\n    return sum(xs) // len(xs) + 1\n\n" + MEDIAN_EVEN,
    "def mean(xs):\n    return sum(xs) / len(xs)\n\ndef median(xs):\n    return sorted(xs)[len(xs) // 2]\n",
    "def mean(xs):\n    return max(xs)\n\n" + MEDIAN_EVEN,
    "def mean(xs):\n    return 2\n\ndef median(xs):\n    return 2\n",
    "def mean(xs):\n    return len(xs)\n\ndef median(xs):\n    return 2.5\n",
    "def mean(xs):\n    return sum(xs) / len(xs)\n\ndef median(xs):\n    return 0\n",
    "def mean(xs):\n    return sum(xs)\n\n" + MEDIAN_EVEN,
]
TESTS = "cd /home/user/repo && python3 -m unittest -q test_stats"


def fraction_passed(outcome: Outcome) -> float:
    text = outcome.stderr + outcome.stdout
    ran = int(m.group(1)) if (m := re.search(r"Ran (\d+) test", text)) else 0
    failed = sum(int(n) for n in re.findall(r"(?:failures|errors)=(\d+)", text))
    return (ran - failed) / ran if ran else 0.0


async def main() -> None:
    t = time.perf_counter()
    # checked-hash: a candidate patch of the same size as the file, written within the same
    # second as the .pyc, would otherwise run the stale bytecode (Python checks mtime + size).
    compile_all = "cd /home/user/repo && python3 -m compileall -q --invalidation-mode checked-hash ."
    snapshot = await setup("base", [compile_all], files=REPO)
    print(f"setup + snapshot {snapshot.snapshot_id}: {time.perf_counter() - t:.2f} s")
    reward = Reward(TESTS, score=fraction_passed)
    try:
        async with RolloutPool(snapshot, group_size=len(CANDIDATES), ready_groups=0) as pool:
            t = time.perf_counter()
            async with pool.group() as group:
                print(f"{len(group)} forks ready: {time.perf_counter() - t:.2f} s")

                async def attempt(rollout: Rollout) -> float:
                    patch = CANDIDATES[group.rollouts.index(rollout)]
                    await rollout.write({"/home/user/repo/stats.py": patch})
                    return await rollout.score(reward)

                t = time.perf_counter()
                scores = await group.map(attempt)
                print(f"patched and tested in every fork: {time.perf_counter() - t:.2f} s")
                for i, (rollout, score) in enumerate(zip(group.rollouts, scores, strict=True)):
                    print(f"  candidate {i} in {rollout.sandbox_id}: {score:.2f} of the tests pass")
                best = max(range(len(scores)), key=scores.__getitem__)
                print(f"best: candidate {best} ({scores[best]:.2f})")
    finally:
        await snapshot.delete()


if __name__ == "__main__":
    with aenv_server():
        asyncio.run(main())
