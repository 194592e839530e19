"""Firecracker's HTTP API: typed request bodies and an asyncio client for its API socket.

Every call the driver and the probe make is built here, as an `ApiCall` (method, path, JSON
body) from a dataclass, so that one unit test can check each body against Firecracker's
published OpenAPI description (tests/data/firecracker/firecracker.yaml, v1.16.1). Fields left
`None` are omitted: Firecracker rejects unknown fields, so a field is only sent when the
running Firecracker version has it (`FirecrackerVersion.has_*`).

Owns: the request shapes and the HTTP-over-unix-socket client (`FirecrackerApi`), which turns
a Firecracker error answer into `AenvError` carrying its `fault_message`.
Must not touch: processes, files or the network; it only speaks on a socket it is given.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Literal, Self

import httpx

from aenv.errors import AenvError, ErrorCode

MIN_VERSION = (1, 14, 0)  # track_dirty_pages on /snapshot/load, free page reporting


@dataclass(frozen=True, order=True)
class FirecrackerVersion:
    major: int
    minor: int
    patch: int = 0

    @staticmethod
    def parse(text: str) -> FirecrackerVersion:
        """From `firecracker --version` ("Firecracker v1.16.1 ...") or GET /version."""
        m = re.search(r"v?(\d+)\.(\d+)(?:\.(\d+))?", text)
        if m is None:
            raise AenvError(ErrorCode.UNAVAILABLE, f"cannot read a Firecracker version in {text!r}")
        return FirecrackerVersion(int(m[1]), int(m[2]), int(m[3] or 0))

    def __str__(self) -> str:
        return f"v{self.major}.{self.minor}.{self.patch}"

    @property
    def supported(self) -> bool:
        return (self.major, self.minor, self.patch) >= MIN_VERSION

    @property
    def has_clock_realtime(self) -> bool:  # /snapshot/load clock_realtime (x86_64)
        return (self.major, self.minor) >= (1, 16)


def _body(obj: Any) -> Any:
    """A dataclass as a JSON object without its `None` fields (recursively)."""
    if is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _body(getattr(obj, f.name)) for f in fields(obj)
                if getattr(obj, f.name) is not None}
    if isinstance(obj, list | tuple):
        return [_body(item) for item in obj]
    return obj


@dataclass(frozen=True)
class ApiCall:
    method: Literal["GET", "PUT", "PATCH"]
    path: str
    body: dict[str, Any] | None = None


# ---------------------------------------------------------------------- request bodies
@dataclass(frozen=True)
class Logger:
    log_path: str
    level: Literal["Error", "Warning", "Info", "Debug", "Trace", "Off"] | None = "Warning"
    show_level: bool | None = True
    show_log_origin: bool | None = None


@dataclass(frozen=True)
class Metrics:
    metrics_path: str


@dataclass(frozen=True)
class MachineConfig:
    vcpu_count: int
    mem_size_mib: int
    smt: bool | None = None
    track_dirty_pages: bool | None = None
    huge_pages: Literal["None", "2M"] | None = None


@dataclass(frozen=True)
class BootSource:
    kernel_image_path: str
    boot_args: str | None = None
    initrd_path: str | None = None


@dataclass(frozen=True)
class Drive:
    drive_id: str
    path_on_host: str
    is_root_device: bool
    is_read_only: bool
    cache_type: Literal["Unsafe", "Writeback"] | None = None
    io_engine: Literal["Sync", "Async"] | None = None


@dataclass(frozen=True)
class NetworkInterface:
    iface_id: str
    host_dev_name: str
    guest_mac: str | None = None


@dataclass(frozen=True)
class Balloon:
    amount_mib: int
    deflate_on_oom: bool
    stats_polling_interval_s: int | None = None
    free_page_reporting: bool | None = None


@dataclass(frozen=True)
class Vsock:
    guest_cid: int
    uds_path: str


@dataclass(frozen=True)
class SnapshotCreate:
    snapshot_path: str
    mem_file_path: str
    snapshot_type: Literal["Full", "Diff"] | None = None


@dataclass(frozen=True)
class MemoryBackend:
    backend_path: str
    backend_type: Literal["File", "Uffd"] = "File"


@dataclass(frozen=True)
class NetworkOverride:
    iface_id: str
    host_dev_name: str


@dataclass(frozen=True)
class SnapshotLoad:
    snapshot_path: str
    mem_backend: MemoryBackend
    track_dirty_pages: bool | None = None
    resume_vm: bool | None = None
    network_overrides: tuple[NetworkOverride, ...] | None = None
    clock_realtime: bool | None = None


# ---------------------------------------------------------------------- calls
def put_logger(body: Logger) -> ApiCall:
    return ApiCall("PUT", "/logger", _body(body))


def put_metrics(body: Metrics) -> ApiCall:
    return ApiCall("PUT", "/metrics", _body(body))


def put_machine_config(body: MachineConfig) -> ApiCall:
    return ApiCall("PUT", "/machine-config", _body(body))


def patch_machine_config(body: MachineConfig) -> ApiCall:
    """Pre-boot partial update; the published schema still requires vcpu_count and
    mem_size_mib, so the body carries them."""
    return ApiCall("PATCH", "/machine-config", _body(body))


def put_boot_source(body: BootSource) -> ApiCall:
    return ApiCall("PUT", "/boot-source", _body(body))


def put_drive(body: Drive) -> ApiCall:
    return ApiCall("PUT", f"/drives/{body.drive_id}", _body(body))


def put_network_interface(body: NetworkInterface) -> ApiCall:
    return ApiCall("PUT", f"/network-interfaces/{body.iface_id}", _body(body))


def put_balloon(body: Balloon) -> ApiCall:
    return ApiCall("PUT", "/balloon", _body(body))


def put_vsock(body: Vsock) -> ApiCall:
    return ApiCall("PUT", "/vsock", _body(body))


def instance_start() -> ApiCall:
    return ApiCall("PUT", "/actions", {"action_type": "InstanceStart"})


def pause_vm() -> ApiCall:
    return ApiCall("PATCH", "/vm", {"state": "Paused"})


def resume_vm() -> ApiCall:
    return ApiCall("PATCH", "/vm", {"state": "Resumed"})


def snapshot_create(body: SnapshotCreate) -> ApiCall:
    return ApiCall("PUT", "/snapshot/create", _body(body))


def snapshot_load(body: SnapshotLoad) -> ApiCall:
    return ApiCall("PUT", "/snapshot/load", _body(body))


def describe_instance() -> ApiCall:
    return ApiCall("GET", "/")


def get_version() -> ApiCall:
    return ApiCall("GET", "/version")


def balloon_statistics() -> ApiCall:
    return ApiCall("GET", "/balloon/statistics")


# ---------------------------------------------------------------------- client
class FirecrackerApi:
    """One Firecracker process's API socket. `async with FirecrackerApi(path) as api:`;
    `await api.call(put_logger(...))`. 2xx answers return the JSON body (or None); any other
    answer raises AenvError(INTERNAL) with Firecracker's fault_message; an unreachable socket
    raises AenvError(UNAVAILABLE)."""

    def __init__(self, socket_path: str, timeout: float = 30.0) -> None:
        self.socket_path = socket_path
        self._client = httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=socket_path, verify=False),
            base_url="http://localhost", timeout=timeout)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._client.aclose()

    async def call(self, call: ApiCall) -> Any:
        try:
            reply = await self._client.request(
                call.method, call.path, json=call.body,
                headers={"Accept": "application/json"})
        except httpx.TransportError as exc:
            raise AenvError(ErrorCode.UNAVAILABLE,
                            f"firecracker API at {self.socket_path}: {exc!r}") from None
        if reply.is_success:
            return reply.json() if reply.content else None
        try:
            fault = reply.json().get("fault_message") or reply.text
        except ValueError:
            fault = reply.text
        raise AenvError(ErrorCode.INTERNAL,
                        f"firecracker {call.method} {call.path} answered "
                        f"{reply.status_code}: {fault}")

    async def wait_ready(self, timeout: float, alive: Callable[[], bool] | None = None
                         ) -> None:
        """Until the API answers GET / (the process creates its socket a few ms after
        exec). `alive()` (optional) returning False stops the wait early."""
        deadline = time.monotonic() + timeout
        delay = 0.002
        while True:
            try:
                await self.call(describe_instance())
                return
            except AenvError as exc:
                if exc.code is not ErrorCode.UNAVAILABLE:
                    raise
                if alive is not None and not alive():
                    raise AenvError(ErrorCode.UNAVAILABLE,
                                    "firecracker exited before its API socket answered") from None
                if time.monotonic() > deadline:
                    raise AenvError(ErrorCode.TIMEOUT,
                                    f"firecracker API at {self.socket_path} did not answer "
                                    f"within {timeout:.0f} s") from None
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)
