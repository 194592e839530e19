"""`aenv cluster up --nodes N [--listen HOST:PORT] [--home DIR]` and `aenv cluster down --home DIR`.

The whole cluster on one machine, for trying it and for tests: etcd (data in DIR/etcd), the
scheduler replicas and a gateway on loopback, and N `aenv serve --cluster` nodes, each in
- its own **network namespace** `aenvc<B>`: a veth pair `aenvc<B>` (host, 10.99.B.1/30) /
  `eth0` (node, 10.99.B.2/30), B the lowest block free on this host. A node's bridge `aenv0`,
  its nftables tables and its sandboxes' 10.88.0.0/16 are then its own, as on a machine of its
  own; it serves on 10.99.B.2:8000 and reaches etcd at 10.99.B.1.
- its own **mount namespace** (persistent: `DIR/ns/<id>.mnt`, kept across a node restart like
  a machine's mounts), a slave of the host's, with a sysfs of its network namespace on /sys
  (the node reads its bridge there) and the host's cgroup hierarchy bound back on
  /sys/fs/cgroup, where the node's cgroup parent `aenv` is the host's `aenv-<id>`: a
  sandbox that moved to another node has cgroups of the same name there, and the node it
  left must not kill them when it removes its own copy. Mounts the node makes (overlays,
  nsfs files of network slots) stay in this namespace.
- its own **home** `DIR/nodes/<id>/home`, on a btrfs loop volume mounted from the host, the
  base template's layer linked from the machine's layer cache (built once, as for tests).
All nodes share one snapshot repository (posix_fs at DIR/repository) and one API key
(`AENV_API_KEY`, else a new one). Prints the gateway URL and key, writes `DIR/cluster.json`
(every component's id, url, pid; nodes' netns), and stays in the foreground. SIGINT/SIGTERM
(or `cluster down` from another shell) stops everything: the nodes' sandboxes are removed
(a node that died is started again first, so that it removes its own), then every process,
mount, namespace and veth goes.

Owns: DIR, the `aenvc*` namespaces and veths, 10.99.0.0/16 addresses it made. Must not touch:
the host's other interfaces, addresses, routes or firewall (sandboxes of these nodes reach
nothing beyond their node: there is no NAT on the host).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from aenv.errors import AenvError, ErrorCode

NODE_PORT = 8000
STATE_FILE = "cluster.json"
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass
class Component:
    id: str
    kind: str  # etcd | scheduler | gateway | node
    url: str
    pid: int = 0
    log: str = ""
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # beyond the supervisor's environment
    netns: str | None = None
    mntns: str | None = None
    home: str | None = None
    address: str | None = None
    host_veth: str | None = None


@dataclass
class ClusterState:
    home: str
    api_key: str
    supervisor: int
    gateway_url: str = ""
    etcd_url: str = ""
    ready: bool = False
    components: list[Component] = field(default_factory=list)

    def path(self) -> Path:
        return Path(self.home) / STATE_FILE

    def save(self) -> None:
        tmp = self.path().with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(self), f, indent=2)
        os.replace(tmp, self.path())

    @classmethod
    def load(cls, home: Path) -> ClusterState:
        raw = json.loads((home / STATE_FILE).read_text())
        comps = [Component(**c) for c in raw.pop("components", [])]
        return cls(**raw, components=comps)

    def of(self, kind: str) -> list[Component]:
        return [c for c in self.components if c.kind == kind]


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise AenvError(ErrorCode.INTERNAL, f"{' '.join(argv)}: {proc.stderr.strip()}")
    return proc


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].startswith("Z"):
            return False  # a zombie of ours: exited
    return True


def _mounted(path: Path | str) -> bool:
    """Whether something is mounted on `path` (os.path.ismount misses a bind mount of a
    directory on its own filesystem)."""
    target = str(Path(path).resolve())
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == target for line in f)


def _free_port() -> int:
    from aenv.devserver import free_port

    return free_port()


def _get(url: str, timeout: float = 2.0) -> int:
    try:
        with _NO_PROXY.open(url, timeout=timeout) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return 0


def _wait_healthy(comp: Component, proc: subprocess.Popen[bytes] | None, path: str,
                  timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AenvError(ErrorCode.UNAVAILABLE,
                            f"{comp.kind} {comp.id} exited with {proc.returncode}; see {comp.log}")
        if _get(comp.url + path) in (200, 204):
            return
        time.sleep(0.1)
    raise AenvError(ErrorCode.TIMEOUT, f"{comp.kind} {comp.id} not ready after {timeout_s:.0f} s; "
                    f"see {comp.log}")


def _start(comp: Component) -> subprocess.Popen[bytes]:
    with open(comp.log, "ab") as out:
        proc = subprocess.Popen(comp.argv, env={**os.environ, **comp.env}, stdout=out,
                                stderr=out, stdin=subprocess.DEVNULL, start_new_session=True)
    comp.pid = proc.pid
    return proc


def _stop(pid: int, timeout_s: float = 20.0) -> None:
    if not _alive(pid):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while _alive(pid) and time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        time.sleep(0.05)
    if _alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


# ---------------------------------------------------------------------- namespaces
def _free_block() -> int:
    used = _run("ip", "-4", "-o", "addr", "show").stdout
    names = set(os.listdir("/sys/class/net"))
    netns = set(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else set()
    for block in range(256):
        if f"aenvc{block}" not in names and f"aenvc{block}" not in netns and \
                f" 10.99.{block}." not in used:
            return block
    raise AenvError(ErrorCode.RESOURCE_EXHAUSTED, "no free 10.99.<B>.0/30 block on this host")


def _make_netns(block: int) -> tuple[str, str, str, str]:
    """(netns, host veth, host address, node address) for `block`."""
    name = f"aenvc{block}"
    host_addr, node_addr = f"10.99.{block}.1", f"10.99.{block}.2"
    _run("ip", "netns", "add", name)
    try:
        _run("ip", "link", "add", name, "type", "veth", "peer", "name", f"{name}n")
        _run("ip", "link", "set", f"{name}n", "netns", name)
        _run("ip", "-n", name, "link", "set", f"{name}n", "name", "eth0")
        _run("ip", "-n", name, "addr", "add", f"{node_addr}/30", "dev", "eth0")
        _run("ip", "-n", name, "link", "set", "eth0", "up")
        _run("ip", "-n", name, "link", "set", "lo", "up")
        _run("ip", "-n", name, "route", "add", "default", "via", host_addr)
        _run("ip", "addr", "add", f"{host_addr}/30", "dev", name)
        _run("ip", "link", "set", name, "up")
    except AenvError:
        _run("ip", "link", "del", name, check=False)
        _run("ip", "netns", "del", name, check=False)
        raise
    return name, name, host_addr, node_addr


def _private_dir(path: Path) -> None:
    """A bind mount of `path` on itself with private propagation: mount namespace files
    can be bound there (a shared mount would propagate them into their own namespace)."""
    path.mkdir(parents=True, exist_ok=True)
    if not _mounted(path):
        _run("mount", "--bind", str(path), str(path))
    _run("mount", "--make-private", str(path))


def _cgroup_dirs(node_id: str) -> list[tuple[Path, Path]]:
    """(the node's own cgroup parent on the host, where the node sees it) per controller."""
    from aenv.runtime.container.cgroups import CGROUP_ROOT, CONTROLLERS

    return [(CGROUP_ROOT / ctrl / f"aenv-{node_id}", CGROUP_ROOT / ctrl / "aenv")
            for ctrl in CONTROLLERS]


def _make_mntns(netns: str, file: Path, node_id: str) -> None:
    """The node's mount namespace: sysfs of its netns; the host's cgroups, with the node's
    cgroup parent `aenv` bound to `aenv-<node>` on the host, so that nodes sharing this host
    never touch each other's sandboxes' cgroups (a sandbox id moves between nodes); a
    tmpfs of its own for its network slots' files (another node would take them for
    abandoned ones of a dead server and delete them)."""
    file.touch()
    stash = file.with_suffix(".cg")
    binds = []
    for own, seen in _cgroup_dirs(node_id):
        own.mkdir(exist_ok=True)
        seen.mkdir(exist_ok=True)
        binds.append(f"mount --bind {own} {seen}")
    from aenv.runtime.container.network import NETNS_DIR

    NETNS_DIR.mkdir(parents=True, exist_ok=True)
    script = (f"set -e; mkdir -p {stash}; mount --rbind /sys/fs/cgroup {stash}; "
              "umount -l /sys; mount -t sysfs -o nosuid,nodev,noexec sysfs /sys; "
              f"mount --rbind {stash} /sys/fs/cgroup; umount -l {stash}; rmdir {stash}; "
              # the node's network slots (netns files) are its own, like its netns
              f"mount -t tmpfs -o mode=0755,nosuid,nodev,noexec tmpfs {NETNS_DIR}; "
              + "; ".join(binds))
    _run("nsenter", f"--net=/run/netns/{netns}", "--", "unshare", f"--mount={file}",
         "--propagation", "slave", "--", "sh", "-c", script)


def _prepare_home(home: Path) -> None:
    from aenv.devserver import base_layer, layer_cache
    from aenv.storage.volume import btrfs_available, mount_btrfs_volume

    base = base_layer()
    home.mkdir(parents=True, exist_ok=True)
    if btrfs_available() and not _mounted(home):
        mount_btrfs_volume(home)
    (home / "layers").mkdir(exist_ok=True)
    link = home / "layers" / base.name
    if not link.exists():
        link.symlink_to(base)
    wheelhouse = layer_cache().parent / "cache" / "wheelhouse"
    wheelhouse.mkdir(parents=True, exist_ok=True)
    (home / "cache").mkdir(exist_ok=True)
    if not (home / "cache" / "wheelhouse").exists():
        (home / "cache" / "wheelhouse").symlink_to(wheelhouse)


# ---------------------------------------------------------------------- up
def _node_env(index: int, state: ClusterState, repository: Path) -> dict[str, str]:
    env = {"AENV_API_KEY": state.api_key, "AENV_SNAPSHOT_BACKEND": "posix_fs",
           "AENV_SNAPSHOT_PATH": str(repository)}
    env["AENV_SANDBOX_CODE_INTERPRETER_PREBUILD"] = os.environ.get(
        "AENV_SANDBOX_CODE_INTERPRETER_PREBUILD", "0")
    # One repository, several writers: only one node collects its garbage.
    env["AENV_SNAPSHOT_GC_INTERVAL_S"] = (os.environ.get("AENV_SNAPSHOT_GC_INTERVAL_S", "600")
                                          if index == 0 else "0")
    return env


def cluster_up(nodes: int, listen: str, home: str, schedulers: int = 2) -> int:
    if os.geteuid() != 0:
        raise AenvError(ErrorCode.INVALID_ARGUMENT, "`aenv cluster up` needs root "
                        "(network and mount namespaces, and the nodes' own needs)")
    if nodes < 1 or schedulers < 1:
        raise AenvError(ErrorCode.INVALID_ARGUMENT, "--nodes and --schedulers must be >= 1")
    for tool in ("etcd", "nsenter", "unshare", "ip"):
        if shutil.which(tool) is None:
            raise AenvError(ErrorCode.UNAVAILABLE, f"{tool} is not installed (make install)")
    root = Path(home).resolve()
    root.mkdir(parents=True, exist_ok=True)
    if (root / STATE_FILE).exists():
        old = ClusterState.load(root)
        if _alive(old.supervisor):
            raise AenvError(ErrorCode.CONFLICT, f"a cluster is already up in {root} "
                            f"(pid {old.supervisor}); `aenv cluster down --home {root}`")
        teardown(old)
    _remove_data(root)  # of a cluster whose supervisor was killed before its clean-up
    state = ClusterState(home=str(root), supervisor=os.getpid(),
                         api_key=os.environ.get("AENV_API_KEY") or "aenv_" + secrets.token_hex(16))
    stop = {"signal": 0}

    def on_signal(signum: int, _: Any) -> None:
        stop["signal"] = signum

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    (root / "logs").mkdir(exist_ok=True)
    try:
        _bring_up(state, root, nodes, listen, schedulers, stop)
        print(f"aenv: cluster of {nodes} nodes is up", file=sys.stderr)
        print(f"  E2B_API_URL=E2B_SANDBOX_URL={state.gateway_url}")
        print(f"  E2B_API_KEY={state.api_key}", flush=True)
        while not stop["signal"]:
            time.sleep(0.2)
            for comp in state.components:  # reap what exits (a killed component stays dead)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(comp.pid, os.WNOHANG)
    except AenvError as exc:
        print(f"aenv: cluster up failed: {exc.message}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        teardown(state)
    return 0


def _bring_up(state: ClusterState, root: Path, nodes: int, listen: str, schedulers: int,
              stop: dict[str, int]) -> None:
    ns_dir = root / "ns"
    _private_dir(ns_dir)
    repository = root / "repository"
    repository.mkdir(exist_ok=True)
    node_comps: list[Component] = []
    for index in range(nodes):
        node_id = f"n{index}"
        block = _free_block()
        netns, veth, _, addr = _make_netns(block)
        comp = Component(id=node_id, kind="node", url=f"http://{addr}:{NODE_PORT}",
                         netns=netns, host_veth=veth, address=addr,
                         mntns=str(ns_dir / f"{node_id}.mnt"),
                         home=str(root / "nodes" / node_id / "home"),
                         log=str(root / "logs" / f"{node_id}.log"))
        state.components.append(comp)
        state.save()
        # The home first: the host's mounts propagate to no namespace made before them
        # (a host whose / is private, as in containers).
        _prepare_home(Path(comp.home or ""))
        _make_mntns(netns, Path(comp.mntns or ""), node_id)
        node_comps.append(comp)
    # etcd on loopback and on the host side of every node's veth.
    port, peer = _free_port(), _free_port()
    client_urls = [f"http://127.0.0.1:{port}"] + [
        f"http://{str(c.address).rsplit('.', 1)[0]}.1:{port}" for c in node_comps]
    etcd = Component(id="etcd", kind="etcd", url=f"http://127.0.0.1:{port}",
                     log=str(root / "logs" / "etcd.log"),
                     argv=["etcd", "--name", "aenv", "--data-dir", str(root / "etcd"),
                           "--listen-client-urls", ",".join(client_urls),
                           "--advertise-client-urls", f"http://127.0.0.1:{port}",
                           "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                           "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                           "--initial-cluster", f"aenv=http://127.0.0.1:{peer}"])
    state.components.append(etcd)
    state.etcd_url = etcd.url
    procs = {etcd.id: _start(etcd)}
    state.save()
    _wait_healthy(etcd, procs[etcd.id], "/health", 30)
    py = [sys.executable, "-m", "aenv.cli.main"]
    for index in range(schedulers):
        sport = _free_port()
        comp = Component(id=f"scheduler{index}", kind="scheduler",
                         url=f"http://127.0.0.1:{sport}",
                         log=str(root / "logs" / f"scheduler{index}.log"),
                         argv=[*py, "scheduler", "--etcd", etcd.url, "--listen",
                               f"127.0.0.1:{sport}"], env={"AENV_API_KEY": state.api_key})
        state.components.append(comp)
        procs[comp.id] = _start(comp)
    for index, comp in enumerate(node_comps):
        host_side = str(comp.address).rsplit(".", 1)[0] + ".1"
        comp.env = _node_env(index, state, repository)
        comp.argv = ["nsenter", f"--mount={comp.mntns}", f"--net=/run/netns/{comp.netns}",
                     f"--wd={comp.home}", "--", *py, "serve",
                     "--listen", f"{comp.address}:{NODE_PORT}", "--home", str(comp.home),
                     "--cluster", f"http://{host_side}:{port}", "--advertise", comp.url,
                     "--node-id", comp.id]
        # One at a time: servers starting together on one host race in the runtime
        # bundle's refresh (pybundle._archive: both archive the same version).
        procs[comp.id] = _start(comp)
        _wait_healthy(comp, procs[comp.id], "/health", 900)
    gw = Component(id="gateway", kind="gateway", url=f"http://{listen}",
                   log=str(root / "logs" / "gateway.log"),
                   argv=[*py, "gateway", "--etcd", etcd.url, "--listen", listen],
                   env={"AENV_API_KEY": state.api_key})
    state.components.append(gw)
    state.gateway_url = gw.url
    procs[gw.id] = _start(gw)
    state.save()
    for comp in state.components:
        if stop["signal"]:
            raise AenvError(ErrorCode.UNAVAILABLE, "interrupted")
        if comp.kind != "etcd":
            _wait_healthy(comp, procs.get(comp.id), "/health",
                          900 if comp.kind == "node" else 60)
    _wait_registered(state, len(node_comps))
    state.ready = True
    state.save()


def _wait_registered(state: ClusterState, nodes: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        req = urllib.request.Request(state.gateway_url + "/nodes",
                                     headers={"X-API-Key": state.api_key})
        with contextlib.suppress(urllib.error.URLError, OSError, ValueError), \
                _NO_PROXY.open(req, timeout=2) as resp:
            views = json.loads(resp.read())
            if sum(1 for v in views if v.get("status") == "ready") >= nodes:
                return
        time.sleep(0.2)
    raise AenvError(ErrorCode.TIMEOUT, f"not all {nodes} nodes registered in {timeout_s:.0f} s")


# ---------------------------------------------------------------------- down
def _remove_sandboxes(node: Component, api_key: str) -> None:
    import httpx

    with contextlib.suppress(httpx.HTTPError, ValueError), httpx.Client(
            base_url=node.url, headers={"X-API-Key": api_key}, timeout=60,
            trust_env=False) as http:
        for sbx in http.get("/v2/sandboxes", params={"limit": 1000}).json():
            http.delete(f"/sandboxes/{sbx['sandboxID']}")


def _stop_node(node: Component, api_key: str, was_up: bool) -> None:
    if was_up and not _alive(node.pid) and node.argv and node.mntns and \
            os.path.exists(node.mntns):
        # Dead (killed): start it again, so that it removes its own sandboxes.
        proc = _start(node)
        try:
            _wait_healthy(node, proc, "/health", 120)
        except AenvError as exc:
            print(f"aenv: node {node.id} did not come back for its clean-up: {exc.message}",
                  file=sys.stderr)
    if _alive(node.pid):
        _remove_sandboxes(node, api_key)
    _stop(node.pid, 30)


def _netns_pids(netns: str) -> list[int]:
    proc = _run("ip", "netns", "pids", netns, check=False)
    return [int(p) for p in proc.stdout.split() if p.isdigit()]


def _remove_cgroup_tree(root: Path) -> None:
    """Kill what is left in a node's own cgroup tree (a sandbox its node did not remove:
    killed with it, or orphaned), then rmdir it, deepest first."""
    if not root.is_dir():
        return
    dirs = sorted((Path(d) for d, _, _ in os.walk(root)), key=lambda p: len(p.parts),
                  reverse=True)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pids = {int(p) for d in dirs if (d / "cgroup.procs").exists()
                for p in (d / "cgroup.procs").read_text().split()}
        if not pids:
            break
        print(f"aenv: {root}: killing {len(pids)} processes left behind", file=sys.stderr)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    for path in dirs:
        try:
            path.rmdir()
        except OSError as exc:
            print(f"aenv: cgroup {path} stays: {exc.strerror}", file=sys.stderr)


def teardown(state: ClusterState) -> None:
    """Stop everything `state` lists and remove what it made. Idempotent."""
    for comp in state.of("gateway") + state.of("scheduler"):
        _stop(comp.pid, 10)
    for node in state.of("node"):
        _stop_node(node, state.api_key, state.ready)
    for comp in state.of("etcd"):
        _stop(comp.pid, 10)
    for node in state.of("node"):
        if node.netns and os.path.exists(f"/run/netns/{node.netns}"):
            for pid in _netns_pids(node.netns):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if node.mntns and os.path.exists(node.mntns):
            _run("umount", "-l", node.mntns, check=False)
        if node.netns:
            _run("ip", "netns", "del", node.netns, check=False)
        if node.host_veth and os.path.exists(f"/sys/class/net/{node.host_veth}"):
            _run("ip", "link", "del", node.host_veth, check=False)
        for own, _ in _cgroup_dirs(node.id):
            _remove_cgroup_tree(own)
        if node.home and _mounted(node.home):
            _run("umount", node.home, check=False)
            if _mounted(node.home):
                _run("umount", "-l", node.home, check=False)
    root = Path(state.home)
    if _mounted(root / "ns"):
        _run("umount", "-l", str(root / "ns"), check=False)
    _remove_data(root)
    with contextlib.suppress(FileNotFoundError):
        state.path().unlink()


def _remove_data(root: Path) -> None:
    """What a cluster kept in `root` (the next `up` starts afresh); the logs stay."""
    for name in ("etcd", "repository", "nodes", "ns"):
        path = root / name
        if path.exists() and not any(_mounted(p) for p in (path, *path.glob("*/home"))):
            shutil.rmtree(path, ignore_errors=True)


def cluster_down(home: str) -> int:
    root = Path(home).resolve()
    if not (root / STATE_FILE).exists():
        print(f"aenv: no cluster in {root}", file=sys.stderr)
        return 1
    state = ClusterState.load(root)
    if _alive(state.supervisor) and state.supervisor != os.getpid():
        os.kill(state.supervisor, signal.SIGTERM)
        deadline = time.monotonic() + 300
        while _alive(state.supervisor) and time.monotonic() < deadline:
            time.sleep(0.2)
        if not _alive(state.supervisor):
            return 0
        print("aenv: the cluster's supervisor did not stop; cleaning up here", file=sys.stderr)
        with contextlib.suppress(ProcessLookupError):
            os.kill(state.supervisor, signal.SIGKILL)
    teardown(state)
    return 0
