"""What the cluster keeps in etcd, under `/aenv/`, and the records stored there.

| key | lease | value | written by |
|---|---|---|---|
| `nodes/<id>` | node's | `NodeInfo`: url, status, capacity, usage, templates held | the node's agent, every heartbeat |
| `members/<id>` | none | `{id, url}`: a node that ever registered (a dead one stays listed as unhealthy) | the agent, at registration |
| `drain/<id>` | none | `{}`: the node takes no new placements | `POST /nodes/{id}/drain` |
| `sandboxes/<id>` | none | `Binding`: owning node, state, the listed sandbox, envd's token (signed `/files` URLs are routed by it) | the owning agent (roster), the gateway (right after a create) |
| `evict/<node>/<id>` | none | `{}`: a lost sandbox deleted while its node was dead; the node removes it when it is back | the gateway |
| `paused/<id>` | none | the paused sandbox's whole record, and whether its state is in the repository | the owning agent |
| `templates/<id>` | none | a snapshot template's record, once it is in the repository | the agent of the node that took it |
| `scheduler/leader` | leader's | `{id, url}` | the scheduler that won the election |
| `schedulers/<id>` | its own | `{id, url}` | every scheduler replica |

A node whose lease expired is dead: its `nodes/<id>` key is gone. Everything else is durable,
so any gateway or scheduler replica can route and place, and a restart of any component loses
nothing. Owns: key names and (de)serialising the records. Must not touch: etcd's wire format.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from aenv.orchestrator.models import SandboxRecord, SandboxState, TemplateRecord

ROOT = "/aenv/"
NODES = ROOT + "nodes/"
MEMBERS = ROOT + "members/"
DRAIN = ROOT + "drain/"
SANDBOXES = ROOT + "sandboxes/"
PAUSED = ROOT + "paused/"
TEMPLATES = ROOT + "templates/"
EVICT = ROOT + "evict/"
LEADER = ROOT + "scheduler/leader"
SCHEDULERS = ROOT + "schedulers/"

NODE_LEASE_S = 6  # a node that missed ~3 heartbeats (every 2 s) is dead
HEARTBEAT_S = 2.0


def node_key(node_id: str) -> str:
    return NODES + node_id


def sandbox_key(sandbox_id: str) -> str:
    return SANDBOXES + sandbox_id


def paused_key(sandbox_id: str) -> str:
    return PAUSED + sandbox_id


def template_key(template_id: str) -> str:
    return TEMPLATES + template_id


def evict_key(node_id: str, sandbox_id: str) -> str:
    return f"{EVICT}{node_id}/{sandbox_id}"


def tail(key: str, prefix: str) -> str:
    return key[len(prefix):]


@dataclass
class NodeInfo:
    """A node as its heartbeat describes it (and as `GET /nodes` shows it)."""

    node_id: str
    url: str
    status: str = "ready"  # ready | draining (unhealthy: no live key, shown by the gateway)
    cpus: int = 1
    memory_mb: int = 0
    disk_free_mb: int = 0
    max_sandboxes: int = 0
    allocated_cpu: int = 0  # vCPUs of running sandboxes
    allocated_memory_mb: int = 0
    load: float = 0.0  # 1-minute load average
    running: int = 0
    paused: int = 0
    templates: list[str] = field(default_factory=list)  # ids and names held locally
    started_at: str = ""
    heartbeat_at: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"nodeID": self.node_id, "url": self.url, "status": self.status,
                "capacity": {"cpus": self.cpus, "memoryMB": self.memory_mb,
                             "diskFreeMB": self.disk_free_mb,
                             "maxSandboxes": self.max_sandboxes},
                "usage": {"allocatedCPU": self.allocated_cpu,
                          "allocatedMemoryMB": self.allocated_memory_mb, "load": self.load},
                "sandboxes": {"running": self.running, "paused": self.paused},
                "templates": self.templates, "startedAt": self.started_at,
                "heartbeatAt": self.heartbeat_at}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> NodeInfo:
        cap, use, sbx = raw.get("capacity", {}), raw.get("usage", {}), raw.get("sandboxes", {})
        return cls(node_id=str(raw["nodeID"]), url=str(raw["url"]),
                   status=str(raw.get("status", "ready")), cpus=int(cap.get("cpus", 1)),
                   memory_mb=int(cap.get("memoryMB", 0)),
                   disk_free_mb=int(cap.get("diskFreeMB", 0)),
                   max_sandboxes=int(cap.get("maxSandboxes", 0)),
                   allocated_cpu=int(use.get("allocatedCPU", 0)),
                   allocated_memory_mb=int(use.get("allocatedMemoryMB", 0)),
                   load=float(use.get("load", 0.0)), running=int(sbx.get("running", 0)),
                   paused=int(sbx.get("paused", 0)),
                   templates=[str(t) for t in raw.get("templates", [])],
                   started_at=str(raw.get("startedAt", "")),
                   heartbeat_at=str(raw.get("heartbeatAt", "")))


@dataclass
class Binding:
    """Which node owns a sandbox, and what it last said about it."""

    node_id: str
    state: str  # running | paused (api states)
    listed: dict[str, Any] = field(default_factory=dict)  # E2B's ListedSandbox, when known
    token: str = ""  # envd's access token: signed /files URLs carry only its signature

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node_id, "state": self.state, "sandbox": self.listed,
                "token": self.token}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Binding:
        return cls(node_id=str(raw["node"]), state=str(raw.get("state", "running")),
                   listed=dict(raw.get("sandbox") or {}), token=str(raw.get("token", "")))


def _plain(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def record_to_json(rec: SandboxRecord) -> dict[str, Any]:
    return {k: _plain(v) for k, v in dataclasses.asdict(rec).items()}


def record_from_json(raw: dict[str, Any]) -> SandboxRecord:
    names = {f.name for f in dataclasses.fields(SandboxRecord)}
    values = {k: v for k, v in raw.items() if k in names}
    values["state"] = SandboxState(values["state"])
    values["started_at"] = datetime.fromisoformat(values["started_at"])
    values["end_at"] = datetime.fromisoformat(values["end_at"])
    return SandboxRecord(**values)


def template_to_json(tpl: TemplateRecord) -> dict[str, Any]:
    return {k: _plain(v) for k, v in dataclasses.asdict(tpl).items()}


def template_from_json(raw: dict[str, Any]) -> TemplateRecord:
    names = {f.name for f in dataclasses.fields(TemplateRecord)}
    values = {k: v for k, v in raw.items() if k in names}
    if values.get("created_at"):
        values["created_at"] = datetime.fromisoformat(values["created_at"])
    return TemplateRecord(**values)
