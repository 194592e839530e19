"""Types shared by every runtime driver, and the `RuntimeDriver` protocol.

Lifecycle a driver implements (issue order): create, connect (reach a port inside), stats,
destroy; later pause, resume, snapshot, restore and fork. Operations a driver cannot do raise
`AenvError(ErrorCode.NOT_SUPPORTED, ...)`.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from aenv.runtime.egress import EgressPolicy


@dataclass(frozen=True)
class VolumeMount:
    """A volume bind-mounted read-write into a sandbox: `source` (a host directory, outside
    every sandbox's writable layer) at `path` (absolute, inside the sandbox)."""

    path: str
    source: Path


@dataclass(frozen=True)
class SandboxSpec:
    """Everything a driver needs to start one sandbox. Built by the orchestrator."""

    sandbox_id: str  # [a-z0-9]{20}; also the hostname
    lower_layers: tuple[Path, ...]  # read-only root filesystem layers, TOP FIRST (overlayfs order)
    workspace: Path  # private, driver-owned directory for this sandbox (upper, work, ...)
    cpu_count: int
    memory_mb: int
    pids_max: int
    env_vars: dict[str, str] = field(default_factory=dict)
    envd_access_token: str | None = None
    default_user: str = "user"
    default_workdir: str | None = None
    allow_internet_access: bool = True
    envd_port: int = 49983
    # The sandbox's writable disk, MiB: writes past it fail inside the sandbox (ENOSPC or
    # EDQUOT) where the driver can bound it. None: unbounded (the host filesystem's size).
    disk_size_mb: int | None = None
    # Outbound rules (a slot's nftables sets; `EgressDriver`). None: everything allowed.
    egress: EgressPolicy | None = None
    volumes: tuple[VolumeMount, ...] = ()


@dataclass(frozen=True)
class ReadyShape:
    """A sandbox shape a driver may keep fully started ahead of time (a "ready pool"): a
    create whose spec has the same layers, memory, network mode and envd port only claims
    one. The cpu and pids limits of the claim are applied if they differ."""

    lower_layers: tuple[Path, ...]
    cpu_count: int
    memory_mb: int
    pids_max: int
    allow_internet_access: bool = True
    envd_port: int = 49983
    default_user: str = "user"

    @property
    def key(self) -> tuple[Any, ...]:
        return (self.lower_layers, self.memory_mb, self.allow_internet_access, self.envd_port)

    @staticmethod
    def key_of(spec: SandboxSpec) -> tuple[Any, ...]:
        return (spec.lower_layers, spec.memory_mb, spec.allow_internet_access, spec.envd_port)


@dataclass
class RuntimeHandle:
    """A driver's reference to a live sandbox. JSON-serialisable (`data`), stored by the
    orchestrator so that a restarted server can re-attach to sandboxes that kept running."""

    driver: str
    sandbox_id: str
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ResourceUsage:
    cpu_used_pct: float  # since the previous sample, 0..100*cpu_count
    mem_used_bytes: int
    mem_total_bytes: int
    mem_cache_bytes: int
    disk_used_bytes: int
    disk_total_bytes: int


@runtime_checkable
class RuntimeDriver(Protocol):
    name: str

    async def start(self) -> None:
        """Prepare host resources (helper processes, pools). Called once at server start."""

    async def close(self) -> None:
        """Release host resources. Live sandboxes keep running (they survive a restart)."""

    async def create(self, spec: SandboxSpec) -> RuntimeHandle:
        """Start a sandbox and return once envd inside accepts connections on spec.envd_port."""

    async def attach(self, handle: RuntimeHandle) -> bool:
        """After a server restart: True if the sandbox behind `handle` is still alive."""

    async def connect(self, handle: RuntimeHandle, port: int) -> socket.socket:
        """A connected, non-blocking TCP socket to 127.0.0.1:`port` inside the sandbox.
        Raises AenvError(PORT_CLOSED) when nothing listens there, AenvError(UNAVAILABLE)
        when the sandbox is not running."""

    async def stats(self, handle: RuntimeHandle) -> ResourceUsage:
        """Current resource usage of the sandbox."""

    async def destroy(self, handle: RuntimeHandle) -> None:
        """Stop every process of the sandbox and free its resources. Idempotent."""


@runtime_checkable
class LivenessDriver(Protocol):
    """A driver that can tell cheaply whether a running sandbox's own process (a container's
    init, which is envd; a VM's hypervisor process) still exists. The orchestrator asks about
    every running sandbox every second and removes one that died, with the reason."""

    def exit_reason(self, handle: RuntimeHandle) -> str | None:
        """None while the sandbox's process runs; else why it is gone, for people
        ("envd, its init, was killed by the out-of-memory killer"). Must not block."""


@runtime_checkable
class PausableDriver(Protocol):
    """A driver that can pause a sandbox (its whole state captured, CPU and memory released)
    and resume it later, also after a server restart."""

    async def pause(self, handle: RuntimeHandle) -> RuntimeHandle:
        """Capture the sandbox and stop it. The returned handle locates the captured state."""

    async def resume(self, handle: RuntimeHandle, spec: SandboxSpec) -> RuntimeHandle:
        """Bring a paused sandbox back with its processes running; return its live handle."""


@runtime_checkable
class PausedStateDriver(Protocol):
    """A pausable driver whose paused state is a few local directories, which the
    orchestrator copies to the snapshot repository: a paused sandbox then survives the loss
    of its local files (a wiped disk, a reinstalled node) and not only a server restart."""

    def paused_state(self, handle: RuntimeHandle) -> dict[str, Path]:
        """The directories holding a paused sandbox's whole state, by a name unique to this
        pause ([A-Za-z0-9._-]); a resume needs all of them at these paths."""

    async def prepare_paused_state(self, handle: RuntimeHandle) -> None:
        """Make what missing directories of `paused_state` are fetched back into (e.g. the
        workspace they live in); called only when some are missing."""


@runtime_checkable
class SnapshotDriver(Protocol):
    """A driver that can capture a running sandbox into an image (briefly pausing it) and
    start independent copies of it from that image (create-from-snapshot, fork)."""

    async def snapshot(self, handle: RuntimeHandle, images: Path) -> dict[str, float]:
        """Capture the sandbox into the directory `images`; it keeps running."""

    async def restore(self, spec: SandboxSpec, images: Path, image_token: str | None
                      ) -> RuntimeHandle:
        """Start the sandbox `spec` from `images`, with `spec`'s identity and token."""


@runtime_checkable
class LayerSealingDriver(Protocol):
    """A snapshot driver whose snapshots seal the sandbox's writable layer into a read-only
    layer (`<images>/...`), which copies then stack under their own empty writable layer
    (shared, never copied). The orchestrator takes the sealed layer out of the image, names
    it, and owns its lifetime; these blocking calls do the filesystem work."""

    def sealed_layer(self, images: Path) -> Path | None:
        """The layer `snapshot()` sealed into `images`, or None."""

    def adopt_sealed(self, sealed: Path, dest: Path) -> Path:
        """Move a sealed layer out of its image to `dest` (a rename where possible); return
        the directory (`dest` or one inside it) to stack as the layer."""

    def merge_layers(self, layers: Sequence[Path], dest: Path) -> None:
        """Compact sealed layers (top first) into the one new layer `dest`."""

    def remove_layer(self, path: Path) -> None:
        """Delete a sealed layer (a `dest` given to adopt_sealed or merge_layers). Idempotent."""


@runtime_checkable
class RecoverableDriver(Protocol):
    """A driver that settles what a server killed in the middle of an operation left behind
    (orchestrator/recovery.py decides which call each sandbox needs, from its record)."""

    async def settle(self, handles: list[RuntimeHandle]) -> list[str]:
        """Stop helpers (criu) a dead server left working on these sandboxes and thaw those
        a checkpoint left frozen; return the ids it did something for."""

    def interrupted_pause(self, handle: RuntimeHandle) -> RuntimeHandle | None:
        """A sandbox whose processes are gone after a pause was cut short: its paused
        handle if the image is complete, else None."""

    async def abort_resume(self, handle: RuntimeHandle) -> None:
        """Undo a resume cut short (`handle` is the paused one); the paused image stays."""

    def release_paused(self, paused: RuntimeHandle) -> None:
        """The resume of `paused` is recorded: its paused image may be deleted."""

    async def sweep(self, known: Callable[[str], bool], idle: dict[str, RuntimeHandle],
                    workspaces: Path) -> list[str]:
        """Destroy sandboxes in `workspaces` that are not `known` (asked at the moment of
        each decision); drop checkpoint images the `idle` sandboxes' handles do not name;
        return the ids destroyed."""


@runtime_checkable
class FilesystemPauseDriver(Protocol):
    """A driver that can pause a sandbox keeping only its writable layer (no memory), and
    boot a paused sandbox afresh on that layer (E2B's `memory: false`)."""

    async def pause_filesystem(self, handle: RuntimeHandle) -> RuntimeHandle:
        """Stop every process of the sandbox and release its CPU, memory and network; keep
        its writable layer. The handle returned has `fs_paused` set."""

    async def boot_paused(self, handle: RuntimeHandle, spec: SandboxSpec) -> RuntimeHandle:
        """Boot a paused sandbox (paused either way) as a new sandbox on its kept writable
        layer: no process survives; a memory image, if any, is not used."""


@runtime_checkable
class EgressDriver(Protocol):
    """A driver that enforces `SandboxSpec.egress` and can change it while a sandbox runs."""

    async def set_egress(self, handle: RuntimeHandle, policy: EgressPolicy) -> RuntimeHandle:
        """Replace the running sandbox's outbound rules (atomically); the returned handle
        records them (a restarted server re-applies what the handle says)."""
