"""The node agent's roster reconciliation (aenv.cluster.agent) against a real etcd, with a
stand-in for the node's manager: bindings follow the node's sandboxes, a binding another node
took over is never deleted, a paused copy that moved is dropped (not killed: the repository
copy is the new owner's), deleted-while-dead sandboxes are removed, and the lease comes back
after it expired."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from conftest import EtcdServer

from aenv.cluster import keys
from aenv.cluster.agent import NodeAgent, advertise_url
from aenv.cluster.etcd import Etcd, encode
from aenv.errors import AenvError, ErrorCode, not_found
from aenv.orchestrator.manager import SandboxManager
from aenv.orchestrator.models import ListQuery, SandboxRecord, SandboxState, TemplateRecord


def record(sid: str, state: SandboxState = SandboxState.RUNNING) -> SandboxRecord:
    now = datetime.now(UTC)
    return SandboxRecord(sandbox_id=sid, template_id="base", client_id="c", state=state,
                         started_at=now, end_at=now + timedelta(minutes=5), cpu_count=2,
                         memory_mb=512, disk_size_mb=4096, envd_access_token=f"tok-{sid}")


@dataclass
class FakeManager:
    """What the agent uses of a SandboxManager."""

    home: Path
    records: dict[str, SandboxRecord] = field(default_factory=dict)
    killed: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    templates: list[TemplateRecord] = field(default_factory=list)
    template_provider: Any = None
    snapshots: Any = None

    def __post_init__(self) -> None:
        self.layout = SimpleNamespace(home=self.home, workspace=lambda sid: self.home / sid)
        self.config = SimpleNamespace(sandbox=SimpleNamespace(max_sandboxes=100))
        self.store = SimpleNamespace(iter_templates=lambda: iter(self.templates),
                                     find_template=lambda _: None)

    def list_sandboxes(self, query: ListQuery) -> tuple[list[SandboxRecord], str | None]:
        return list(self.records.values()), None

    def get(self, sid: str) -> SandboxRecord:
        if sid not in self.records:
            raise not_found(sid)
        return self.records[sid]

    async def kill(self, sid: str) -> None:
        self.get(sid)
        self.killed.append(sid)
        del self.records[sid]

    async def drop_moved(self, sid: str) -> None:
        self.get(sid)
        self.dropped.append(sid)
        del self.records[sid]

    async def runtime(self, name: str) -> Any:
        raise AenvError(ErrorCode.UNAVAILABLE, "no runtime here")


@pytest.fixture
def ns() -> str:
    return uuid.uuid4().hex[:6]


async def binding(etcd: Etcd, sid: str) -> dict[str, Any] | None:
    kv = await etcd.get(keys.sandbox_key(sid))
    return kv.json() if kv is not None else None


async def test_roster_reconciliation(etcd: EtcdServer, tmp_path: Path, ns: str) -> None:
    client = Etcd(etcd.url)
    manager = FakeManager(tmp_path)
    agent = NodeAgent(cast(SandboxManager, manager), Etcd(etcd.url), f"a{ns}",
                      "http://10.0.0.1:8000")
    run, paused, gone, moved = (f"{ns}run", f"{ns}paused", f"{ns}gone", f"{ns}moved")
    manager.records = {run: record(run), paused: record(paused, SandboxState.PAUSED),
                       moved: record(moved, SandboxState.PAUSED)}
    # a binding of ours for a sandbox this node no longer has, and one another node took over
    await client.put(keys.sandbox_key(gone), encode(keys.Binding(f"a{ns}", "running").to_json()))
    await client.put(keys.sandbox_key(moved),
                     encode(keys.Binding(f"b{ns}", "running").to_json()))
    await agent.heartbeat()

    info = (await client.get(keys.node_key(f"a{ns}")))
    assert info is not None and info.lease == agent.lease
    node = keys.NodeInfo.from_json(info.json())
    # counted before the moved copy was dropped (the next heartbeat says 1 paused)
    assert (node.running, node.paused, node.url) == (1, 2, "http://10.0.0.1:8000")
    b = await binding(client, run)
    assert b is not None and b["node"] == f"a{ns}" and b["state"] == "running"
    assert b["token"] == f"tok-{run}" and b["sandbox"]["sandboxID"] == run
    assert (await binding(client, paused) or {}).get("state") == "paused"
    paused_rec = await client.get(keys.paused_key(paused))
    assert paused_rec is not None
    assert keys.record_from_json(paused_rec.json()["record"]) == manager.records[paused]
    assert paused_rec.json()["inRepository"] is False  # no repository here
    assert await binding(client, gone) is None
    # the copy of the sandbox that moved is dropped, not killed, and its binding kept
    assert manager.dropped == [moved] and manager.killed == []
    assert (await binding(client, moved) or {}).get("node") == f"b{ns}"

    # the paused one resumes (here) and another is deleted while this node was dead
    manager.records[paused] = record(paused)
    await client.put(keys.evict_key(f"a{ns}", run), b"{}")
    await agent.heartbeat()
    assert manager.killed == [run]
    assert await binding(client, run) is None
    assert await client.get(keys.evict_key(f"a{ns}", run)) is None
    assert (await binding(client, paused) or {}).get("state") == "running"
    assert await client.get(keys.paused_key(paused)) is None

    # drained: the heartbeat says so
    await client.put(keys.DRAIN + f"a{ns}", b"{}")
    await agent.heartbeat()
    kv = await client.get(keys.node_key(f"a{ns}"))
    assert kv is not None and kv.json()["status"] == "draining"

    # the lease ran out (etcd away, a long pause): the next heartbeat registers again
    await client.revoke(agent.lease)
    assert await client.get(keys.node_key(f"a{ns}")) is None
    old = agent.lease
    await agent.heartbeat()
    kv = await client.get(keys.node_key(f"a{ns}"))
    assert kv is not None and agent.lease != old and kv.lease == agent.lease
    await agent.stop()  # revokes: the node key goes at once
    assert await client.get(keys.node_key(f"a{ns}")) is None
    await client.close()


async def test_adopt_refuses_a_live_owner_and_an_unstored_state(etcd: EtcdServer,
                                                                 tmp_path: Path,
                                                                 ns: str) -> None:
    client = Etcd(etcd.url)
    manager = FakeManager(tmp_path)
    agent = NodeAgent(cast(SandboxManager, manager), Etcd(etcd.url), f"c{ns}", "http://x:1")
    sid = f"{ns}p"
    rec = record(sid, SandboxState.PAUSED)
    with pytest.raises(AenvError) as err:
        await agent.adopt(sid)
    assert err.value.code is ErrorCode.NOT_FOUND
    await client.put(keys.sandbox_key(sid), encode(keys.Binding(f"d{ns}", "paused").to_json()))
    await client.put(keys.paused_key(sid), encode({"node": f"d{ns}", "inRepository": False,
                                                   "record": keys.record_to_json(rec)}))
    lease = await client.grant(10)
    alive = keys.NodeInfo(node_id=f"d{ns}", url="http://d:1")
    await client.put(keys.node_key(f"d{ns}"), encode(alive.to_json()), lease=lease)
    with pytest.raises(AenvError) as err:
        await agent.adopt(sid)
    assert err.value.code is ErrorCode.CONFLICT  # its node is alive: it resumes there
    await client.revoke(lease)
    with pytest.raises(AenvError) as err:
        await agent.adopt(sid)
    assert err.value.code is ErrorCode.UNAVAILABLE  # never reached the repository
    assert (await binding(client, sid) or {}).get("node") == f"d{ns}"  # unchanged
    await agent.etcd.close()
    await client.close()


def test_advertise_url() -> None:
    assert advertise_url("http://10.0.0.2:8000/", "0.0.0.0:8000") == "http://10.0.0.2:8000"
    assert advertise_url(None, "10.0.0.2:8000") == "http://10.0.0.2:8000"
    with pytest.raises(AenvError):
        advertise_url(None, "0.0.0.0:8000")
