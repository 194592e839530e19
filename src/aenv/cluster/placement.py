"""Placement: which node a new sandbox (create, fork child, create-from-snapshot, resume) goes to.

Pure functions over the nodes' heartbeats (`NodeInfo`), so that any scheduler replica
computes the same answer from etcd. E2B's best-of-K: filter the nodes that can take the
request, sample K of them at random (not a scan of every node: placements in flight spread
instead of all landing on the one best node), and take the lowest score

    score = (requested CPU + allocated CPU + 0.5 * load) / (OVERCOMMIT * CPUs) - locality

where `locality` is LOCALITY_BONUS when the node already holds the template (its layers, or
the snapshot's image), so creates go where nothing has to be fetched when that costs little.
The filter: status `ready`, not excluded, below its sandbox limit, and memory limits within
MEMORY_OVERCOMMIT times its memory. A request whose template only some nodes hold *and*
is not in the shared catalog can only go there (`required_template`).

Owns: the filter and the score. Must not touch: etcd, HTTP.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from aenv.cluster.keys import NodeInfo

K = 3
OVERCOMMIT = 4  # the score's vCPUs per host CPU, as E2B's
# The filter's memory overcommit: a sandbox's memory is a limit, mostly unused by idle ones
# (agents, RL environments). CPU is not filtered, only scored: a node's own hard limit is
# its sandbox count (429, and the gateway tries another node).
MEMORY_OVERCOMMIT = 4
LOCALITY_BONUS = 0.25
KINDS = ("create", "fork", "snapshot", "resume")


@dataclass
class Request:
    kind: str = "create"
    template: str | None = None
    cpu: int = 2
    memory_mb: int = 512
    exclude: set[str] = field(default_factory=set)
    prefer: str | None = None  # fork: the parent's node, taken when it has room
    required_template: bool = False  # only nodes holding `template` can serve it


def fits(node: NodeInfo, req: Request, reserved_cpu: int = 0, reserved_mem: int = 0) -> bool:
    if node.status != "ready" or node.node_id in req.exclude:
        return False
    if node.max_sandboxes and node.running + node.paused >= node.max_sandboxes:
        return False
    if node.memory_mb and node.allocated_memory_mb + reserved_mem + req.memory_mb > \
            MEMORY_OVERCOMMIT * node.memory_mb:
        return False
    return not (req.required_template and req.template and req.template not in node.templates)


def score(node: NodeInfo, req: Request, reserved_cpu: int = 0) -> float:
    value = (req.cpu + node.allocated_cpu + reserved_cpu + 0.5 * node.load) / \
        (OVERCOMMIT * max(node.cpus, 1))
    if req.template and req.template in node.templates:
        value -= LOCALITY_BONUS
    return value


def place(nodes: Iterable[NodeInfo], req: Request, reserved: Mapping[str, tuple[int, int]] | None
          = None, rng: random.Random | None = None, k: int = K) -> NodeInfo | None:
    """The node for `req`, or None when no node can take it. `reserved`: node id ->
    (CPU, MiB) placed there since its last heartbeat."""
    reserved = reserved or {}
    candidates = [n for n in nodes if fits(n, req, *reserved.get(n.node_id, (0, 0)))]
    if not candidates:
        return None
    if req.prefer is not None:
        for node in candidates:
            if node.node_id == req.prefer:
                return node
    sample = (rng or random).sample(candidates, min(k, len(candidates)))
    return min(sample, key=lambda n: (score(n, req, reserved.get(n.node_id, (0, 0))[0]),
                                      n.node_id))
