"""Placement (aenv.cluster.placement), the gateway's list cursor and filters, and records as
etcd keeps them: pure functions, no processes."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from pathlib import Path

from aenv.api.schemas import listed_body
from aenv.cluster import keys, placement
from aenv.cluster.agent import relocate
from aenv.cluster.gateway import _matches, cursor
from aenv.cluster.keys import NodeInfo
from aenv.orchestrator.manager import _encode_cursor
from aenv.orchestrator.models import SandboxRecord, SandboxState


def node(node_id: str, cpus: int = 4, allocated: int = 0, **kw: object) -> NodeInfo:
    kw.setdefault("templates", ["base"])
    return NodeInfo(node_id=node_id, url=f"http://{node_id}", cpus=cpus, memory_mb=16384,
                    allocated_cpu=allocated, max_sandboxes=100, **kw)  # type: ignore[arg-type]


def record(sid: str, started: datetime, **kw: object) -> SandboxRecord:
    kw.setdefault("state", SandboxState.RUNNING)
    return SandboxRecord(sandbox_id=sid, template_id="base", client_id="c", started_at=started,
                         end_at=started + timedelta(minutes=5), cpu_count=2, memory_mb=512,
                         disk_size_mb=4096, envd_access_token="t", **kw)  # type: ignore[arg-type]


def test_filters_status_exclusions_and_capacity() -> None:
    nodes = [node("a", status="draining"), node("b"), node("c", allocated_memory_mb=65536),
             node("d", running=60, paused=40)]
    req = placement.Request(cpu=2, exclude={"b"})
    assert placement.place(nodes, req) is None  # draining, excluded, memory full, at max
    assert placement.place(nodes, placement.Request(cpu=2)) == nodes[1]
    assert placement.fits(nodes[2], placement.Request(memory_mb=0))  # 4 x 16 GiB exactly
    assert not placement.fits(nodes[2], placement.Request(memory_mb=1))
    # CPU is scored, not filtered: a node with every CPU placed 10 times over still fits
    assert placement.fits(node("e", cpus=1, allocated=40), placement.Request(cpu=2))


def test_score_prefers_free_cpu_and_locality() -> None:
    busy, idle = node("busy", allocated=8), node("idle")
    assert placement.place([busy, idle], placement.Request(), k=2) == idle
    # Holding the template outweighs a little load, not a lot.
    warm = node("warm", allocated=2, templates=["base", "snap"])
    cold = node("cold")
    assert placement.place([warm, cold], placement.Request(template="snap"), k=2) == warm
    hot = node("hot", allocated=12, templates=["snap"])
    assert placement.place([hot, cold], placement.Request(template="snap"), k=2) == cold


def test_reservations_spread_a_burst() -> None:
    nodes = [node("a"), node("b"), node("c")]
    reserved: dict[str, tuple[int, int]] = {}
    placed = []
    for _ in range(6):
        chosen = placement.place(nodes, placement.Request(cpu=2), reserved)
        assert chosen is not None
        cpu, mem = reserved.get(chosen.node_id, (0, 0))
        reserved[chosen.node_id] = (cpu + 2, mem + 512)
        placed.append(chosen.node_id)
    assert sorted(placed) == ["a", "a", "b", "b", "c", "c"]


def test_best_of_k_samples() -> None:
    nodes = [node(f"n{i}", allocated=i) for i in range(10)]
    rng = random.Random(7)
    seen = {placement.place(nodes, placement.Request(), rng=rng, k=3).node_id  # type: ignore[union-attr]
            for _ in range(50)}
    assert len(seen) > 1  # not always the single best node: a sample of 3
    assert "n9" not in seen and "n8" not in seen  # never the worst of any sample of 3


def test_prefer_and_required_template() -> None:
    nodes = [node("a"), node("b", allocated=10, templates=["snap"])]
    assert placement.place(nodes, placement.Request(prefer="b"), k=2) == nodes[1]
    req = placement.Request(template="snap", required_template=True)
    assert placement.place(nodes, req, k=2) == nodes[1]
    nodes[1].status = "draining"
    assert placement.place(nodes, req, k=2) is None


def test_gateway_cursor_is_the_nodes_cursor() -> None:
    t = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
    for started in (t, t.replace(microsecond=0)):
        rec = record("abc", started)
        assert cursor(listed_body(rec)) == _encode_cursor(rec)


def test_list_filters_on_bindings() -> None:
    t = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    listed = {**listed_body(record("s1", t, metadata={"k": "v"})), "state": "paused"}
    assert _matches(listed, {})
    assert _matches(listed, {"state": "running,paused"})
    assert not _matches(listed, {"state": "running"})
    assert _matches(listed, {"metadata": "k=v"})
    assert not _matches(listed, {"metadata": "k=w"})
    assert _matches(listed, {"template": "base"})
    assert not _matches(listed, {"template": "other"})
    assert not _matches(listed, {"startedAfter": (t + timedelta(seconds=1)).isoformat()})
    later = cursor(listed_body(record("s9", t + timedelta(seconds=1))))
    assert _matches(listed, {"nextToken": later})  # desc: older than the cursor
    assert not _matches(listed, {"nextToken": later, "order": "asc"})


def test_records_round_trip_and_relocate() -> None:
    t = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    rec = record("s1", t, state=SandboxState.PAUSED, handle={
        "workspace": "/a/home/sandboxes/s1", "images": "/a/home/sandboxes/s1/checkpoints/p-1",
        "other": "/a/home/sandboxes/s10", "n": 3})
    back = keys.record_from_json(keys.record_to_json(rec))
    assert back == rec
    moved = relocate(back, Path("/b/sandboxes/s1"))
    assert moved.handle == {"workspace": "/b/sandboxes/s1",
                            "images": "/b/sandboxes/s1/checkpoints/p-1",
                            "other": "/a/home/sandboxes/s10", "n": 3}
    info = node("x", allocated=2, load=0.5, paused=3)
    assert NodeInfo.from_json(info.to_json()) == info
