"""Records the orchestrator keeps, and the validated requests it accepts."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any


class SandboxState(enum.StrEnum):
    """The lifecycle state machine. Transitions (anything else is a conflict):

    creating -> running | (deleted on failure)
    running  -> pausing -> paused -> resuming -> running
    running | paused -> killing -> (deleted)
    """

    CREATING = "creating"
    RUNNING = "running"
    PAUSING = "pausing"
    PAUSED = "paused"
    RESUMING = "resuming"
    KILLING = "killing"

    @property
    def api_state(self) -> str:
        """E2B shows only running and paused; transitional states show as paused."""
        return "running" if self is SandboxState.RUNNING else "paused"


@dataclass
class TemplateRecord:
    template_id: str
    names: list[str]
    layers: list[str]  # layer ids, top first
    cpu_count: int
    memory_mb: int
    disk_size_mb: int
    default_user: str = "user"
    default_workdir: str | None = None
    env_vars: dict[str, str] = field(default_factory=dict)
    created_at: datetime | None = None
    # Snapshots are templates whose sandboxes start from a captured image, not a boot:
    image: str | None = None  # the image directory
    image_token: str | None = None  # envd's access token inside the image
    source_sandbox: str | None = None
    allow_internet_access: bool | None = None  # the source's network mode, kept by copies
    runtime: str | None = None  # the runtime that took the image (only it can restore it)
    size_bytes: int | None = None  # the image's size
    stored_bytes: int | None = None  # what it added to the repository (the rest was deduplicated)
    # False while a snapshot's image and sealed layers are still being pushed to the
    # repository in the background (orchestrator/pushes.py); usable on its node meanwhile.
    in_repository: bool = True
    # Templates pulled from an OCI image: registry/repository@sha256:<manifest digest>.
    source_image: str | None = None
    # A fork's own capture, deleted when the fork returns: never listed, and deleted by
    # the recovery at start if a crash cut the fork short (orchestrator/recovery.py).
    transient: bool = False
    public: bool = False  # E2B's flag (PATCH /templates/{id}); every key sees every template
    # Tags of the template's (one) build -> when each was assigned (ISO 8601): `name:tag`
    # finds the template while it has the tag; `default` always does.
    tags: dict[str, str] = field(default_factory=dict)
    # A built template's start and ready commands: run again when a sandbox of it boots
    # afresh (a resume without memory); a restore finds the start command running already.
    start_cmd: str | None = None
    ready_cmd: str | None = None
    # A snapshot's source's network config and volume mounts (SandboxRecord's), which its
    # copies keep unless their create says otherwise (volumes: must, the image needs them).
    network: dict[str, Any] | None = None
    volume_mounts: list[dict[str, str]] = field(default_factory=list)


@dataclass
class SandboxRecord:
    sandbox_id: str
    template_id: str
    client_id: str
    state: SandboxState
    started_at: datetime
    end_at: datetime
    cpu_count: int
    memory_mb: int
    disk_size_mb: int
    envd_access_token: str
    metadata: dict[str, str] = field(default_factory=dict)
    env_vars: dict[str, str] = field(default_factory=dict)
    alias: str | None = None
    auto_pause: bool = True
    auto_resume: bool = False
    # False: a pause at expiry keeps only the files (E2B's `autoPauseMemory`)
    auto_pause_memory: bool = True
    allow_internet_access: bool = True
    runtime: str = "container"
    handle: dict[str, Any] = field(default_factory=dict)
    # The root filesystem layers the sandbox runs on, top first: its template's, under the
    # sealed layers of the snapshots it descends from. Empty in records of older servers.
    layers: list[str] = field(default_factory=list)
    # E2B's network config as accepted (allowOut, denyOut, dnsServers, allowPublicTraffic,
    # maskRequestHost; `runtime/egress.py` gives the rules their meaning).
    network: dict[str, Any] = field(default_factory=dict)
    # With allowPublicTraffic false: what ports other than envd's require in the
    # `e2b-traffic-access-token` header.
    traffic_access_token: str | None = None
    # Volumes mounted in the sandbox: {"name", "volumeID", "path"}.
    volume_mounts: list[dict[str, str]] = field(default_factory=list)


@dataclass
class CreateRequest:
    template: str
    timeout_s: int
    metadata: dict[str, str] = field(default_factory=dict)
    env_vars: dict[str, str] = field(default_factory=dict)
    auto_pause: bool = True
    auto_resume: bool = False
    auto_pause_memory: bool = True  # False: a pause at expiry keeps only the files
    allow_internet_access: bool = True
    runtime: str | None = None  # a runtime driver by name; None: the server's default
    cpu_count: int | None = None  # None: the template's
    memory_mb: int | None = None  # None: the template's
    network: dict[str, Any] | None = None  # None: the template's (a snapshot's), or none
    volume_mounts: list[tuple[str, str]] = field(default_factory=list)  # (volume name, path)


@dataclass
class ListQuery:
    states: set[str] | None = None  # api states: running, paused
    metadata: dict[str, str] = field(default_factory=dict)
    template: str | None = None
    started_after: datetime | None = None
    order_desc: bool = True
    limit: int = 100
    next_token: str | None = None
