"""Request bodies (validated with pydantic) and response bodies (E2B's exact field names).

Response shapes follow the e2b 2.63 SDK's generated models (`e2b/api/client/models`):
`Sandbox`, `SandboxDetail`, `ListedSandbox`, `SandboxMetric`.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from aenv.envd.settings import ENVD_VERSION
from aenv.orchestrator.events import LogEntry
from aenv.orchestrator.manager import pause_mode
from aenv.orchestrator.models import SandboxRecord, TemplateRecord
from aenv.runtime.base import ResourceUsage

# Bounds on what a sandbox record stores and every list answer repeats: metadata is labels, env
# vars may hold keys or certificates. Integers are int32, as in E2B's OpenAPI (`format: int32`).
MAX_METADATA_KEYS = 64
MAX_METADATA_KEY_CHARS = 256
MAX_METADATA_VALUE_CHARS = 1024
MAX_ENV_VARS = 256
MAX_ENV_KEY_CHARS = 256
MAX_ENV_VALUE_CHARS = 32 * 1024
INT32_MAX = 2**31 - 1

Int32 = Annotated[int, Field(ge=-INT32_MAX - 1, le=INT32_MAX)]
Metadata = dict[Annotated[str, StringConstraints(max_length=MAX_METADATA_KEY_CHARS)],
                Annotated[str, StringConstraints(max_length=MAX_METADATA_VALUE_CHARS)]]
EnvVars = dict[Annotated[str, StringConstraints(min_length=1, max_length=MAX_ENV_KEY_CHARS)],
               Annotated[str, StringConstraints(max_length=MAX_ENV_VALUE_CHARS)]]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class AutoResume(_Body):
    enabled: bool = False


RuleList = list[Annotated[str, StringConstraints(min_length=1, max_length=256)]]


class NetworkConfig(_Body):
    """E2B's `SandboxNetworkConfig` (create). The egress rules' meaning: runtime/egress.py;
    egressProxy, rules and httpsPorts are refused (not implemented)."""

    allow_public_traffic: bool | None = Field(default=None, alias="allowPublicTraffic")
    allow_out: RuleList | None = Field(default=None, alias="allowOut", max_length=256)
    deny_out: RuleList | None = Field(default=None, alias="denyOut", max_length=256)
    dns_servers: RuleList | None = Field(default=None, alias="dnsServers", max_length=10)
    mask_request_host: str | None = Field(default=None, alias="maskRequestHost",
                                          min_length=1, max_length=253)
    egress_proxy: dict[str, Any] | None = Field(default=None, alias="egressProxy")
    https_ports: list[Int32] | None = Field(default=None, alias="httpsPorts", max_length=64)
    rules: dict[str, Any] | None = None

    def as_record(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


class NetworkUpdate(_Body):
    """E2B's `SandboxNetworkUpdateConfig` (`PUT /sandboxes/{id}/network`): replaces the
    egress rules as a whole."""

    allow_out: RuleList | None = Field(default=None, alias="allowOut", max_length=256)
    deny_out: RuleList | None = Field(default=None, alias="denyOut", max_length=256)
    dns_servers: RuleList | None = Field(default=None, alias="dnsServers", max_length=10)
    egress_proxy: dict[str, Any] | None = Field(default=None, alias="egressProxy")
    rules: dict[str, Any] | None = None
    allow_internet_access: bool | None = None

    def as_update(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


class VolumeMountBody(_Body):
    name: str = Field(min_length=1, max_length=128)
    path: str = Field(min_length=1, max_length=255)


class NewVolume(_Body):
    name: str = Field(min_length=1, max_length=128)
    # aenv's own: the volume's size (its quota), MiB; the server's default otherwise.
    size_mb: Int32 | None = Field(default=None, alias="sizeMB")


class NewSandbox(_Body):
    template_id: str = Field(alias="templateID", min_length=1, max_length=256)
    timeout: Int32 | None = None
    metadata: Metadata | None = Field(default=None, max_length=MAX_METADATA_KEYS)
    env_vars: EnvVars | None = Field(default=None, alias="envVars", max_length=MAX_ENV_VARS)
    auto_pause: bool | None = Field(default=None, alias="autoPause")
    # False: the pause at expiry keeps only the files (boots afresh on resume)
    auto_pause_memory: bool | None = Field(default=None, alias="autoPauseMemory")
    auto_resume: AutoResume | None = Field(default=None, alias="autoResume")
    allow_internet_access: bool | None = None
    network: NetworkConfig | None = None
    volume_mounts: list[VolumeMountBody] | None = Field(default=None, alias="volumeMounts",
                                                        max_length=16)
    secure: bool | None = None
    # aenv's own: the runtime driver for this sandbox ("container", "qemu", ...); the
    # metadata key `aenv.runtime` says the same for clients that cannot add fields (the SDK).
    runtime: str | None = Field(default=None, min_length=1, max_length=64)
    # aenv's own (`aenv start --cpu --memory`): this sandbox's limits instead of the template's.
    cpu_count: Int32 | None = Field(default=None, alias="cpuCount")
    memory_mb: Int32 | None = Field(default=None, alias="memoryMB")


class ConnectSandbox(_Body):
    timeout: Int32 | None = None
    # False: a paused sandbox boots afresh on its files (SDK: `on_resume="reboot"`)
    memory: bool | None = None


class TimeoutBody(_Body):
    timeout: Int32


class PauseBody(_Body):
    # False: keep only the writable layer (SDK: `pause(mode="filesystem")`)
    memory: bool | None = None
    # The pause checks envd answers first either way (a dead sandbox is removed, 404).
    require_healthy_guest: bool | None = Field(default=None, alias="requireHealthyGuest")


class SnapshotBody(_Body):
    name: str | None = Field(default=None, min_length=1, max_length=128,
                             pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    # False (SDK: `mode="filesystem"`): not supported, answered 501
    memory: bool | None = None


class ForkBody(_Body):
    count: Int32 = 1
    timeout: Int32 | None = None


def snapshot_body(tpl: TemplateRecord) -> dict[str, Any]:
    return {"snapshotID": tpl.template_id, "names": tpl.names, "layers": list(tpl.layers),
            "cpuCount": tpl.cpu_count, "memoryMB": tpl.memory_mb, "diskSizeMB": tpl.disk_size_mb,
            **({"sandboxID": tpl.source_sandbox} if tpl.source_sandbox else {}),
            **({"createdAt": _ts(tpl.created_at)} if tpl.created_at else {}),
            **({"sizeBytes": tpl.size_bytes} if tpl.size_bytes is not None else {}),
            **({"storedBytes": tpl.stored_bytes} if tpl.stored_bytes is not None else {}),
            # ours: false while the snapshot is still being pushed to the repository
            "inRepository": tpl.in_repository}


def _ts(value: datetime) -> str:
    return value.isoformat().replace("+00:00", "Z")


def sandbox_body(rec: SandboxRecord, domain: str | None) -> dict[str, Any]:
    return {
        "templateID": rec.template_id,
        "sandboxID": rec.sandbox_id,
        "clientID": rec.client_id,
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": rec.envd_access_token,
        "trafficAccessToken": rec.traffic_access_token,
        "domain": domain,
        **({"alias": rec.alias} if rec.alias else {}),
    }


def listed_body(rec: SandboxRecord) -> dict[str, Any]:
    return {
        "templateID": rec.template_id,
        "sandboxID": rec.sandbox_id,
        "clientID": rec.client_id,
        "envdVersion": ENVD_VERSION,
        "startedAt": _ts(rec.started_at),
        "endAt": _ts(rec.end_at),
        "cpuCount": rec.cpu_count,
        "memoryMB": rec.memory_mb,
        "diskSizeMB": rec.disk_size_mb,
        "state": rec.state.api_state,
        "metadata": rec.metadata,
        **({"alias": rec.alias} if rec.alias else {}),
        "volumeMounts": [{"name": m["name"], "path": m["path"]} for m in rec.volume_mounts],
    }


def detail_body(rec: SandboxRecord, domain: str | None) -> dict[str, Any]:
    return {
        **listed_body(rec),
        "envdAccessToken": rec.envd_access_token,
        "domain": domain,
        "allowInternetAccess": rec.allow_internet_access,
        "lifecycle": {"autoResume": rec.auto_resume,
                      "onTimeout": "pause" if rec.auto_pause else "kill"},
        **({"pauseMode": mode} if (mode := pause_mode(rec)) else {}),
        **({"network": rec.network} if rec.network else {}),
        "runtime": rec.runtime,
        # VM runtimes record their accelerator (kvm or tcg) in the handle.
        **({"runtimeAccelerator": rec.handle["accel"]} if rec.handle.get("accel") else {}),
    }


def metric_body(at: datetime, cpu_count: int, usage: ResourceUsage) -> dict[str, Any]:
    return {
        "timestamp": _ts(at),
        "timestampUnix": int(at.timestamp()),
        "cpuCount": cpu_count,
        "cpuUsedPct": round(usage.cpu_used_pct, 2),
        "memUsed": usage.mem_used_bytes,
        "memTotal": usage.mem_total_bytes,
        "memCache": usage.mem_cache_bytes,
        "diskUsed": usage.disk_used_bytes,
        "diskTotal": usage.disk_total_bytes,
    }


def log_entry_body(entry: LogEntry) -> dict[str, Any]:
    """E2B's `SandboxLogEntry`."""
    return {"timestamp": _ts(entry.timestamp), "message": entry.message, "level": entry.level,
            "fields": dict(entry.fields)}


def log_line_body(entry: LogEntry) -> dict[str, Any]:
    """E2B's v1 `SandboxLog`: the entry as one JSON line."""
    return {"timestamp": _ts(entry.timestamp),
            "line": json.dumps({"level": entry.level, "message": entry.message,
                                **entry.fields})}
