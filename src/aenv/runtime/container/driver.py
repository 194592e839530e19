"""`ContainerDriver`: sandboxes as Linux namespaces + cgroup v1 + overlayfs, forked from a
pre-warmed envd fork-server (see `zygote.py` for what happens inside a sandbox).

Owns: the fork-server process, the per-sandbox cgroups (`cgroups.py`), workspaces
(`spec.workspace`: upper/ and work/ of the overlay, which is mounted over the workspace
directory itself inside the sandbox's mount namespace), a small read-only layer of its own
(mountpoints), network slots (`network.py`), and the cached network-namespace fds used by
`connect()`.
Must not touch: the host's mount table (sandbox mounts live in their own private mount
namespaces), other cgroups, the orchestrator's records (handles are returned, never stored).

Handle data (JSON): pid + start_time identify the sandbox's init across pid reuse and server
restarts; workspace, slot (+ its address) and envd_port let a restarted driver clean up
without the spec.

create() returns when envd's listen socket exists (connections queue in the kernel until its
event loop runs, a few ms later).

Ready pool: for the shapes given to `set_ready_shapes()` (the server gives the default
template's), the driver keeps up to `runtime.ready_pool` fully started idle sandboxes, named
`pool-<server pid>-<its start time>-<n>`, with workspaces under <state>/pool/ and an envd
token only the driver knows. A matching create claims one instead: renames its cgroup
directories and workspace to the sandbox id's, sets the hostname (setns into its UTS
namespace) and /etc/hostname + /etc/hosts, applies the cpu/pids limits if they differ, and
`POST /init`s envd with the real token, env vars, user and workdir (~1 ms of CPU instead of
~16). The pool is refilled one sandbox at a time, only after no create has been in flight
for `ready_idle` seconds. Unclaimed pool sandboxes are destroyed by close(), and those of a
server that died are destroyed by the next start(). connect() reaches 127.0.0.1:port inside a sandbox without
any veth: the socket is created while the event loop's thread is setns()'d into the
sandbox's network namespace.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aenv.config import Config
from aenv.errors import AenvError, ErrorCode
from aenv.runtime import etc_files, pybundle
from aenv.runtime.base import (
    ReadyShape,
    ResourceUsage,
    RuntimeHandle,
    SandboxSpec,
    VolumeMount,
)
from aenv.runtime.container import (
    cgroups,
    checkpoint,
    layers,
    linux,
    mounts,
    recovery,
    seccomp,
    zygote,
)
from aenv.runtime.container import egress as slot_egress
from aenv.runtime.container.network import NetworkPool, Slot
from aenv.runtime.egress import EgressPolicy
from aenv.runtime.envd_init import init_body, post_init
from aenv.runtime.process import LiveProcess, kill_and_wait
from aenv.storage.usage import allocated_bytes

log = logging.getLogger(__name__)
_ID_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")  # a hostname label and a path component
_POOL_PREFIX = "pool-"
# How long a sandbox stays paused before its state is synced to disk (the same delay as the
# upload to the repository, orchestrator/paused.py).
PAUSED_SYNC_DELAY_S = 1.0
_pool_numbers = itertools.count(1)  # process-wide: several drivers may share a process


@dataclass
class _Ready:
    """An idle, fully started sandbox of the ready pool."""

    shape: ReadyShape
    handle: RuntimeHandle  # its sandbox_id is the pool name
    token: str  # envd's access token until the claim replaces it
    cpu_ns: int  # its cgroup's CPU use once idle: the claimed sandbox's stats count from here


class _Zygote:
    """The fork-server child process and the JSON-lines conversation with it."""

    def __init__(self, proc: subprocess.Popen[bytes], reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.proc = proc
        self.reader = reader
        self.writer = writer
        self.pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.next_id = 1
        self.pid = proc.pid
        self.task: asyncio.Task[None] | None = None
        self.dead = False

    async def pump(self) -> None:
        try:
            while True:
                line = await self.reader.readline()
                if not line:
                    break
                msg = json.loads(line)
                fut = self.pending.pop(msg.get("id", -1), None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
        finally:
            self.dead = True
            for fut in self.pending.values():
                if not fut.done():
                    fut.set_exception(AenvError(ErrorCode.UNAVAILABLE,
                                                "container fork-server exited"))
            self.pending.clear()

    def submit(self, spec: dict[str, Any]) -> asyncio.Future[dict[str, Any]]:
        """Send one spawn request; the future resolves with the zygote's reply."""
        if self.dead:
            raise AenvError(ErrorCode.UNAVAILABLE, "container fork-server exited")
        req_id = self.next_id
        self.next_id += 1
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.pending[req_id] = fut
        self.writer.write(json.dumps({"op": "spawn", "id": req_id, "spec": spec}).encode()
                          + b"\n")
        return fut

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(Exception):
            await self.writer.wait_closed()
        if self.task is not None:
            with contextlib.suppress(BaseException):
                await self.task
        # EOF on its control socket makes the fork-server exit; sandboxes are not its
        # children in any way that matters (they re-parent to the host's init).
        try:
            await asyncio.wait_for(asyncio.to_thread(self.proc.wait), 5)
        except TimeoutError:
            self.proc.kill()
            await asyncio.to_thread(self.proc.wait)


class ContainerDriver:
    """The `container` runtime driver. One per server process."""

    name = "container"
    supports_volumes = True  # SandboxSpec.volumes are bind-mounted (mounts.py)

    def __init__(
        self,
        config: Config,
        *,
        bundle: Path = pybundle.BUNDLE_DIR,
        cgroup_layout: cgroups.CgroupLayout | None = None,
        network: NetworkPool | None = None,
        envd_module: str = "aenv.envd.server",
        extra_python_path: tuple[str, ...] = (),
        build_bundle: bool = True,
        create_timeout: float = 30.0,
        warm_processes: int | None = None,
        max_concurrent_setups: int | None = None,
        ready_pool: int | None = None,
        ready_idle: float = 0.05,
    ) -> None:
        self.config = config
        self.bundle = bundle
        self.cgroups = cgroup_layout or cgroups.CgroupLayout()
        self.network = network or NetworkPool(config.network.bridge, config.network.subnet,
                                              config.runtime.warm_pool,
                                              idle=lambda: not self._creating)
        self.envd_module = envd_module
        self.extra_python_path = extra_python_path
        self.build_bundle = build_bundle
        self.create_timeout = create_timeout
        # Pre-forked, half-set-up sandbox processes kept by the fork-server (~1 MiB each):
        # a burst of up to this many creates skips fork, cgroup creation and unsharing.
        self.warm_processes = (config.runtime.warm_processes if warm_processes is None
                               else warm_processes)
        self.max_concurrent_setups = max_concurrent_setups  # None: one per CPU
        # Fully started sandboxes of the shapes set by set_ready_shapes(), refilled once no
        # create has been in flight for `ready_idle` seconds.
        self.ready_pool = config.runtime.ready_pool if ready_pool is None else ready_pool
        self.ready_idle = ready_idle
        self.state_dir = config.home / "runtime" / "container"
        # Our own top-most read-only layer: empty mountpoint directories, so that no sandbox
        # copies up (creates inodes for) /opt/aenv/... or /run/aenv on its create path.
        self.driver_layer = self.state_dir / "layer"
        # Workspace skeletons made by warm fork-server children, renamed into place on create.
        self.staging = self.state_dir / "staging"
        self.pool_dir = self.state_dir / "pool"  # workspaces of unclaimed pool sandboxes
        self._zygote: _Zygote | None = None
        self._zygote_lock = asyncio.Lock()
        self._live: dict[str, LiveProcess] = {}
        self._criu_version: str | None = None  # checked once, on the first checkpoint
        self._tasks: set[asyncio.Task[None]] = set()
        self._creating: set[str] = set()
        self._host_netns = -1
        self._network_started = False
        self._network_lock = asyncio.Lock()
        # Egress policies by slot address (what the domain proxy asks), and that proxy.
        self._egress: dict[str, EgressPolicy] = {}
        self.egress_proxy = slot_egress.EgressProxy(self.network.host_address,
                                                    str(self.network.subnet), self._egress.get)
        self._egress_port: int | None = None
        self.last_timings: dict[str, float] = {}  # of the latest create, for benchmarks
        self._host_uts = -1
        self._shapes: list[ReadyShape] = []
        self._ready: list[_Ready] = []
        self._pool_task: asyncio.Task[None] | None = None
        self._pool_open = False
        self._last_create = 0.0  # monotonic end of the latest create
        me = os.getpid()
        self._pool_owner = f"{me}-{linux.proc_start_time(me)}"
        self._bundle_version: str | None = None
        # The sandboxes' seccomp program (seccomp.py), compiled once by start(); None: off.
        self._seccomp_program: bytes | None = None
        # Per-sandbox disk quotas (btrfs simple quotas on the workspaces' filesystem), set
        # at start(); False where the filesystem cannot (ext4: the disk size is advisory).
        self._disk_quota = False
        # Sandboxes in user namespaces (SecurityConfig.userns): the node's id range (each
        # sandbox its own namespace, made by the fork-server). None: they run as host root.
        self.userns = (checkpoint.UsernsRange(config.security.userns_host_id,
                                              config.security.userns_size)
                       if config.security.userns else None)
        self._home_bind = False  # whether start() bind-mounted the home nosuid,nodev

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        if self.build_bundle:
            # Idempotent and ~1 s when up to date; refreshes the envd code the sandboxes run.
            await asyncio.to_thread(pybundle.build, self.bundle)
        if not pybundle.loader_path(self.bundle).exists():
            raise AenvError(ErrorCode.UNAVAILABLE,
                            f"runtime bundle missing at {self.bundle}: run "
                            "`python -m aenv.runtime.pybundle build`")
        # What the fork-server (and every sandbox it makes) maps: paused images name it.
        self._bundle_version = pybundle.bundle_id(self.bundle)
        await asyncio.to_thread(self.cgroups.ensure_parents)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.staging.mkdir(exist_ok=True)
        self.pool_dir.mkdir(exist_ok=True)
        # Sandboxes write their files (uppers, sealed layers) into the home, as their root
        # or any uid they like: from the host, a setuid file or device node made there must
        # be inert for a local user who reaches it (with or without user namespaces). Inside
        # a sandbox, setuid programs still work: the overlay root is a mount of its own.
        # Usually the storage volume (storage/volume.py) is mounted so already; else (the
        # home's own filesystem holds them) the home becomes a nosuid,nodev bind mount.
        self._home_bind = await asyncio.to_thread(self._protect_storage) or self._home_bind
        self._disk_quota = await asyncio.to_thread(_enable_disk_quota, self.state_dir)
        await asyncio.to_thread(self._sweep_warm, None)  # left by a dead fork-server
        # Unclaimed pool sandboxes of a server that died (kill -9): before the network
        # starts, so that their slots count as abandoned.
        await asyncio.to_thread(self._sweep_pool_orphans)
        await asyncio.to_thread(self._make_driver_layer)
        if self.config.security.seccomp:
            self._seccomp_program = await asyncio.to_thread(seccomp.compile_filter)
        # The event loop thread's own network namespace, to switch back to after connect().
        self._host_netns = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        self._host_uts = os.open("/proc/self/ns/uts", os.O_RDONLY | os.O_CLOEXEC)
        await self._ensure_zygote()
        self._pool_open = True
        self._kick_pool()
        # Bridge, firewall and warm network slots get ready in the background (sandboxes
        # have internet access by default); a failure surfaces at the first create needing it.
        self._background(self._warm_network())

    async def _warm_network(self) -> None:
        with contextlib.suppress(AenvError, OSError):
            await self._ensure_network()

    def _make_driver_layer(self) -> None:
        # Modes of merged directories come from the top layer: use the usual 0755.
        self.driver_layer.mkdir(parents=True, exist_ok=True)
        for rel in (str(self.bundle).lstrip("/"), zygote.RUN_DIR.lstrip("/")):
            path = self.driver_layer
            for part in rel.split("/"):
                path = path / part
                path.mkdir(exist_ok=True)
                path.chmod(0o755)
        run = self.driver_layer / zygote.RUN_DIR.lstrip("/")
        run.chmod(0o700)  # envd's own
        mask = self.driver_layer / zygote.MASK_DIR.lstrip("/")
        mask.mkdir(exist_ok=True)
        mask.chmod(0o555)
        zygote.populate_dev(str(self.driver_layer / "dev"))
        self.driver_layer.chmod(0o755)

    def _sweep_warm(self, zygote_pid: int | None) -> None:
        """Cgroups and staged workspaces of warm children that never became sandboxes: those
        of `zygote_pid`, or of every fork-server that is gone. Blocking."""
        self.cgroups.sweep_warm(zygote_pid)
        for entry in self.staging.glob("warm-*-*"):
            owner = entry.name.split("-")[1]
            if not owner.isdigit():
                continue
            if (zygote_pid is not None and int(owner) == zygote_pid) or (
                    zygote_pid is None and not Path(f"/proc/{owner}").exists()):
                shutil.rmtree(entry, ignore_errors=True)

    async def close(self) -> None:
        # Unclaimed pool sandboxes are nobody's: they go (live sandboxes stay).
        self._pool_open = False
        if self._pool_task is not None:
            with contextlib.suppress(BaseException):
                await self._pool_task
            self._pool_task = None
        ready, self._ready = self._ready, []
        await asyncio.gather(*[self._destroy_ready(r) for r in ready], return_exceptions=True)
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._zygote is not None:
            await self._zygote.close()
            await asyncio.to_thread(self._sweep_warm, self._zygote.pid)
            self._zygote = None
        if self._network_started:
            if self._egress_port is not None:
                await self.egress_proxy.close()
                with contextlib.suppress(AenvError):
                    await asyncio.to_thread(self.network.run_nft, (
                        f"delete element ip aenv {slot_egress.PROXY_PORTS_SET} "
                        f"{{ {self._egress_port} }}"))
                self._egress_port = None
            await self.network.close()
            self._network_started = False
        for live in self._live.values():
            live.close_netns()
        self._live.clear()
        if self._host_netns >= 0:
            os.close(self._host_netns)
            self._host_netns = -1
        if self._host_uts >= 0:
            os.close(self._host_uts)
            self._host_uts = -1
        if self._home_bind:
            with contextlib.suppress(OSError):
                linux.umount2(str(self.config.home), linux.MNT_DETACH)
            self._home_bind = False

    async def _ensure_network(self) -> None:
        async with self._network_lock:  # concurrent first creates: set up once
            if not self._network_started:
                await self.network.start()
                # The domain-rule proxy, on the bridge address the network just set up.
                port = await self.egress_proxy.start()
                await asyncio.to_thread(self.network.run_nft, (
                    f"add element ip aenv {slot_egress.PROXY_PORTS_SET} {{ {port} }}"))
                self._egress_port = port
                self._network_started = True

    async def _ensure_zygote(self) -> _Zygote:
        async with self._zygote_lock:
            if self._zygote is not None and not self._zygote.dead:
                return self._zygote
            if self._zygote is not None:
                await self._zygote.close()
                await asyncio.to_thread(self._sweep_warm, self._zygote.pid)
            self._zygote = await self._spawn_zygote()
            return self._zygote

    async def _spawn_zygote(self) -> _Zygote:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        app = str(self.bundle / pybundle.APP_DIR)
        code = (f"import sys; sys.path.insert(0, {app!r}); "
                "from aenv.runtime.container.zygote import main; main()")
        argv = [*pybundle.python_argv(self.bundle), "-c", code,
                "--control-fd", str(theirs.fileno()), "--envd-module", self.envd_module]
        if self.extra_python_path:
            argv += ["--extra-path", ":".join(self.extra_python_path)]
        try:
            proc = await asyncio.to_thread(self._popen_zygote, argv, theirs.fileno())
        finally:
            theirs.close()
        reader, writer = await asyncio.open_unix_connection(sock=ours, limit=1 << 20)
        zygote = _Zygote(proc, reader, writer)
        try:
            hello = await asyncio.wait_for(reader.readline(), 60)
        except TimeoutError:
            hello = b""
        if not hello or json.loads(hello).get("event") != "hello":
            proc.kill()
            await asyncio.to_thread(proc.wait)
            tail = (self.state_dir / "zygote.log").read_text(errors="replace")[-2000:]
            raise AenvError(ErrorCode.UNAVAILABLE, f"container fork-server failed: {tail}")
        # hex: JSON has no bytes; the zygote decodes it once.
        program = None if self._seccomp_program is None else self._seccomp_program.hex()
        writer.write(json.dumps({"op": "configure", "warm": self.warm_processes,
                                 "bundle": str(self.bundle), "staging": str(self.staging),
                                 "subvolumes": linux.on_btrfs(str(self.staging)),
                                 "cgroups": self.cgroups.zygote_config(),
                                 "max_setups": self.max_concurrent_setups,
                                 "userns": None if self.userns is None else {
                                     "host_id": self.userns.host_id, "size": self.userns.size},
                                 "seccomp": program}).encode() + b"\n")
        zygote.task = asyncio.get_running_loop().create_task(zygote.pump())
        return zygote

    def _popen_zygote(self, argv: list[str], control_fd: int) -> subprocess.Popen[bytes]:
        with open(self.state_dir / "zygote.log", "ab") as log:
            # A new session: the fork-server and its sandboxes survive the server's terminal
            # and process group going away.
            return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                    pass_fds=(control_fd,), start_new_session=True,
                                    env=pybundle.python_env(), cwd="/")

    # -- sandboxes ------------------------------------------------------------------------
    def _check_spec(self, spec: SandboxSpec) -> None:
        if not _ID_RE.match(spec.sandbox_id):
            raise AenvError(ErrorCode.INVALID_ARGUMENT, f"bad sandbox id {spec.sandbox_id!r}")
        if not spec.lower_layers:
            raise AenvError(ErrorCode.INVALID_ARGUMENT, "no root filesystem layers")
        for layer in (*spec.lower_layers, spec.workspace):
            text = str(layer)
            if not layer.is_absolute() or any(c in text for c in ":,\n"):
                # overlayfs options are ':'- and ','-separated.
                raise AenvError(ErrorCode.INVALID_ARGUMENT, f"unusable path {text!r}")
        for layer in spec.lower_layers:
            if not layer.is_dir():
                raise AenvError(ErrorCode.INVALID_ARGUMENT, f"layer {layer} does not exist")
        if spec.memory_mb < 16 or spec.cpu_count < 1 or spec.pids_max < 8:
            raise AenvError(ErrorCode.INVALID_ARGUMENT, "resource limits too small")

    def _request(self, spec: SandboxSpec, slot_path: str | None,
                 slot_address: str | None) -> dict[str, Any]:
        hosts = etc_files.hosts(spec.sandbox_id, slot_address)
        return {
            "sandbox_id": spec.sandbox_id,
            "hostname": spec.sandbox_id,
            "lower": [str(self.driver_layer), *(str(p) for p in spec.lower_layers)],
            "lower_shifted": [str(p) for p in self._shifted_layers(spec.lower_layers)],
            "workspace": str(spec.workspace),
            "memory_mb": spec.memory_mb,
            "cgroup_limits": self.cgroups.limits(spec.memory_mb, spec.cpu_count,
                                                 spec.pids_max),
            "netns": slot_path,
            "hosts": hosts,
            "resolv_conf": etc_files.host_resolv_conf() if slot_path else None,
            "envd": {
                "port": spec.envd_port,
                "host": "0.0.0.0",
                "access_token": spec.envd_access_token,
                "env_vars": dict(spec.env_vars),
                "default_user": spec.default_user,
                "default_workdir": spec.default_workdir,
                "is_init": True,
            },
        }

    def _protect_storage(self) -> bool:
        home = self.config.home
        # (state_dir exists by now: start() made it)
        stored = [p for p in (home / "sandboxes", home / "layers", home / "snapshots",
                              self.state_dir) if p.exists()]
        if all(os.statvfs(p).f_flag & os.ST_NOSUID and os.statvfs(p).f_flag & os.ST_NODEV
               for p in stored):
            return False
        return linux.mount_nosuid_nodev(str(home))

    def _shifted_layers(self, lower: Sequence[Path]) -> list[Path]:
        """The layers of `lower` stacked without an idmapped mount (they hold shifted ids)."""
        if self.userns is None:
            return []
        return [p for p in lower if layers.stores_shifted_ids(p, self.userns.host_id)]

    async def create(self, spec: SandboxSpec) -> RuntimeHandle:
        self._check_spec(spec)
        sid = spec.sandbox_id
        if sid in self._live or sid in self._creating or self.cgroups.exists(sid):
            # Checked before anything is made: a failed create cleans up by sandbox id.
            raise AenvError(ErrorCode.CONFLICT, f"sandbox {sid} already exists")
        with self._in_flight(sid):
            ready = self._take_ready(spec)
            if ready is not None:
                handle = await self._claim(ready, spec)
                if handle is not None:
                    return handle
            return await self._create(spec)

    @contextlib.contextmanager
    def _in_flight(self, sid: str) -> Iterator[None]:
        """A create, restore or resume of `sid` in progress. Background refills (the ready
        pool, network slots) wait until none is, so that they take no CPU from a burst such
        as the 16 restores of a fork."""
        self._creating.add(sid)
        try:
            yield
        finally:
            self._creating.discard(sid)
            self._last_create = time.monotonic()
            self._kick_pool()

    @contextlib.contextmanager
    def _restoring(self, sid: str) -> Iterator[None]:
        """`sid`'s cgroups (which exist) weigh more while it is restored: see
        cgroups.CPU_SHARES_RESTORING."""
        self.cgroups.set_cpu_shares(sid, cgroups.CPU_SHARES_RESTORING)
        try:
            yield
        finally:
            with contextlib.suppress(OSError):  # gone with a failed restore's cleanup
                self.cgroups.set_cpu_shares(sid, cgroups.CPU_SHARES)

    async def _create(self, spec: SandboxSpec, timings: bool = True,
                      keep_files: bool = False) -> RuntimeHandle:
        """A new sandbox for `spec` from the zygote. `keep_files`: its workspace exists (a
        paused sandbox's upper) and a failed create leaves it there."""
        t0 = time.monotonic()
        zygote = await self._ensure_zygote()
        slot = None
        if spec.allow_internet_access:
            await self._ensure_network()
            slot = await self.network.acquire()
        t_slot = time.monotonic() - t0
        request = self._request(spec, str(slot.path) if slot else None,
                                slot.address if slot else None)
        data: dict[str, Any] = {"workspace": str(spec.workspace), "envd_port": spec.envd_port,
                                "bundle_version": self._bundle_version,
                                "slot": slot.name if slot else None,
                                "address": slot.address if slot else None}
        if slot is not None and spec.egress is not None:
            try:
                await self._apply_egress(slot, spec.egress, data)
            except BaseException:
                await self.network.release(slot.name)
                raise
        fut = zygote.submit(request)
        t_sent = time.monotonic()
        undo = dict(data, workspace=None) if keep_files else data
        try:
            # Shielded: once asked, the zygote makes the sandbox whatever happens to us; if we
            # are cancelled or time out, a background task waits for it and destroys it.
            reply = await asyncio.wait_for(asyncio.shield(fut), self.create_timeout)
        except BaseException as exc:
            self._background(self._discard(fut, spec.sandbox_id, undo))
            if isinstance(exc, TimeoutError):
                raise AenvError(ErrorCode.TIMEOUT,
                                f"sandbox {spec.sandbox_id} did not start in time") from None
            raise
        if not reply.get("ok"):
            await self._cleanup(spec.sandbox_id, undo, reply.get("pid"))
            raise AenvError(ErrorCode.INTERNAL,
                            f"sandbox {spec.sandbox_id} failed to start: {reply.get('error')}")
        data["pid"] = int(reply["pid"])
        data["start_time"] = int(reply["start_time"])
        self._limit_disk(spec, data)
        self._live[spec.sandbox_id] = LiveProcess(data["pid"], data["start_time"], cpu_used=0,
                                            cpu_at=time.monotonic())
        try:
            await self._mount_volumes(spec, data, spec.volumes)
        except BaseException:
            await self._cleanup(spec.sandbox_id, data, data["pid"], data["start_time"])
            raise
        if timings:
            self.last_timings = {"slot": t_slot, "total": time.monotonic() - t0,
                                 "sent": t_sent - t0, "pooled": 0.0,
                                 **{f"zygote_{k}": v for k, v in reply.get("t", {}).items()}}
        return RuntimeHandle(driver=self.name, sandbox_id=spec.sandbox_id, data=data)

    # -- ready pool -------------------------------------------------------------------------
    def set_ready_shapes(self, shapes: list[ReadyShape]) -> None:
        """The shapes to keep fully started sandboxes of (`ready_pool` in all, split evenly).
        Pool sandboxes of shapes no longer wanted are destroyed."""
        self._shapes = list(dict.fromkeys(shapes))
        keep = [r for r in self._ready if r.shape in self._shapes]
        for gone in [r for r in self._ready if r.shape not in self._shapes]:
            self._background(self._destroy_ready(gone))
        self._ready = keep
        self._kick_pool()

    def ready_count(self, shape: ReadyShape | None = None) -> int:
        return sum(1 for r in self._ready if shape is None or r.shape == shape)

    def _target(self, index: int) -> int:
        n = len(self._shapes)
        return self.ready_pool // n + (1 if index < self.ready_pool % n else 0)

    def _kick_pool(self) -> None:
        if (self._pool_open and self.ready_pool > 0 and self._shapes
                and (self._pool_task is None or self._pool_task.done())):
            self._pool_task = asyncio.get_running_loop().create_task(self._fill_pool())

    def _pool_deficit(self) -> ReadyShape | None:
        """The shape furthest below its share of the pool, if any is."""
        best, missing = None, 0
        for i, shape in enumerate(self._shapes):
            short = self._target(i) - self.ready_count(shape)
            if short > missing:
                best, missing = shape, short
        return best

    async def _fill_pool(self) -> None:
        """One pool sandbox at a time, and only while no create is in flight (nor was for
        `ready_idle` s): refills must not take CPU from a burst of creates."""
        failures = 0
        while self._pool_open:
            shape = self._pool_deficit()
            if shape is None:
                return
            quiet = time.monotonic() - self._last_create
            if self._creating or quiet < self.ready_idle:
                await asyncio.sleep(max(self.ready_idle - quiet, 0.01))
                continue
            try:
                ready = await self._make_ready(shape)
            except (AenvError, OSError):
                failures += 1
                if failures >= 3:
                    return  # tried again after the next create
                await asyncio.sleep(0.5 * failures)
                continue
            failures = 0
            if not self._pool_open or shape not in self._shapes:
                await self._destroy_ready(ready)
                continue
            self._ready.append(ready)

    async def _make_ready(self, shape: ReadyShape) -> _Ready:
        name = f"{_POOL_PREFIX}{self._pool_owner}-{next(_pool_numbers)}"
        token = secrets.token_urlsafe(24)
        spec = SandboxSpec(sandbox_id=name, lower_layers=shape.lower_layers,
                           workspace=self.pool_dir / name, cpu_count=shape.cpu_count,
                           memory_mb=shape.memory_mb, pids_max=shape.pids_max,
                           envd_access_token=token, default_user=shape.default_user,
                           allow_internet_access=shape.allow_internet_access,
                           envd_port=shape.envd_port)
        self._check_spec(spec)
        handle = await self._create(spec, timings=False)
        try:
            # A first request makes envd fault in (copy-on-write) its request path now,
            # rather than during a claim: ~0.7 ms less of CPU on the create path.
            await self._init_envd(handle, token, {"envVars": {},
                                                  "defaultUser": shape.default_user})
            cpu_ns = int(await asyncio.to_thread(self.cgroups.read, "cpuacct", name,
                                                 "cpuacct.usage"))
        except BaseException:
            with contextlib.suppress(AenvError):
                await self.destroy(handle)
            raise
        return _Ready(shape, handle, token, cpu_ns)

    async def _destroy_ready(self, ready: _Ready) -> None:
        with contextlib.suppress(AenvError):
            await self.destroy(ready.handle)

    def _take_ready(self, spec: SandboxSpec) -> _Ready | None:
        key = ReadyShape.key_of(spec)
        for i, ready in enumerate(self._ready):
            if ready.shape.key == key:
                return self._ready.pop(i)
        return None

    async def _claim(self, ready: _Ready, spec: SandboxSpec) -> RuntimeHandle | None:
        """Turn a pool sandbox into `spec`'s sandbox. None (and the pool sandbox destroyed)
        if that fails: the caller then creates one the usual way."""
        t0 = time.monotonic()
        name, sid = ready.handle.sandbox_id, spec.sandbox_id
        data = dict(ready.handle.data)
        live = self._live.pop(name, None) or LiveProcess(int(data["pid"]), int(data["start_time"]))
        live.cpu_used, live.cpu_at = ready.cpu_ns, t0
        try:
            # Inline, not in a thread: ~1 ms of syscalls, and a thread hop per claim costs
            # more CPU than it saves under a burst.
            self._claim_host(name, ready.shape, spec, data, live)
            t_host = time.monotonic() - t0
            if spec.egress is not None and data.get("slot"):
                await self._apply_egress(self.network.slot_by_name(str(data["slot"])),
                                         spec.egress, data)
            await self._mount_volumes(spec, data, spec.volumes)
            self._live[sid] = live
            handle = RuntimeHandle(driver=self.name, sandbox_id=sid, data=data)
            await self._init_envd(handle, ready.token, init_body(spec))
        except BaseException as exc:
            self._background(self._discard_claim(name, sid, data))
            if isinstance(exc, AenvError | OSError):
                return None
            raise
        self.last_timings = {"pooled": 1.0, "claim_host": t_host,
                             "total": time.monotonic() - t0}
        return handle

    def _claim_host(self, name: str, shape: ReadyShape, spec: SandboxSpec,
                    data: dict[str, Any], live: LiveProcess) -> None:
        """The host side of a claim: cgroups, workspace, hostname, /etc. Blocking (about a
        millisecond). Updates `data["workspace"]` once the workspace has moved."""
        if not live.alive():
            raise AenvError(ErrorCode.UNAVAILABLE, f"pool sandbox {name} is gone")
        sid = spec.sandbox_id
        root, parent = str(self.cgroups.root), self.cgroups.parent
        for ctrl in cgroups.CONTROLLERS:  # cgroup v1 renames within a parent
            os.rename(f"{root}/{ctrl}/{parent}/{name}", f"{root}/{ctrl}/{parent}/{sid}")
        limits = self.cgroups.limits(spec.memory_mb, spec.cpu_count, spec.pids_max)
        for ctrl, differs in (("cpu", spec.cpu_count != shape.cpu_count),
                              ("pids", spec.pids_max != shape.pids_max)):
            if differs:
                for file, value, _required in limits[ctrl]:
                    (self.cgroups.path(ctrl, sid) / file).write_text(value)
        try:
            os.rename(data["workspace"], spec.workspace)
            data["workspace"] = str(spec.workspace)
        except FileNotFoundError:
            with contextlib.suppress(OSError):
                spec.workspace.parent.mkdir(parents=True, exist_ok=True)
                os.rename(data["workspace"], spec.workspace)
                data["workspace"] = str(spec.workspace)
        except OSError:
            pass  # another filesystem, or something is there: it stays in the pool dir
        self._limit_disk(spec, data)
        self._set_identity(sid, live, data)

    def _set_identity(self, sid: str, live: LiveProcess, data: dict[str, Any]) -> None:
        """Hostname and /etc/hostname, /etc/hosts of a sandbox that was made under another
        name (a pool sandbox, or a copy restored from another sandbox's image)."""
        # Hostname: the sandbox's UTS namespace, for this thread only, and back.
        fd = os.open(f"/proc/{live.pid}/ns/uts", os.O_RDONLY | os.O_CLOEXEC)
        try:
            if not live.alive():  # checked after opening: the fd is surely its
                raise AenvError(ErrorCode.UNAVAILABLE, f"sandbox {sid} is gone")
            linux.setns(fd, linux.CLONE_NEWUTS)
            try:
                linux.sethostname(sid)
            finally:
                linux.setns(self._host_uts, linux.CLONE_NEWUTS)
        finally:
            os.close(fd)
        # /etc/hostname and /etc/hosts, rewritten in place through the sandbox's root. A
        # restored copy's processes ran before (its /etc may be anything, even a symlink out
        # of the root), so every component is opened without following symlinks.
        contents = {"hostname": sid + "\n", "hosts": etc_files.hosts(sid, data.get("address"))}
        root = os.open(f"/proc/{live.pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            etc = os.open("etc", os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                          dir_fd=root)
        except OSError:
            return  # a template with no (or an unusual) /etc: nothing to rename
        finally:
            os.close(root)
        try:
            for file, content in contents.items():
                raw = content.encode()
                try:
                    wfd = os.open(file, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK
                                  | os.O_CLOEXEC, dir_fd=etc)
                except OSError:
                    continue  # not there, or a symlink: leave it
                try:
                    if not stat.S_ISREG(os.fstat(wfd).st_mode):
                        continue
                    # Not O_TRUNC: truncating to zero frees the block (~0.4 ms on ext4).
                    os.pwrite(wfd, raw, 0)
                    os.ftruncate(wfd, len(raw))
                finally:
                    os.close(wfd)
        finally:
            os.close(etc)

    # ------------------------------------------------------------------ egress, volumes
    async def _apply_egress(self, slot: Slot, policy: EgressPolicy, data: dict[str, Any]
                            ) -> None:
        """Install `policy` on `slot` (one nft transaction) and record it in `data`."""
        if not policy.active:
            if data.get("egress"):
                await asyncio.to_thread(self.network.run_nft,
                                        slot_egress.clear_commands(slot.index, slot.address))
            data.pop("egress", None)
            self._egress.pop(slot.address, None)
            return
        proxy = (None if self._egress_port is None
                 else (self.network.host_address, self._egress_port))
        commands = slot_egress.apply_commands(
            slot.index, slot.address, policy, subnet=str(self.network.subnet),
            host_dns=self.network.host_dns(), proxy=proxy)
        self._egress[slot.address] = policy  # before the DNAT rules can send anything
        await asyncio.to_thread(self.network.run_nft, commands)
        data["egress"] = policy.to_json()

    async def set_egress(self, handle: RuntimeHandle, policy: EgressPolicy) -> RuntimeHandle:
        """`EgressDriver`: replace a running sandbox's outbound rules."""
        slot = handle.data.get("slot")
        if not slot:
            raise AenvError(ErrorCode.CONFLICT,
                            f"sandbox {handle.sandbox_id} has no network interface (it was "
                            "created without internet access): its egress cannot change")
        if not self._live_of(handle).alive():
            raise AenvError(ErrorCode.UNAVAILABLE, f"sandbox {handle.sandbox_id} is not running")
        await self._ensure_network()
        data = dict(handle.data)
        await self._apply_egress(self.network.slot_by_name(str(slot)), policy, data)
        return RuntimeHandle(self.name, handle.sandbox_id, data)

    async def _mount_volumes(self, spec: SandboxSpec, data: dict[str, Any],
                             volumes: Sequence[VolumeMount]) -> None:
        """Mount `volumes` (some of `spec.volumes`) into the running sandbox of `data`;
        `data["volumes"]` lists every volume mount point, for its checkpoints."""
        data["volumes"] = [v.path for v in spec.volumes]
        if not volumes:
            return
        if self.userns is not None:
            raise AenvError(ErrorCode.NOT_SUPPORTED,
                            "volumes are not supported for sandboxes in user namespaces")
        await asyncio.to_thread(mounts.attach_volumes, int(data["pid"]), list(volumes))

    async def _init_envd(self, handle: RuntimeHandle, token: str, body: dict[str, Any]
                         ) -> None:
        """`POST /init` to the sandbox's envd, authenticated with its current `token`."""
        sock = await self.connect(handle, int(handle.data["envd_port"]))
        await post_init(sock, token, body)

    async def _discard_claim(self, name: str, sid: str, data: dict[str, Any]) -> None:
        """Destroy a pool sandbox whose claim failed half-way (under either name)."""
        pid = data.get("pid")
        with contextlib.suppress(AenvError):
            await self._cleanup(sid, data, int(pid) if pid else None,
                                start_time=data.get("start_time"))
        with contextlib.suppress(AenvError):
            await self._kill_cgroup(name)
        with contextlib.suppress(OSError):
            await asyncio.to_thread(self.cgroups.remove, name)
        await asyncio.to_thread(shutil.rmtree, self.pool_dir / name, True)

    def _sweep_pool_orphans(self) -> None:
        """Destroy pool sandboxes (cgroup + workspace) of servers that are gone. Blocking."""
        base = self.cgroups.root / "pids" / self.cgroups.parent
        names = {p.name for p in base.iterdir()} if base.is_dir() else set()
        names |= {p.name for p in self.pool_dir.iterdir()} if self.pool_dir.is_dir() else set()
        for name in names:
            parts = name.split("-")
            if (len(parts) != 4 or parts[0] + "-" != _POOL_PREFIX or not parts[1].isdigit()
                    or not parts[2].isdigit()):
                continue
            if str(linux.proc_start_time(int(parts[1]))) == parts[2]:
                continue  # a live server's pool
            deadline = time.monotonic() + 10
            while (pids := self.cgroups.pids(name)) and time.monotonic() < deadline:
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                time.sleep(0.01)
            with contextlib.suppress(OSError):
                self.cgroups.remove(name)
            shutil.rmtree(self.pool_dir / name, ignore_errors=True)

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _discard(self, fut: asyncio.Future[dict[str, Any]], sandbox_id: str,
                       data: dict[str, Any]) -> None:
        """Destroy a sandbox whose create was abandoned, once the zygote has answered."""
        pid = None
        with contextlib.suppress(BaseException):
            reply = await asyncio.wait_for(fut, 120)
            pid = reply.get("pid")
        with contextlib.suppress(AenvError):
            await self._cleanup(sandbox_id, data, int(pid) if pid else None)

    def _live_of(self, handle: RuntimeHandle) -> LiveProcess:
        live = self._live.get(handle.sandbox_id)
        if live is None:
            try:
                live = LiveProcess(int(handle.data["pid"]), int(handle.data["start_time"]))
            except (KeyError, TypeError, ValueError):
                raise AenvError(ErrorCode.INVALID_ARGUMENT, "not a container handle") from None
            self._live[handle.sandbox_id] = live
        return live

    async def attach(self, handle: RuntimeHandle) -> bool:
        live = self._live_of(handle)
        if not live.alive():
            return False
        slot = handle.data.get("slot")
        if slot:
            await self._ensure_network()
            self.network.claim(slot)
            if handle.data.get("egress"):
                # Our proxy's port changed with the restart: the DNAT rules follow it.
                await self._apply_egress(self.network.slot_by_name(str(slot)),
                                         EgressPolicy.from_json(handle.data["egress"]),
                                         handle.data)
        return True

    def exit_reason(self, handle: RuntimeHandle) -> str | None:
        """`LivenessDriver`: whether the sandbox's init (envd) runs, by pid and start time.
        The memory cgroup's OOM-kill count is read before that check and kept while it runs:
        a count that rose by the time the init is gone means the OOM killer took it."""
        live = self._live_of(handle)
        kills = _oom_kills(self.cgroups, handle.sandbox_id)
        if live.alive():
            live.oom_kills = (live.oom_kills[1], kills)
            return None
        if _oom_kills(self.cgroups, handle.sandbox_id) > live.oom_kills[0]:
            return ("envd, the sandbox's init, was killed by the out-of-memory killer "
                    "(the sandbox used all of its memory)")
        return "envd, the sandbox's init, exited or was killed"

    def _netns_fd(self, handle: RuntimeHandle, live: LiveProcess) -> int:
        if live.netns_fd is None:
            try:
                fd = os.open(f"/proc/{live.pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                fd = -1
            # Checked after opening: the fd then surely belongs to our process, not to a
            # newer one that reused the pid.
            if fd < 0 or not live.alive():
                if fd >= 0:
                    os.close(fd)
                raise AenvError(ErrorCode.UNAVAILABLE,
                                f"sandbox {handle.sandbox_id} is not running")
            live.netns_fd = fd
        return live.netns_fd

    async def connect(self, handle: RuntimeHandle, port: int) -> socket.socket:
        live = self._live_of(handle)
        self._netns_fd(handle, live)  # opened once, checked to be this sandbox's
        return await live.connect(handle.sandbox_id, self._host_netns, "127.0.0.1", port, 10)

    async def stats(self, handle: RuntimeHandle) -> ResourceUsage:
        live = self._live_of(handle)
        if not live.alive():
            raise AenvError(ErrorCode.NOT_FOUND, f"sandbox {handle.sandbox_id} is not running")
        try:
            sample = cgroups.sample(self.cgroups, handle.sandbox_id)
        except OSError as exc:
            raise AenvError(ErrorCode.NOT_FOUND, f"sandbox {handle.sandbox_id}: {exc}") from None
        cpu_pct = live.cpu_percent(sample.cpu_ns, 1e9)
        upper = Path(handle.data.get("workspace", "")) / "upper"
        disk = await asyncio.to_thread(allocated_bytes, upper)
        return ResourceUsage(
            cpu_used_pct=round(cpu_pct, 2),
            mem_used_bytes=sample.mem_used,
            mem_total_bytes=sample.mem_limit,
            mem_cache_bytes=sample.mem_cache,
            disk_used_bytes=disk,
            disk_total_bytes=int(handle.data.get("disk_size_mb")
                                 or self.config.sandbox.disk_size_mb) * 2**20,
        )

    # ------------------------------------------------------------------ pause / resume
    async def _require_criu(self) -> None:
        """AenvError(NOT_SUPPORTED) when CRIU is missing, too old or unpatched (then a
        sandbox cannot be paused: its expiry kills it instead)."""
        if self._criu_version is None:
            self._criu_version = await checkpoint.check_criu()

    async def pause(self, handle: RuntimeHandle) -> RuntimeHandle:
        """Checkpoint the whole sandbox with CRIU into its workspace and stop it: its memory
        and CPU go back to the host; its cgroups, workspace (upper) and image stay. Its network
        slot goes back to the pool; the resume takes a fresh one."""
        sid = handle.sandbox_id
        live = self._live_of(handle)
        if not live.alive():
            raise AenvError(ErrorCode.UNAVAILABLE, f"sandbox {sid} is not running")
        await self._require_criu()
        data = dict(handle.data)
        images = self._checkpoints_dir(Path(data["workspace"])) / f"pause-{time.time_ns()}"
        try:
            stats = await checkpoint.dump(
                live.pid, images, freezer=self.cgroups.path("freezer", sid),
                leave_running=False, bundle=self.bundle,
                bundle_version=data.get("bundle_version"),
                external_netns=bool(data.get("slot")), crash="pause:criu",
                volumes=data.get("volumes") or ())
        except BaseException:
            # The sandbox runs on (thawed); a partial image only takes disk (a full disk is
            # a common reason for the failure).
            await asyncio.to_thread(shutil.rmtree, images, True)
            raise
        self.last_timings = {"frozen": stats.frozen_s, "total": stats.total_s}
        self._sync_later(sid, Path(data["workspace"]))
        self._live.pop(sid, None)
        live.close_netns()
        if data.get("slot"):
            await self._ensure_network()
            await self.network.release(str(data["slot"]))
            self._egress.pop(str(data.get("address")), None)
        data.update(pid=None, start_time=None, slot=None, address=None, images=str(images))
        data.pop("egress", None)  # the resume applies the spec's to its new slot
        return RuntimeHandle(self.name, sid, data)

    def _sync_later(self, sid: str, workspace: Path) -> None:
        """Write a paused sandbox's image and writable layer to disk (its overlay was volatile,
        see linux.mount_overlay, so nothing else syncs them): off the pause's path, and only
        once it has stayed paused for PAUSED_SYNC_DELAY_S, so that a resume straight after
        the pause does not compete with the writeback of the state it is about to read."""
        def sync() -> None:
            try:
                fd = os.open(workspace, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except FileNotFoundError:
                return  # killed meanwhile
            try:
                linux.syncfs(fd)
            finally:
                os.close(fd)

        async def later() -> None:
            await asyncio.sleep(PAUSED_SYNC_DELAY_S)
            if sid not in self._live:  # not resumed meanwhile
                await asyncio.to_thread(sync)

        self._background(later())

    def paused_state(self, handle: RuntimeHandle) -> dict[str, Path]:
        """The checkpoint image and the writable layer (the upper, as the pause left it);
        only the writable layer after a filesystem-only pause."""
        fs_pause = handle.data.get("fs_paused")
        if fs_pause:
            return {f"{fs_pause}-upper": Path(handle.data["workspace"]) / "upper"}
        if not handle.data.get("images"):
            raise AenvError(ErrorCode.CONFLICT, f"sandbox {handle.sandbox_id} is not paused")
        images = Path(handle.data["images"])
        pause = images.name  # pause-<ns>: unique to this pause
        return {f"{pause}-image": images,
                f"{pause}-upper": Path(handle.data["workspace"]) / "upper"}

    async def prepare_paused_state(self, handle: RuntimeHandle) -> None:
        workspace = Path(handle.data["workspace"])
        if not workspace.exists():
            # A subvolume on btrfs, as for any sandbox; its empty upper is filled by the pull.
            await checkpoint.prepare_workspace(workspace)
            self._checkpoints_dir(workspace)

    async def resume(self, handle: RuntimeHandle, spec: SandboxSpec) -> RuntimeHandle:
        with self._in_flight(handle.sandbox_id):
            return await self._resume(handle, spec)

    async def _resume(self, handle: RuntimeHandle, spec: SandboxSpec) -> RuntimeHandle:
        sid = handle.sandbox_id
        data = dict(handle.data)
        images = data.get("images")
        if not images or not Path(images).is_dir():
            raise AenvError(ErrorCode.NOT_FOUND, f"sandbox {sid}: no paused image to resume from")
        await self._require_criu()
        # Again on every resume: the workspace may have been pulled back from the repository.
        self._limit_disk(spec, data)
        if not self.cgroups.exists(sid):  # gone with a host reboot, or never on this node
            await asyncio.to_thread(checkpoint.create_cgroups, self.cgroups, sid,
                                    memory_mb=spec.memory_mb, cpu_count=spec.cpu_count,
                                    pids_max=spec.pids_max)
        slot = None
        data.pop("egress", None)  # the spec's, on the new slot (a pause cut short kept it)
        if spec.allow_internet_access:
            await self._ensure_network()
            slot = await self.network.acquire()
        try:
            if slot is not None and spec.egress is not None:
                await self._apply_egress(slot, spec.egress, data)
            with self._restoring(sid):
                result = await checkpoint.restore(
                    Path(images), workspace=Path(data["workspace"]),
                    lower=[self.driver_layer, *spec.lower_layers],
                    cgroup_dirs=checkpoint.cgroup_dirs(self.cgroups, sid),
                    envd_port=spec.envd_port, netns=slot.path if slot else None,
                    bundle=self.bundle, crash="resume:criu",
                    volumes={v.path: v.source for v in spec.volumes})
        except BaseException:
            # Whatever a failed (or killed) criu restored goes; the image stays for the
            # next try. Then the slot, which those processes were in.
            with contextlib.suppress(AenvError, OSError):
                await self.abort_resume(handle)
            if slot is not None:
                await self.network.release(slot.name)
            raise
        self.last_timings = dict(result.timings)
        self._live[sid] = LiveProcess(result.pid, result.start_time, cpu_used=0, cpu_at=time.monotonic())
        data.update(pid=result.pid, start_time=result.start_time, images=None,
                    bundle_version=result.bundle_version,
                    slot=slot.name if slot else None, address=slot.address if slot else None)
        # The image stays until the orchestrator has recorded the resume (release_paused):
        # a crash before that rolls the sandbox back to paused, from this image.
        return RuntimeHandle(self.name, sid, data)

    def release_paused(self, paused: RuntimeHandle) -> None:
        """`RecoverableDriver`: the resume of `paused` is recorded; its image can go."""
        images = paused.data.get("images")
        if images:
            self._background(asyncio.to_thread(shutil.rmtree, images, True))

    # ------------------------------------------------------------------ filesystem-only pause
    async def pause_filesystem(self, handle: RuntimeHandle) -> RuntimeHandle:
        """`FilesystemPauseDriver`: every process of the sandbox is killed, its cgroups and
        network slot go; its workspace (the writable layer) stays, synced to disk in the
        background. No CRIU: the cost is a kill, whatever the sandbox's memory."""
        sid = handle.sandbox_id
        live = self._live_of(handle)
        if not live.alive():
            raise AenvError(ErrorCode.UNAVAILABLE, f"sandbox {sid} is not running")
        data = dict(handle.data)
        t0 = time.monotonic()
        await self._stop_keeping_files(sid, data)
        self.last_timings = {"total": time.monotonic() - t0}
        self._sync_later(sid, Path(data["workspace"]))
        data.update(pid=None, start_time=None, slot=None, address=None, images=None,
                    fs_paused=f"fs-{time.time_ns()}")
        return RuntimeHandle(self.name, sid, data)

    async def _stop_keeping_files(self, sid: str, data: dict[str, Any]) -> None:
        """`_cleanup` but for the workspace: the sandbox's processes, cgroups, network slot
        and root mount go; its upper stays, ready for a new boot on it."""
        pid = data.get("pid")
        workspace = await self._stop(sid, data, int(pid) if pid else None, data.get("start_time"))
        if workspace is not None:
            # overlayfs refuses a work dir a volatile mount used: the next boot makes a new one.
            await asyncio.to_thread(shutil.rmtree, workspace / "work", True)

    async def boot_paused(self, handle: RuntimeHandle, spec: SandboxSpec) -> RuntimeHandle:
        """`FilesystemPauseDriver`: a fresh sandbox (envd as init, the template's start)
        on the paused sandbox's kept upper; a checkpoint image it has is left unused (the
        orchestrator releases it once the boot is recorded)."""
        sid = handle.sandbox_id
        workspace = Path(handle.data["workspace"])
        if not (workspace / "upper").is_dir():
            raise AenvError(ErrorCode.NOT_FOUND, f"sandbox {sid}: its writable layer is gone")
        # (a pool sandbox whose workspace could not move stays where it was made)
        spec = dataclasses.replace(spec, workspace=workspace)
        self._check_spec(spec)
        with self._in_flight(sid):
            if self.cgroups.exists(sid):  # a memory pause keeps them for its restore
                await self._stop_keeping_files(sid, dict(handle.data, slot=None, pid=None))
            else:
                await asyncio.to_thread(shutil.rmtree, workspace / "work", True)
            return await self._create(spec, keep_files=True)

    # ------------------------------------------------------------------ disk quota
    def _limit_disk(self, spec: SandboxSpec, data: dict[str, Any]) -> None:
        """The sandbox's disk size as the quota of its workspace subvolume (upper and the
        overlay's work dir): writes past it fail with EDQUOT inside the sandbox. Idempotent;
        blocking (~40 us, one ioctl). A workspace that is no subvolume (built in place after a
        failed rename) is left alone: a quota there would limit its parent subvolume."""
        if not self._disk_quota or spec.disk_size_mb is None:
            return
        workspace = data["workspace"]
        if not linux.is_subvolume(workspace):
            return
        linux.subvolume_limit(workspace, spec.disk_size_mb * 2**20)
        data["disk_size_mb"] = spec.disk_size_mb

    def _checkpoints_dir(self, workspace: Path) -> Path:
        """`<workspace>/checkpoints`, where pauses write their images: a subvolume of its
        own where quotas are on, so that a pause's memory image is not charged to the
        sandbox's disk quota (a sandbox with a full disk can still be paused). Blocking."""
        path = workspace / "checkpoints"
        if not path.exists():
            if self._disk_quota and linux.is_subvolume(str(workspace)):
                linux.subvolume_create(str(path))
            else:
                path.mkdir()
        path.chmod(0o700)  # process memory, envd's token included
        return path

    # ------------------------------------------------------------------ snapshot / copies
    async def snapshot(self, handle: RuntimeHandle, images: Path) -> dict[str, float]:
        """Checkpoint a running sandbox into `images` (memory, processes, and a copy of its
        writable layer taken while frozen); the sandbox keeps running. Returns timings."""
        sid = handle.sandbox_id
        live = self._live_of(handle)
        if not live.alive():
            raise AenvError(ErrorCode.UNAVAILABLE, f"sandbox {sid} is not running")
        await self._require_criu()
        stats = await checkpoint.dump(
            live.pid, images, freezer=self.cgroups.path("freezer", sid), leave_running=True,
            upper=Path(handle.data["workspace"]) / "upper", bundle=self.bundle,
            bundle_version=handle.data.get("bundle_version"),
            external_netns=bool(handle.data.get("slot")), crash="snapshot:criu",
            volumes=handle.data.get("volumes") or ())
        log.info("snapshot of %s: frozen %.1f ms (sealing the writable layer %.1f ms), "
                 "dump %.1f ms", sid, stats.frozen_s * 1e3, stats.copy_s * 1e3,
                 stats.total_s * 1e3)
        return {"frozen_s": stats.frozen_s, "total_s": stats.total_s,
                "image_bytes": float(stats.image_bytes)}

    async def restore(self, spec: SandboxSpec, images: Path, image_token: str | None
                      ) -> RuntimeHandle:
        """A new, independent sandbox `spec.sandbox_id` from a snapshot image: its own
        workspace (an empty upper over the image's sealed writable layer, which stays shared
        and read-only), cgroups, network namespace, hostname and envd token. `image_token` is
        the envd token inside the image."""
        with self._in_flight(spec.sandbox_id):
            return await self._restore(spec, images, image_token)

    async def _restore(self, spec: SandboxSpec, images: Path, image_token: str | None
                       ) -> RuntimeHandle:
        sid = spec.sandbox_id
        self._check_spec(spec)
        await self._require_criu()
        data: dict[str, Any] = {"pid": None, "start_time": None, "workspace": str(spec.workspace),
                                "envd_port": spec.envd_port, "slot": None, "address": None}
        try:
            await checkpoint.prepare_workspace(spec.workspace)
            self._limit_disk(spec, data)
            await asyncio.to_thread(checkpoint.create_cgroups, self.cgroups, sid,
                                    memory_mb=spec.memory_mb, cpu_count=spec.cpu_count,
                                    pids_max=spec.pids_max)
            slot = None
            if spec.allow_internet_access:
                await self._ensure_network()
                slot = await self.network.acquire()
                data.update(slot=slot.name, address=slot.address)
                if spec.egress is not None:
                    await self._apply_egress(slot, spec.egress, data)
            in_image = set(checkpoint.image_volumes(images).values())
            # The image's sealed writable layer, unless the caller already made it one of
            # the template's layers (the orchestrator moves it out of the image).
            seal = checkpoint.seal_layer(images)
            lower = [self.driver_layer, *([seal / "upper"] if seal is not None else []),
                     *spec.lower_layers]
            with self._restoring(sid):
                result = await checkpoint.restore(
                    images, workspace=spec.workspace, lower=lower,
                    cgroup_dirs=checkpoint.cgroup_dirs(self.cgroups, sid),
                    envd_port=spec.envd_port, netns=slot.path if slot else None,
                    bundle=self.bundle, volumes={v.path: v.source for v in spec.volumes})
                data.update(pid=result.pid, start_time=result.start_time,
                            bundle_version=result.bundle_version)
                live = LiveProcess(result.pid, result.start_time, cpu_used=0,
                                   cpu_at=time.monotonic())
                self._live[sid] = live
                self._set_identity(sid, live, data)
                await self._mount_volumes(spec, data, [v for v in spec.volumes
                                                       if v.path not in in_image])
                handle = RuntimeHandle(self.name, sid, data)
                await self._init_envd(handle, image_token or "", init_body(spec))
        except BaseException:
            await self._cleanup(sid, data, data.get("pid"), data.get("start_time"))
            raise
        return handle

    # ------------------------------------------------------------------ sealed layers
    def sealed_layer(self, images: Path) -> Path | None:
        return checkpoint.seal_layer(images)

    def adopt_sealed(self, sealed: Path, dest: Path) -> Path:
        layers.take_sealed(sealed, dest)
        return dest / "upper"

    def merge_layers(self, lower: Sequence[Path], dest: Path) -> None:
        layers.merge_layers(lower, dest)

    def remove_layer(self, path: Path) -> None:
        layers.remove_layer(path)

    async def destroy(self, handle: RuntimeHandle) -> None:
        pid = handle.data.get("pid")
        await self._cleanup(handle.sandbox_id, handle.data, int(pid) if pid else None,
                            start_time=handle.data.get("start_time"))

    async def _cleanup(self, sandbox_id: str, data: dict[str, Any], pid: int | None,
                       start_time: int | None = None) -> None:
        workspace = await self._stop(sandbox_id, data, pid, start_time)
        if workspace is not None:
            await asyncio.to_thread(shutil.rmtree, workspace, True)

    async def _stop(self, sandbox_id: str, data: dict[str, Any], pid: int | None,
                    start_time: int | None) -> Path | None:
        """A sandbox's processes, cgroups, network slot and root mount go (what `_cleanup`
        and a filesystem pause share); returns its workspace, left on disk."""
        live = self._live.pop(sandbox_id, None)
        if live is not None:
            live.close_netns()
        # A frozen task does not die of SIGKILL until it is thawed (a checkpoint cut short
        # leaves the cgroup frozen): thaw first, or the kill below would wait in vain.
        freezer = self.cgroups.path("freezer", sandbox_id)
        if recovery.frozen(freezer):
            recovery.thaw(freezer)
        if pid is not None:
            # The kernel then kills the init's whole pid namespace; the fork-server (or the
            # host's init) reaps it.
            await kill_and_wait(pid, start_time, "sandbox init")
        # Anything left in the sandbox's cgroup (a half-made sandbox, an escaped process).
        await self._kill_cgroup(sandbox_id)
        try:
            await asyncio.to_thread(self.cgroups.remove, sandbox_id)
        except OSError as exc:
            raise AenvError(ErrorCode.INTERNAL, f"sandbox {sandbox_id}: cgroup: {exc}") from None
        if data.get("slot"):
            await self._ensure_network()
            await self.network.release(str(data["slot"]))
        workspace = data.get("workspace")
        if not workspace:
            return None
        checkpoint.unmount_root(Path(workspace))  # a restore that crashed half-way
        return Path(workspace)

    # ------------------------------------------------------------------ crash recovery
    async def settle(self, handles: list[RuntimeHandle]) -> list[str]:
        """`RecoverableDriver`: stop what a dead server left working on these sandboxes (a
        criu dump or restore: on a sandbox's init or in its workspace), then thaw those a
        checkpoint left frozen. Their processes, if alive, run on as before. Returns the
        ids of the sandboxes it had to do something for."""
        criu = await asyncio.to_thread(recovery.criu_processes)
        settled = []
        for handle in handles:
            sid = handle.sandbox_id
            pid = handle.data.get("pid")
            workspace = handle.data.get("workspace")
            helpers = recovery.helpers_of(int(pid) if pid else None,
                                          [Path(workspace)] if workspace else [], criu)
            for helper in helpers:
                log.warning("sandbox %s: stopping criu (pid %d) left by a previous server",
                            sid, helper)
                await kill_and_wait(helper, None, "criu")
            freezer = self.cgroups.path("freezer", sid)
            thawing = recovery.frozen(freezer)
            if thawing:
                log.warning("sandbox %s: thawing it (frozen by a checkpoint a crash cut "
                            "short)", sid)
                recovery.thaw(freezer)
            if helpers or thawing:
                settled.append(sid)
        return settled

    def interrupted_pause(self, handle: RuntimeHandle) -> RuntimeHandle | None:
        """`RecoverableDriver`: for a sandbox whose pause was cut short after its processes
        were gone, the paused handle if criu finished its image (else None)."""
        workspace = handle.data.get("workspace")
        data = {k: v for k, v in handle.data.items() if k != "pausing"}
        data.update(pid=None, start_time=None, slot=None, address=None)
        if handle.data.get("pausing") == "filesystem":
            # Its processes were to go anyway: paused without memory if its files are there
            # (boot_paused cleans up what the kill left: cgroups, a mount).
            if not workspace or not (Path(workspace) / "upper").is_dir():
                return None
            data.update(images=None, fs_paused=f"fs-{time.time_ns()}")
            return RuntimeHandle(self.name, handle.sandbox_id, data)
        images = recovery.complete_pause_image(Path(workspace)) if workspace else None
        if images is None:
            return None
        data.update(images=str(images))
        return RuntimeHandle(self.name, handle.sandbox_id, data)

    async def abort_resume(self, handle: RuntimeHandle) -> None:
        """`RecoverableDriver`: undo a resume cut short (`handle` is the paused one): the
        restored or half-restored processes go, the root is unmounted; the image stays."""
        await self._kill_cgroup(handle.sandbox_id)
        workspace = handle.data.get("workspace")
        if workspace:
            await asyncio.to_thread(checkpoint.unmount_root, Path(workspace))

    async def sweep(self, known: Callable[[str], bool], idle: dict[str, RuntimeHandle],
                    workspaces: Path) -> list[str]:
        """`RecoverableDriver`: destroy sandboxes in `workspaces` that are not `known` (a
        create cut short, or a fork child whose fork never committed), delete checkpoint
        images that the records of `idle` sandboxes (no operation on them in flight) do not
        name, and network slots no process uses any more. Returns the ids destroyed."""
        orphans = await asyncio.to_thread(recovery.orphan_workspaces, workspaces, set())
        destroyed = []
        for workspace in orphans:
            sid = workspace.name
            # Asked now, not before the listing: a create may have finished meanwhile.
            if known(sid) or sid in self._creating or sid in self._live:
                continue
            log.warning("sandbox %s has no record (its create was cut short): destroying it",
                        sid)
            with contextlib.suppress(AenvError):
                await self._cleanup(sid, {"workspace": str(workspace)}, None)
                destroyed.append(sid)
        for sid, handle in idle.items():
            home = handle.data.get("workspace")
            if not home or sid in self._creating:
                continue
            current = handle.data.get("images")
            for stale in await asyncio.to_thread(recovery.stale_images, Path(home),
                                                 Path(current) if current else None):
                await asyncio.to_thread(shutil.rmtree, stale, True)
        # Slots of the sandboxes just destroyed (or of ones a crash left): the network's own
        # start collects them too, but may have looked before those processes were gone.
        with contextlib.suppress(AenvError, OSError):
            await self._ensure_network()
            await self.network.collect_abandoned()
        return destroyed

    async def _kill_cgroup(self, sandbox_id: str, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        delay = 0.001
        while True:
            pids = self.cgroups.pids(sandbox_id)
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if time.monotonic() > deadline:
                raise AenvError(ErrorCode.INTERNAL,
                                f"sandbox {sandbox_id}: processes {pids} do not die")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)


def _enable_disk_quota(path: Path) -> bool:
    """Turn on btrfs simple quotas where `path` is on btrfs; False elsewhere or where the
    kernel cannot (simple quotas need 6.7), so that sandbox disks stay unbounded."""
    if not linux.on_btrfs(str(path)):
        log.warning("%s is not on btrfs: sandbox disk sizes are not enforced", path)
        return False
    try:
        linux.btrfs_enable_simple_quota(str(path))
    except OSError as exc:
        log.warning("btrfs simple quotas unavailable (%s): sandbox disk sizes are not enforced",
                    exc)
        return False
    return True


def _oom_kills(layout: cgroups.CgroupLayout, sandbox_id: str) -> int:
    """Processes of the sandbox the OOM killer has killed (cgroup v1 `memory.oom_control`)."""
    try:
        text = layout.read("memory", sandbox_id, "memory.oom_control")
    except OSError:
        return 0
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            return int(value)
    return 0
