"""aenv.rollouts: RL rollouts on aenv sandboxes, on top of the official E2B SDK's `AsyncSandbox`.

    snapshot = await setup("base", ["git clone ... /repo", "pip install -e /repo"])
    async with RolloutPool(snapshot, group_size=16) as pool:
        async with pool.group() as group:                  # 16 forks of the set-up sandbox
            await group.map(lambda r: r.run(f"apply-patch {r.sandbox_id}"))
            best, reward = await group.best(Reward("pytest -q"))
            children = await best.branch(4)               # tree search: fork a running rollout

`setup` prepares an environment once and snapshots it; a `RolloutPool` keeps groups of N forks
ready (of a snapshot, or of a sandbox it prepared itself from a `Setup`: no snapshot taken); a `Rollout` runs commands, writes and reads files, scores itself with a `Reward` hook
and branches; every sandbox is killed when its group (or pool) ends, cancellation included.
`aenv.rollouts.gym.SandboxEnv` is a `gymnasium.Env` over the same pieces (install
`aenv[rollouts]`). Owns nothing on the server: it is a client, through the SDK only.
"""

from aenv.rollouts.pool import POOL_TAG, Group, RolloutPool
from aenv.rollouts.rollout import SANDBOX_FAILURES, ForkFailed, Outcome, Reward, Rollout, passed
from aenv.rollouts.snapshot import Setup, SetupFailed, Snapshot, setup
from aenv.rollouts.tracker import Capacity, SandboxTracker

__all__ = ["POOL_TAG", "SANDBOX_FAILURES", "Capacity", "ForkFailed", "Group", "Outcome", "Reward",
           "Rollout", "RolloutPool", "SandboxTracker", "Setup", "SetupFailed", "Snapshot", "passed", "setup"]
