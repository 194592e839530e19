"""Server configuration: embedded defaults, a TOML file, then environment overrides.

Precedence (last wins): defaults below < `$AENV_CONFIG` or `$AENV_HOME/config.toml` <
`AENV_<SECTION>_<KEY>` environment variables (plus the short forms `AENV_HOME`,
`AENV_LISTEN`, `AENV_API_KEY`) < command-line flags applied by the CLI.
Every limit the server enforces is named here, with its unit.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aenv.errors import invalid
from aenv.storage.repository.config import SnapshotConfig


def default_home() -> Path:
    if os.geteuid() == 0:
        return Path("/var/lib/aenv")
    return Path.home() / ".local/share/aenv"


@dataclass
class ServerConfig:
    listen: str = "127.0.0.1:8000"
    home: Path = field(default_factory=default_home)
    api_key: str | None = None  # None: read or generate $home/secrets/api_key
    domain: str | None = None  # host-based routing: <port>-<id>.<domain>
    # Control-plane JSON bodies (not the sandbox proxy's `/files` uploads nor template file
    # archives, which stream): larger ones get 413 before being read into memory.
    max_body_bytes: int = 4 * 1024 * 1024
    max_json_depth: int = 32  # nesting of arrays/objects in a JSON body


@dataclass
class SandboxDefaults:
    template: str = "base"
    cpu_count: int = 2  # vCPUs (cgroup cpu quota)
    memory_mb: int = 512  # hard memory limit, MiB
    disk_size_mb: int = 4096  # advertised writable disk, MiB
    timeout_s: int = 300  # TTL when the request gives none
    max_timeout_s: int = 24 * 3600
    pids_max: int = 1024  # process limit per sandbox
    max_sandboxes: int = 1000  # live sandboxes per node
    default_user: str = "user"
    envd_port: int = 49983
    # A running sandbox whose process died is noticed within this (drivers with
    # `LivenessDriver`), and removed with the reason; 0: never checked.
    liveness_interval_ms: int = 1000
    # Every running sandbox's envd is asked for /health this often (0: never); one that has
    # not answered for `envd_unanswered_s` is reported dead and removed.
    envd_check_interval_s: int = 5
    envd_unanswered_s: int = 60
    # Build the built-in `code-interpreter-v1` template (when missing) in the background at
    # server start, so that e2b-code-interpreter's first `Sandbox.create()` does not wait for
    # it past the SDK's 60 s request timeout; off, the first create naming it builds it.
    code_interpreter_prebuild: bool = True
    # Resource samples of running sandboxes (GET /sandboxes/{id}/metrics?start&end): one
    # every `metrics_interval_s` (0: none), the last `metrics_kept` of each sandbox.
    metrics_interval_s: int = 5
    metrics_kept: int = 720
    # Sandbox logs (GET /sandboxes/{id}/logs): at most `logs_per_sandbox` entries each, none
    # older than `logs_max_age_s`; they outlive the sandbox until then.
    logs_per_sandbox: int = 2000
    logs_max_age_s: int = 7 * 24 * 3600


@dataclass
class RuntimeConfig:
    driver: str = "container"
    # A burst of up to this many creates finds everything prepared ahead of time:
    warm_pool: int = 16  # network slots (netns + veth) for sandboxes with internet access
    warm_processes: int = 16  # half-set-up sandbox processes kept by the fork-server
    # Fully started idle sandboxes of the default template's shape (0: none); a matching
    # create only claims one (identity, limits, envd /init). Refilled while the node is idle.
    ready_pool: int = 16
    # qemu driver: "auto" probes KVM once (a short boot) and falls back to TCG emulation.
    qemu_accel: str = "auto"
    # qemu driver: creates restore a snapshot of a VM booted once per shape (~1 s under TCG)
    # instead of booting a kernel each time (~10 s under TCG).
    qemu_boot_snapshot: bool = True
    # Firecracker driver (driver = "firecracker"; KVM hosts only, see docs/operations.md).
    firecracker_binary: str = ""  # "" = `firecracker` on PATH
    firecracker_kernel: str = "/opt/aenv/vm/current/vmlinux"  # uncompressed ELF kernel
    firecracker_initrd: str = ""  # optional initramfs ("" = none)
    firecracker_rootfs: str = "/opt/aenv/vm/current/rootfs.ext4"  # base disk, copied per VM
    firecracker_tools: str = ""  # optional read-only second disk (e.g. the VM tools image)
    firecracker_boot_timeout_s: int = 30  # boot/restore until envd answers
    firecracker_probe_timeout_s: int = 10  # the test boot of start()


@dataclass
class NetworkConfig:
    bridge: str = "aenv0"
    subnet: str = "10.88.0.0/16"  # sandboxes get addresses here; the host is .0.1


@dataclass
class ImagesConfig:
    """Pulling OCI images into templates (`aenv pull`, POST /aenv/images/pull)."""

    # Where a short name (`alpine`, `python:3.12`) is looked up, in order; docker.io style
    # registries get the `library/` prefix for one-component names.
    search_registries: list[str] = field(default_factory=lambda: ["docker.io"])
    allowed_registries: list[str] = field(default_factory=list)  # empty: every registry
    insecure_registries: list[str] = field(default_factory=list)  # plain HTTP allowed
    # A docker-style auth file ({"auths": {"host": {"auth": base64(user:pass)}}}); "" = none.
    auth_file: str = ""
    # Per-registry {"username": ..., "password": ...}; wins over the auth file.
    credentials: dict[str, dict[str, str]] = field(default_factory=dict)
    max_concurrent_downloads: int = 3
    max_concurrent_unpacks: int = 2  # CPU-bound (decompress + write): one per core
    retries: int = 5  # per blob, resuming from what was received (HTTP Range)
    # Unpacked OCI layers kept on local disk, bytes (0 = unbounded). Beyond it the least
    # recently used layers no live sandbox or operation holds are evicted; a create from a
    # template whose layers were evicted fetches them again (`aenv.images.cache`).
    cache_bytes: int = 50 << 30
    # On-demand layers (`aenv.images.lazy`, docs/architecture.md): `convert_layers` pushes
    # every unpacked layer into the snapshot repository ([snapshot]) in the background;
    # `on_demand` pulls layers found converted there lazily (a FUSE read-through layer: a
    # sandbox starts once the layer's metadata is local; contents are fetched on first read).
    convert_layers: bool = False
    on_demand: bool = False
    on_demand_prefetch_s: int = 10  # fetch the rest of a layer this long after its first read; -1: never


@dataclass
class SecurityConfig:
    """Isolation measures of container sandboxes (docs/security.md); off only to measure them."""

    # The seccomp filter of `runtime/container/seccomp.py` on everything a sandbox runs
    # (`AENV_SECURITY_SECCOMP=0` turns it off).
    seccomp: bool = True
    # User namespaces (runtime/container/zygote.py `_enter_userns`): root in a container
    # sandbox is uid `userns_host_id` on the host, ids 0..userns_size-1 map to
    # userns_host_id.. . One range per node, the same default everywhere: writable and
    # sealed layers hold these shifted ids on disk, and a sealed layer moved to another
    # node keeps its meaning. Each sandbox still gets a user namespace object of its own.
    # Trade-off (as Docker's userns-remap): sandboxes share kernel uids, so a file one
    # sandbox's root owns is owned by every sandbox's root; pid, mount, ipc and network
    # namespaces (each sandbox's own, owned by the host's user namespace) keep them apart,
    # and capabilities count only in a sandbox's own user namespace. A range per sandbox
    # would need every sealed layer re-idmapped (or copied) for each child that stacks it.
    userns: bool = False  # off by default: CRIU 4.2.1 cannot checkpoint them (docs/criu-notes.md)
    userns_host_id: int = 1_000_000
    userns_size: int = 65536


@dataclass
class StorageConfig:
    """Where sandboxes' writable layers, sealed layers and snapshots live (`storage/volume.py`)."""

    # "auto": if AENV_HOME's filesystem is not btrfs, they go on a btrfs filesystem in a sparse
    # file, loop-mounted at $home/volume (nosuid, nodev): snapshots and forks then seal a
    # writable layer in O(1), and each sandbox's disk size is enforced (simple quotas). The
    # database and secrets stay on the home's own filesystem, so a full volume never stops
    # the server. "off": everything on the home's filesystem (on ext4 a seal copies the
    # writable layer, and disk sizes are not enforced).
    volume: str = "auto"
    volume_size_gb: int = 0  # GiB, sparse; 0: 3/4 of the free space where the image is made
    volume_image: str = ""  # the backing file; "" = $home/volume.img
    # E2B volumes (`orchestrator/volumes.py`, under $home/volumes): a volume's size, MiB,
    # unless its create names one (enforced where volumes live on btrfs), and how many a
    # node keeps.
    volumes_size_mb: int = 10240
    volumes_max: int = 1000


@dataclass
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    sandbox: SandboxDefaults = field(default_factory=SandboxDefaults)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    snapshot: SnapshotConfig = field(default_factory=SnapshotConfig)
    images: ImagesConfig = field(default_factory=ImagesConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)

    @property
    def home(self) -> Path:
        return self.server.home


_SHORT_ENV = {"AENV_HOME": ("server", "home"), "AENV_LISTEN": ("server", "listen"),
              "AENV_API_KEY": ("server", "api_key")}


def _coerce(section: str, key: str, current: Any, raw: Any) -> Any:
    kind: type = type(current) if current is not None else str
    try:
        if isinstance(current, list):
            # From the environment: a comma-separated list.
            items = raw.split(",") if isinstance(raw, str) else list(raw)
            return [str(item).strip() for item in items if str(item).strip()]
        if isinstance(current, dict):
            # From the environment: JSON (`AENV_IMAGES_CREDENTIALS='{"host": {...}}'`).
            value = json.loads(raw) if isinstance(raw, str) else raw
            if not isinstance(value, dict):
                raise TypeError(raw)
            return value
        if isinstance(current, Path) or key == "home":
            return Path(raw)
        if kind is bool:
            if isinstance(raw, bool):
                return raw
            return str(raw).strip().lower() in ("1", "true", "yes", "on")
        if kind is int:
            return int(raw)
        return str(raw)
    except (TypeError, ValueError):  # json.JSONDecodeError is a ValueError
        raise invalid(f"config {section}.{key}: cannot use {raw!r} as {kind.__name__}") from None


def _apply(cfg: Config, section: str, key: str, raw: Any) -> None:
    part = getattr(cfg, section, None)
    if part is None or not dataclasses.is_dataclass(part):
        raise invalid(f"config: unknown section [{section}]")
    if key not in {f.name for f in dataclasses.fields(part)}:
        raise invalid(f"config: unknown key {section}.{key}")
    setattr(part, key, _coerce(section, key, getattr(part, key), raw))


def load_config(env: Mapping[str, str] | None = None, path: Path | None = None) -> Config:
    """Build the effective configuration. Raises AenvError(invalid_argument) on bad input."""
    env = os.environ if env is None else env
    cfg = Config()
    if "AENV_HOME" in env:
        cfg.server.home = Path(env["AENV_HOME"])
    file = path or (Path(env["AENV_CONFIG"]) if "AENV_CONFIG" in env else cfg.home / "config.toml")
    if file.exists():
        try:
            data = tomllib.loads(file.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise invalid(f"config {file}: {exc}") from None
        for section, values in data.items():
            if not isinstance(values, dict):
                raise invalid(f"config {file}: [{section}] must be a table")
            for key, raw in values.items():
                _apply(cfg, section, key, raw)
    for name, value in env.items():
        if name in _SHORT_ENV:
            _apply(cfg, *_SHORT_ENV[name], value)
        elif name.startswith("AENV_") and name.count("_") >= 2 and name != "AENV_CONFIG":
            _, section, key = name.lower().split("_", 2)
            if hasattr(cfg, section):
                _apply(cfg, section, key, value)
    return cfg
