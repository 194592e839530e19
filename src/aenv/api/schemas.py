"""Request bodies (validated with pydantic) and response bodies (E2B's exact field names).

Response shapes follow the e2b 2.63 SDK's generated models (`e2b/api/client/models`):
`Sandbox`, `SandboxDetail`, `ListedSandbox`, `SandboxMetric`.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from aenv.envd.settings import ENVD_VERSION
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


class NewSandbox(_Body):
    template_id: str = Field(alias="templateID", min_length=1, max_length=256)
    timeout: Int32 | None = None
    metadata: Metadata | None = Field(default=None, max_length=MAX_METADATA_KEYS)
    env_vars: EnvVars | None = Field(default=None, alias="envVars", max_length=MAX_ENV_VARS)
    auto_pause: bool | None = Field(default=None, alias="autoPause")
    auto_resume: AutoResume | None = Field(default=None, alias="autoResume")
    allow_internet_access: bool | None = None
    network: dict[str, Any] | None = None
    secure: bool | None = None
    # aenv's own: the runtime driver for this sandbox ("container", "qemu", ...); the
    # metadata key `aenv.runtime` says the same for clients that cannot add fields (the SDK).
    runtime: str | None = Field(default=None, min_length=1, max_length=64)
    # aenv's own (`aenv start --cpu --memory`): this sandbox's limits instead of the template's.
    cpu_count: Int32 | None = Field(default=None, alias="cpuCount")
    memory_mb: Int32 | None = Field(default=None, alias="memoryMB")


class ConnectSandbox(_Body):
    timeout: Int32 | None = None


class TimeoutBody(_Body):
    timeout: Int32


class PauseBody(_Body):
    memory: bool | None = None


class SnapshotBody(_Body):
    name: str | None = Field(default=None, min_length=1, max_length=128,
                             pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


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
        "trafficAccessToken": None,
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
    }


def detail_body(rec: SandboxRecord, domain: str | None) -> dict[str, Any]:
    return {
        **listed_body(rec),
        "envdAccessToken": rec.envd_access_token,
        "domain": domain,
        "allowInternetAccess": rec.allow_internet_access,
        "lifecycle": {"autoResume": rec.auto_resume,
                      "onTimeout": "pause" if rec.auto_pause else "kill"},
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
