"""RL rollouts at the scale of issue 16, through the official E2B SDK and `aenv.rollouts`:

- best-of-16 on a realistic setup (1 500 files, a virtualenv, `compileall`, a CPU-bound build
  step, a background process), side by side in one run:
  fork path   = the setup once, then fork x16 and a command in each (as the SDK does it:
                `fork(count=16)` of the set-up sandbox; and as `aenv.rollouts` does it:
                `setup()` -> snapshot -> a pool's group of 16 forks, or a pool of a `Setup`,
                whose seed is the set-up sandbox: no snapshot);
  fresh path  = 16 fresh sandboxes at once, each running the whole setup and the command;
  and the ratio fresh / fork;
- fork x100 (the API limit; the SDK sends at most 20 per call, so this is one HTTP call)
  -> all 100 ready, then every child answering;
- a fork tree 10 levels deep (each level a fork of the previous one's child): time per level
  and the sealed layers under the deepest level (bounded by `snapshot.max_sealed_layers`).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from collections.abc import Iterator

from aenv.bench.stats import summarize
from aenv.devserver import ServerProcess, run_with_server

FILES = 1_500
SETUP = [
    "python3 -m venv --without-pip /home/user/venv",
    # the repository: 1 500 modules of ~4 KB in 15 packages
    ("python3 -c 'import os\n"
     f"for i in range({FILES}):\n"
     "    d = f\"/home/user/repo/pkg{i // 100}\"\n"
     "    i % 100 or os.makedirs(d)\n"
     "    i % 100 or open(f\"{d}/__init__.py\", \"w\").close()\n"
     "    body = \"\".join(f\"def f{j}(x):\\n    return x + {j}\\n\" for j in range(100))\n"
     "    open(f\"{d}/mod{i}.py\", \"w\").write(body)\n'"),
    "/home/user/venv/bin/python -m compileall -q /home/user/repo",
    # a CPU-bound build step (~1 s of one core)
    ("/home/user/venv/bin/python -c 'import hashlib\nh = b\"\"\n"
     "for _ in range(1_500_000): h = hashlib.sha256(h).digest()\n"
     "open(\"/home/user/repo/BUILD\", \"w\").write(h.hex())'"),
]
BACKGROUND = "sh -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/count; sleep 0.1; done'"
# What each candidate of best-of-N runs: import from the repository and check the build.
CANDIDATE = ("cd /home/user/repo && /home/user/venv/bin/python -c "
             "'import pkg3.mod321 as m; print(m.f7(35), len(open(\"BUILD\").read()))'")
EXPECTED = "42 64"


async def _setup_in(sandbox: object) -> None:
    from e2b import AsyncSandbox

    assert isinstance(sandbox, AsyncSandbox)
    for command in SETUP:
        await sandbox.commands.run(command, timeout=600)
    handle = await sandbox.commands.run(BACKGROUND, background=True, timeout=0)
    await handle.disconnect()


async def _answer(sandbox: object) -> str:
    from e2b import AsyncSandbox

    assert isinstance(sandbox, AsyncSandbox)
    out = await sandbox.commands.run(CANDIDATE)
    if out.stdout.strip() != EXPECTED:
        raise RuntimeError(f"candidate in {sandbox.sandbox_id} answered {out.stdout!r}")
    return out.stdout


async def fork_path_sdk(n: int) -> float:
    """The setup once in one sandbox, `fork(count=n)` of it, the command in every child."""
    from e2b import AsyncSandbox

    started = time.perf_counter()
    parent = await AsyncSandbox.create(timeout=900)
    children: list[AsyncSandbox] = []
    try:
        await _setup_in(parent)
        results = await parent.fork(count=n)
        children = [c for c in results if isinstance(c, AsyncSandbox)]
        if len(children) != n:
            raise RuntimeError(f"fork: {[r for r in results if not isinstance(r, AsyncSandbox)][:2]}")
        await asyncio.gather(*[_answer(c) for c in children])
        return time.perf_counter() - started
    finally:
        await asyncio.gather(parent.kill(), *[c.kill() for c in children], return_exceptions=True)


async def fork_path_library(n: int) -> tuple[float, float, float, float]:
    """`aenv.rollouts`: setup() -> snapshot, a pool's group of n forks, the command in each.
    Returns (total, setup + snapshot, of which the snapshot, group ready + commands)."""
    from aenv.rollouts import RolloutPool, setup

    started = time.perf_counter()
    snapshot = await setup("base", SETUP, background=[BACKGROUND])
    set_up = time.perf_counter()
    try:
        async with RolloutPool(snapshot, group_size=n, ready_groups=0) as pool, \
                pool.group() as group:
            await group.map(lambda r: _answer(r.sandbox))
        done = time.perf_counter()
    finally:
        await snapshot.delete()
    return done - started, set_up - started, snapshot.capture_seconds, done - set_up


async def fork_path_library_setup(n: int) -> float:
    """`aenv.rollouts` without a snapshot: a pool whose seed runs the `Setup`, one group of n
    forks of it, the command in each."""
    from aenv.rollouts import RolloutPool, Setup

    started = time.perf_counter()
    plan = Setup("base", SETUP, background=[BACKGROUND], command_timeout_s=600)
    async with RolloutPool(plan, group_size=n, ready_groups=0) as pool, pool.group() as group:
        await group.map(lambda r: _answer(r.sandbox))
        return time.perf_counter() - started


async def fresh_path(n: int) -> float:
    """n fresh sandboxes at once, each running the whole setup and then the command."""
    from e2b import AsyncSandbox

    started = time.perf_counter()
    made: list[AsyncSandbox] = []

    async def one() -> None:
        sandbox = await AsyncSandbox.create(timeout=900)
        made.append(sandbox)
        await _setup_in(sandbox)
        await _answer(sandbox)

    try:
        await asyncio.gather(*[one() for _ in range(n)])
        return time.perf_counter() - started
    finally:
        await asyncio.gather(*[s.kill() for s in made], return_exceptions=True)


def best_of(n: int = 16, rounds: int = 3) -> list[str]:
    sdk: list[float] = []
    lib: list[tuple[float, float, float, float]] = []
    lib_setup: list[float] = []
    fresh: list[float] = []
    for _ in range(rounds):  # interleaved, so that both paths see the same machine
        sdk.append(asyncio.run(fork_path_sdk(n)))
        lib.append(asyncio.run(fork_path_library(n)))
        lib_setup.append(asyncio.run(fork_path_library_setup(n)))
        fresh.append(asyncio.run(fresh_path(n)))
    f, s = statistics.median(fresh), statistics.median(sdk)
    lib_total = statistics.median(t for t, *_ in lib)
    return [(f"[best-of-{n}: setup of {FILES} files + venv + compileall + CPU build step + "
            "a background process]"),
            summarize(f"  fork path, SDK (setup once, fork x{n}, command each)", sdk).line(),
            summarize("  fork path, aenv.rollouts (setup+snapshot, group, map)",
                      [t for t, *_ in lib]).line(),
            summarize("    of which setup() incl. create_snapshot()", [x[1] for x in lib]).line(),
            summarize("      of which create_snapshot()", [x[2] for x in lib]).line(),
            summarize(f"    of which group of {n} ready + command each", [x[3] for x in lib]).line(),
            summarize("  fork path, aenv.rollouts (pool of a Setup: no snapshot)", lib_setup).line(),
            summarize(f"  fresh path ({n} sandboxes at once, each the setup)", fresh).line(),
            (f"  {'ratio fresh / fork (medians)':<50} SDK fork {f / s:.1f}x, aenv.rollouts "
             f"{f / lib_total:.1f}x (snapshot), {f / statistics.median(lib_setup):.1f}x (Setup)")]


async def _fork_hundred() -> tuple[float, float]:
    import httpx
    from e2b import AsyncSandbox

    parent = await AsyncSandbox.create(timeout=600)
    ids: list[str] = []
    try:
        await parent.files.write("/home/user/marker", "m")
        async with httpx.AsyncClient(base_url=os.environ["E2B_API_URL"], timeout=600,
                                     headers={"X-API-Key": os.environ["E2B_API_KEY"]}) as http:
            started = time.perf_counter()
            resp = await http.post(f"/sandboxes/{parent.sandbox_id}/fork", json={"count": 100})
            ready = time.perf_counter() - started
        resp.raise_for_status()
        ids = [r["sandbox"]["sandboxID"] for r in resp.json() if "sandbox" in r]
        if len(ids) != 100:
            raise RuntimeError(f"fork x100: {[r for r in resp.json() if 'error' in r][:2]}")
        gate = asyncio.Semaphore(16)

        async def answer(sandbox_id: str) -> None:
            async with gate:
                child = await AsyncSandbox.connect(sandbox_id)
                await child.commands.run("cat /home/user/marker")

        await asyncio.gather(*[answer(i) for i in ids])
        return ready, time.perf_counter() - started
    finally:
        await asyncio.gather(parent.kill(), *[AsyncSandbox.kill(i) for i in ids],
                             return_exceptions=True)


def fork_hundred(rounds: int = 3) -> list[str]:
    runs = [asyncio.run(_fork_hundred()) for _ in range(rounds)]
    return [summarize("fork x100 -> all 100 ready (one HTTP call)", [r for r, _ in runs]).line(),
            summarize("fork x100 -> every child answered a command", [a for _, a in runs]).line()]


async def _tree(depth: int) -> tuple[list[float], int]:
    import httpx

    from aenv.rollouts import RolloutPool, setup

    snapshot = await setup("base", ["mkdir -p /home/user/tree"], background=[BACKGROUND])
    try:
        async with RolloutPool(snapshot, group_size=1, ready_groups=0) as pool, \
                pool.group() as group:
            node = group.rollouts[0]
            per_level: list[float] = []
            for level in range(1, depth + 1):
                await node.write({f"/home/user/tree/level-{level}": str(level)})
                started = time.perf_counter()
                (child,) = await node.branch(1)
                per_level.append(time.perf_counter() - started)
                await node.kill()
                node = child
            listed = (await node.run("ls /home/user/tree")).stdout.split()
            if len(listed) != depth:
                raise RuntimeError(f"the deepest level sees {listed}")
            snap = await node.sandbox.create_snapshot()
            async with httpx.AsyncClient(base_url=os.environ["E2B_API_URL"],
                                         headers={"X-API-Key": os.environ["E2B_API_KEY"]}) as http:
                info = (await http.get(f"/snapshots/{snap.snapshot_id}")).json()
            await node.sandbox.delete_snapshot(snap.snapshot_id)
            return per_level, sum(1 for layer in info["layers"] if layer.startswith("seal-"))
    finally:
        await snapshot.delete()


def tree(depth: int = 10, rounds: int = 3) -> list[str]:
    runs = [asyncio.run(_tree(depth)) for _ in range(rounds)]
    levels = [t for per_level, _ in runs for t in per_level]
    deepest = [per_level[-1] for per_level, _ in runs]
    return [summarize(f"fork tree depth {depth}: fork of a child, every level", levels).line(),
            summarize(f"fork tree depth {depth}: fork at the deepest level", deepest).line(),
            (f"{f'fork tree depth {depth}: sealed layers under the deepest':<52} "
            f"{max(layers for _, layers in runs)} (compacted past snapshot.max_sealed_layers)")]


def run(server: ServerProcess) -> Iterator[str]:
    del server  # the SDK's environment points at it
    yield from best_of()
    yield from fork_hundred()
    yield from tree()


def main(argv: list[str] | None = None) -> int:
    del argv
    return run_with_server("aenv-rollout-bench-",
                           "RL rollouts (issue 16), through the e2b SDK 2.63 and aenv.rollouts:", run)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
