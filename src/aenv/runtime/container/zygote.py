"""The container fork-server ("zygote") and the in-sandbox setup of each forked child.

A long-lived process on the bundled runtime python (`aenv.runtime.pybundle`), started by the
container driver. It imports envd once (`aenv.envd.server.preload()`, then `gc.freeze()`) and
forks sandboxes from that warm interpreter: create latency stays in milliseconds and forked
envds share the interpreter's pages (small idle memory per sandbox).

Each child is forked into a fresh pid namespace (the zygote unshares CLONE_NEWPID for its
next child only, then setns()es back), so the child is directly pid 1 of its sandbox and our
own child: no intermediate process. Children are made ahead of time ("warm"): while idle the
zygote keeps `warm` children that already did everything not specific to a sandbox (closed
inherited fds, made and joined a cgroup set `warm-<zygote pid>-<n>` with the device rules,
unshared mount/uts/ipc/cgroup namespaces, cloned the bundle mount). A request hands one of
them its spec; the child renames its cgroups to the sandbox id, sets the limits, joins its
network namespace, mounts the overlay root, pivot_roots, mounts /dev, /proc, /sys and the
bundle, opens envd's listen socket, reports ready and becomes envd. With no warm child left
the same happens in a freshly forked one.

Protocol with the driver (control socket; one JSON object per line):
    driver -> zygote: {"op": "configure", "warm": N, "cgroups": {...}}   first, once
                      {"op": "spawn", "id": N, "spec": {...}}           (see ContainerDriver)
    zygote -> driver: {"event": "hello", "pid": P}                     after preload
                      {"id": N, "ok": true, "pid": HOSTPID, "start_time": TICKS, "t": {...}}
                      {"id": N, "ok": false, "error": "...", "pid": HOSTPID | null}
With each child the zygote talks over a socketpair: the spec goes down, ready/error comes up.
The zygote exits when the control socket closes (the server went away); warm children exit
with it, sandboxes (already envd) keep running and are re-parented to the host's init.

Owns: the namespaces, mounts and cgroup membership of each sandbox it forks.
Must not touch: the host's mounts (every mount happens in the child's private mount
namespace), host files other than the sandbox workspace and its cgroup directories.
STDLIB ONLY: this file is copied into the runtime bundle (it never runs on the host venv).
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import resource
import selectors
import signal
import socket
import stat
import sys
import time
import traceback
from typing import Any

from aenv.runtime.container import linux

# Capabilities kept in the bounding set for everything a sandbox executes: Docker's default
# set. Notably absent: SYS_ADMIN (mount, ...), NET_ADMIN, SYS_MODULE, SYS_PTRACE, SYS_RAWIO.
KEEP_CAPS = {0, 1, 3, 4, 5, 6, 7, 8, 10, 13, 18, 27, 29, 31}

_DEVICES = (  # name, major, minor (char devices created in the sandbox's /dev tmpfs)
    ("null", 1, 3), ("zero", 1, 5), ("full", 1, 7), ("random", 1, 8), ("urandom", 1, 9),
    ("tty", 5, 0),
)
_DEV_LINKS = (("ptmx", "pts/ptmx"), ("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
              ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2"),
              ("core", "/proc/kcore"))
# Host-wide knobs in /proc that root inside a sandbox must not write (sysrq, sysctl, ...).
_PROC_READONLY = ("bus", "fs", "irq", "sys", "sysrq-trigger")
# Host information in /proc and /sys nobody inside needs: hidden behind /dev/null or tmpfs.
_PROC_MASKED_FILES = ("kcore", "keys", "latency_stats", "timer_list", "sched_debug")
_MASKED_DIRS = ("/proc/acpi", "/proc/scsi", "/sys/firmware")

SANDBOX_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# A small tmpfs inside the sandbox for envd's log: nothing on the host disk is created per
# sandbox for it (the mountpoint comes from the driver's own lower layer), and the host reads
# it through /proc/<init pid>/root/run/aenv/envd.log.
RUN_DIR = "/run/aenv"
ENVD_LOG = RUN_DIR + "/envd.log"


def _now() -> float:
    return time.monotonic()  # CLOCK_MONOTONIC is system-wide: comparable across processes


def _send_line(fd: int, msg: dict[str, Any]) -> None:
    """Write one JSON line on a blocking or non-blocking stream fd, completely."""
    view = memoryview((json.dumps(msg) + "\n").encode())
    while view:
        try:
            n = os.write(fd, view)
        except BlockingIOError:
            time.sleep(0.001)  # a full socket buffer: the reader is busy, not gone
            continue
        view = view[n:]


def _read_line(fd: int) -> bytes:
    """Blocking read of one line (the spec); b"" when the other end closed first."""
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b""
        buf += chunk
    return buf


# ---------------------------------------------------------------------------------------
# In the children


class _Laps:
    """Wall-clock checkpoints of one child's setup, reported to the driver for benchmarks,
    with the CPU time and page faults spent since the start."""

    def __init__(self) -> None:
        self.marks: list[tuple[str, float]] = [("start", _now())]
        ru = resource.getrusage(resource.RUSAGE_SELF)
        self.cpu0 = ru.ru_utime + ru.ru_stime
        self.flt0 = ru.ru_minflt

    def __call__(self, name: str) -> None:
        self.marks.append((name, _now()))

    def report(self) -> dict[str, float]:
        out = {name: round(t - self.marks[i][1], 6)
               for i, (name, t) in enumerate(self.marks[1:])}
        ru = resource.getrusage(resource.RUSAGE_SELF)
        out["cpu"] = round(ru.ru_utime + ru.ru_stime - self.cpu0, 6)
        out["minflt"] = ru.ru_minflt - self.flt0
        return out


def _write_to(path: str, value: str, required: bool = True) -> None:
    try:
        fd = os.open(path, os.O_WRONLY)
    except FileNotFoundError:
        if required:
            raise
        return
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _prepare(cfg: dict[str, Any], name: str) -> int:
    """Everything not specific to a sandbox; done ahead of time by warm children.
    Returns an fd holding a detached read-only clone of the bundle mount."""
    os.umask(0o022)
    os.setsid()
    cg = cfg["cgroups"]
    paths = [os.path.join(cg["root"], ctrl, cg["parent"], name) for ctrl in cg["controllers"]]
    for ctrl, path in zip(cg["controllers"], paths):
        os.mkdir(path, 0o755)
        for file, value, required in cg["static"].get(ctrl, ()):
            _write_to(os.path.join(path, file), value, required)
    # "0" written to `tasks` moves just the calling thread (we are single-threaded): the
    # kernel then skips the global threadgroup rwsem, ~0.3 ms for all controllers instead of
    # an RCU grace period (~7 ms) per write to cgroup.procs.
    for path in paths:
        _write_to(os.path.join(path, "tasks"), "0")
    # The cgroup namespace's root is this (soon renamed) cgroup set. A fresh network
    # namespace too: creating one takes the kernel's rtnl lock, so a burst of creates would
    # queue on it (~4 ms each); a sandbox with internet access trades it for its slot.
    linux.unshare(linux.CLONE_NEWCGROUP | linux.CLONE_NEWNS | linux.CLONE_NEWUTS
                  | linux.CLONE_NEWIPC | linux.CLONE_NEWNET)
    linux.interface_up("lo")
    # Nothing mounted from here on may propagate back to the host.
    linux.mount(None, "/", None, linux.MS_REC | linux.MS_PRIVATE)
    # A detached, read-only clone of the bundle, moved into place after pivot_root: every
    # mount happens after pivot_root, so a template's symlinks (/opt -> /, ...) resolve inside
    # the sandbox root and can never redirect a mount or a write onto the host.
    bundle_fd = linux.open_tree(cfg["bundle"], linux.OPEN_TREE_CLONE | linux.OPEN_TREE_CLOEXEC
                                | linux.AT_RECURSIVE)
    linux.mount_setattr_fd(bundle_fd, linux.MOUNT_ATTR_RDONLY | linux.MOUNT_ATTR_NOSUID
                           | linux.MOUNT_ATTR_NODEV)
    return bundle_fd


def _mkdirs(path: str, mode: int = 0o755) -> None:
    try:
        os.makedirs(path, mode, exist_ok=True)
    except FileExistsError:
        pass  # exists as a non-directory (e.g. a dangling symlink); mount will tell


def _bind_readonly(path: str) -> None:
    linux.mount(path, path, None, linux.MS_BIND | linux.MS_REC)
    linux.mount(path, path, None,
                linux.MS_BIND | linux.MS_REMOUNT | linux.MS_RDONLY | linux.MS_NOSUID
                | linux.MS_NODEV | linux.MS_NOEXEC)


def _setup_dev(shm_size_mb: int) -> None:
    _mkdirs("/dev")
    linux.mount("tmpfs", "/dev", "tmpfs", linux.MS_NOSUID, "mode=755,size=65536k")
    old = os.umask(0)
    try:
        for name, major, minor in _DEVICES:
            os.mknod(f"/dev/{name}", 0o666 | stat.S_IFCHR, os.makedev(major, minor))
    finally:
        os.umask(old)
    for name, target in _DEV_LINKS:
        os.symlink(target, f"/dev/{name}")
    os.mkdir("/dev/pts", 0o755)
    linux.mount("devpts", "/dev/pts", "devpts", linux.MS_NOSUID | linux.MS_NOEXEC,
                "newinstance,ptmxmode=0666,mode=0620,gid=5")
    os.mkdir("/dev/shm", 0o1777)
    linux.mount("shm", "/dev/shm", "tmpfs", linux.MS_NOSUID | linux.MS_NODEV,
                f"mode=1777,size={max(shm_size_mb, 1)}m")


def _setup_proc_sys() -> None:
    _mkdirs("/proc", 0o555)
    linux.mount("proc", "/proc", "proc", linux.MS_NOSUID | linux.MS_NODEV | linux.MS_NOEXEC)
    _mkdirs("/sys", 0o555)
    linux.mount("sysfs", "/sys", "sysfs",
                linux.MS_RDONLY | linux.MS_NOSUID | linux.MS_NODEV | linux.MS_NOEXEC)
    for name in _PROC_READONLY:
        if os.path.exists(f"/proc/{name}"):
            _bind_readonly(f"/proc/{name}")
    for name in _PROC_MASKED_FILES:
        if os.path.exists(f"/proc/{name}"):
            linux.mount("/dev/null", f"/proc/{name}", None, linux.MS_BIND)
    for path in _MASKED_DIRS:
        if os.path.isdir(path):
            linux.mount("tmpfs", path, "tmpfs", linux.MS_RDONLY, "size=0")


def _write_file(path: str, content: str) -> None:
    try:
        if os.path.islink(path) or os.path.isdir(path):
            return  # leave a template's deliberate layout alone
        _mkdirs(os.path.dirname(path))
        with open(path, "w") as f:
            f.write(content)
    except OSError:
        pass  # cosmetic files; the sandbox works without them


def _become_sandbox(cfg: dict[str, Any], name: str, spec: dict[str, Any], chan: int,
                    bundle_fd: int, laps: _Laps) -> socket.socket:
    """The sandbox-specific part of the setup, in the child. Returns envd's listen socket."""
    cg = cfg["cgroups"]
    sid = spec["sandbox_id"]
    for ctrl in cg["controllers"]:
        base = os.path.join(cg["root"], ctrl, cg["parent"])
        os.rename(os.path.join(base, name), os.path.join(base, sid))  # v1 allows renames
        for file, value, required in spec["cgroup_limits"].get(ctrl, ()):
            _write_to(os.path.join(base, sid, file), value, required)
    laps("cgroups")
    if spec.get("netns"):
        # A pre-made network slot (veth to the host bridge): join it instead of a new one.
        fd = os.open(spec["netns"], os.O_RDONLY | os.O_CLOEXEC)
        try:
            linux.setns(fd, linux.CLONE_NEWNET)
        finally:
            os.close(fd)
    laps("netns")
    ws = spec["workspace"]
    upper, work = os.path.join(ws, "upper"), os.path.join(ws, "work")
    for d in (upper, work):
        os.makedirs(d, 0o755, exist_ok=True)
    # Mounted over the workspace directory itself: any directory of our private mount
    # namespace will do as the future root, and this one costs no extra inode.
    lower = ":".join(spec["lower"])
    linux.mount("overlay", ws, "overlay", 0, f"lowerdir={lower},upperdir={upper},workdir={work}")
    laps("overlay")
    os.chdir(ws)
    linux.pivot_root(".", ".")
    linux.umount2(".", linux.MNT_DETACH)  # the host root, stacked on top by pivot_root
    os.chdir("/")
    laps("pivot")
    _setup_dev(int(spec["memory_mb"]))
    _setup_proc_sys()
    _mkdirs(cfg["bundle"])  # normally present in the driver's layer: no copy-up
    linux.move_mount_fd(bundle_fd, cfg["bundle"])
    os.close(bundle_fd)
    laps("mounts")
    linux.sethostname(spec["hostname"])
    _write_file("/etc/hostname", spec["hostname"] + "\n")
    _write_file("/etc/hosts", spec["hosts"])
    if spec.get("resolv_conf"):
        _write_file("/etc/resolv.conf", spec["resolv_conf"])
    laps("etc")
    linux.drop_bounding_caps(KEEP_CAPS)
    # stdio: /dev/null in, envd's log out. Both live inside the sandbox, so a checkpoint
    # (CRIU) finds them at the same paths.
    null = os.open("/dev/null", os.O_RDWR)
    os.dup2(null, 0)
    try:
        _mkdirs(RUN_DIR, 0o700)
        linux.mount("tmpfs", RUN_DIR, "tmpfs", linux.MS_NOSUID | linux.MS_NODEV
                    | linux.MS_NOEXEC, "mode=0700,size=8m")
        log = os.open(ENVD_LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    except OSError:
        log = null
    os.dup2(log, 1)
    os.dup2(log, 2)
    listen = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listen.bind((spec["envd"]["host"], int(spec["envd"]["port"])))
    listen.listen(4096)
    # Every other fd goes: CRIU refuses to dump fds it cannot account for.
    linux.close_fds_except({chan, listen.fileno()})
    laps("listen")
    return listen


def _child(cfg: dict[str, Any], name: str, chan: int, spec_line: bytes | None) -> None:
    """Body of every forked child. Never returns."""
    code = 1
    try:
        laps = _Laps()
        linux.close_fds_except({chan})
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.set_blocking(chan, True)
        bundle_fd = _prepare(cfg, name)
        laps("prepare")
        if spec_line is None:
            spec_line = _read_line(chan)  # warm: wait here until a request comes
            if not spec_line:
                code = 0
                return  # the zygote went away
            laps = _Laps()  # time the request, not the idle wait
        spec = json.loads(spec_line)
        listen = _become_sandbox(cfg, name, spec, chan, bundle_fd, laps)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        os.environ.clear()
        os.environ.update({"PATH": SANDBOX_PATH, "HOME": "/root"})
        settings = _settings_cls(**spec["envd"])
        # The kernel queues connections on a listening socket, so envd is reachable now,
        # even though its event loop starts a few milliseconds later.
        _send_line(chan, {"ready": True, "t0": laps.marks[0][1], "laps": laps.report()})
        os.close(chan)
        linux.set_comm("envd")
        _envd_run(settings, listen_socket=listen)
        code = 0
    except BaseException as exc:  # noqa: BLE001 - report anything to the zygote
        try:
            tb = traceback.format_exception_only(type(exc), exc)[-1].strip()
            _send_line(chan, {"error": f"sandbox setup: {tb}"})
        except OSError:
            traceback.print_exc()
    finally:
        os._exit(code)


# ---------------------------------------------------------------------------------------
# The fork-server

_settings_cls: Any = None
_envd_run: Any = None


class _Kid:
    """A forked child, warm (no spec yet) or working on a request."""

    __slots__ = ("pid", "start_time", "chan", "buf", "req_id", "t0", "times")

    def __init__(self, pid: int, chan: int) -> None:
        self.pid = pid
        self.start_time = linux.proc_start_time(pid)
        self.chan = chan
        self.buf = b""
        self.req_id: int | None = None
        self.t0 = 0.0
        self.times: dict[str, float] = {}


class Zygote:
    def __init__(self, ctl: int) -> None:
        self.ctl = ctl
        self.cfg: dict[str, Any] = {}
        self.warm_target = 0
        self.warm: list[_Kid] = []
        self.busy: dict[int, _Kid] = {}  # chan -> kid with a request
        self.by_chan: dict[int, _Kid] = {}
        self.sel = selectors.DefaultSelector()
        self.own_pidns = os.open("/proc/self/ns/pid", os.O_RDONLY)
        self.counter = 0
        self.failures = 0  # consecutive warm children that died before their request
        self.last_error = ""

    def fork(self, spec_line: bytes | None) -> _Kid:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.counter += 1
        name = f"warm-{os.getpid()}-{self.counter}"
        # unshare(CLONE_NEWPID) only affects children: the next fork is pid 1 of a fresh pid
        # namespace and our direct child (we reap it). setns() to our own pid namespace
        # re-arms this for the next fork.
        linux.unshare(linux.CLONE_NEWPID)
        pid = -1
        try:
            pid = os.fork()
            if pid == 0:
                chan = theirs.detach()
                _child(self.cfg, name, chan, spec_line)  # never returns
        finally:
            if pid != 0:
                linux.setns(self.own_pidns, linux.CLONE_NEWPID)
        theirs.close()
        chan = ours.detach()
        os.set_blocking(chan, False)
        kid = _Kid(pid, chan)
        self.by_chan[chan] = kid
        self.sel.register(chan, selectors.EVENT_READ, None)
        return kid

    def drop(self, kid: _Kid) -> None:
        self.sel.unregister(kid.chan)
        os.close(kid.chan)
        self.by_chan.pop(kid.chan, None)
        self.busy.pop(kid.chan, None)
        if kid in self.warm:
            self.warm.remove(kid)

    def spawn(self, req_id: int, spec: dict[str, Any]) -> None:
        t0 = _now()
        if spec.get("netns"):
            # Warm children copied the host's mounts before this slot's nsfs bind mount
            # existed: let them open it through our (the host's) mount namespace.
            spec["netns"] = f"/proc/{os.getpid()}/root{spec['netns']}"
        line = (json.dumps(spec) + "\n").encode()
        if self.warm:
            kid = self.warm.pop(0)
            _send_line(kid.chan, spec)
            kind = "warm"
        else:
            kid = self.fork(line)
            kind = "cold"
        kid.req_id, kid.t0 = req_id, t0
        kid.times = {"handoff": _now() - t0, "warm": 1.0 if kind == "warm" else 0.0}
        self.busy[kid.chan] = kid
        if kid.start_time is None:
            self.finish(kid, "sandbox init exited during setup")

    def finish(self, kid: _Kid, error: str | None) -> None:
        if kid.req_id is not None:
            kid.times["total"] = _now() - kid.t0
            if error is None:
                _send_line(self.ctl, {"id": kid.req_id, "ok": True, "pid": kid.pid,
                                      "start_time": kid.start_time, "t": kid.times})
            else:
                _send_line(self.ctl, {"id": kid.req_id, "ok": False, "error": error,
                                      "pid": kid.pid})
        elif error is not None:
            self.failures += 1
            self.last_error = error
        self.drop(kid)

    def on_kid(self, kid: _Kid) -> None:
        try:
            data = os.read(kid.chan, 4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        kid.buf += data
        while b"\n" in kid.buf:
            line, kid.buf = kid.buf.split(b"\n", 1)
            msg = json.loads(line)
            if "error" in msg:
                self.finish(kid, str(msg["error"]))
                return
            if msg.get("ready"):
                kid.times.update(msg.get("laps", {}))
                kid.times["started"] = msg.get("t0", kid.t0) - kid.t0
                self.failures = 0
                self.finish(kid, None)
                return
        if not data:
            self.finish(kid, self.last_error or "sandbox init exited during setup")

    def on_ctl(self, data: bytes, buf: bytes) -> bytes:
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            req = json.loads(line)
            op = req.get("op")
            if op == "configure":
                self.cfg = req
                self.warm_target = int(req.get("warm", 0))
            elif op == "spawn":
                try:
                    self.spawn(int(req["id"]), req["spec"])
                except OSError as exc:
                    _send_line(self.ctl, {"id": req.get("id"), "ok": False,
                                          "error": f"fork: {exc}", "pid": None})
            else:
                _send_line(self.ctl, {"id": req.get("id"), "ok": False, "error": "bad op"})
        return buf

    def serve(self) -> None:
        sig_r, sig_w = os.pipe()
        os.set_blocking(sig_r, False)
        os.set_blocking(sig_w, False)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(sig_w)
        os.set_blocking(self.ctl, False)
        self.sel.register(self.ctl, selectors.EVENT_READ, None)
        self.sel.register(sig_r, selectors.EVENT_READ, None)
        ctl_buf = b""
        _send_line(self.ctl, {"event": "hello", "pid": os.getpid(),
                              "python": sys.version.split()[0]})
        while True:
            # Refill the warm pool only while no sandbox is being set up: during a burst the
            # CPU goes to the requests, the pool catches up afterwards.
            refill = bool(self.cfg) and len(self.warm) < self.warm_target and not self.busy \
                and self.failures < 3
            for key, _ in self.sel.select(0 if refill else None):
                fd = key.fd
                if fd == sig_r:
                    try:
                        while os.read(sig_r, 512):
                            pass
                    except BlockingIOError:
                        pass
                    while True:  # reap every exited child
                        try:
                            pid, _status = os.waitpid(-1, os.WNOHANG)
                        except ChildProcessError:
                            break
                        if pid == 0:
                            break
                elif fd == self.ctl:
                    try:
                        data = os.read(self.ctl, 1 << 16)
                    except BlockingIOError:
                        continue
                    if not data:
                        return  # the driver is gone; sandboxes keep running
                    ctl_buf = self.on_ctl(data, ctl_buf)
                elif fd in self.by_chan:
                    self.on_kid(self.by_chan[fd])
            if refill and not self.busy:
                self.warm.append(self.fork(None))


def serve(ctl: int, envd_module: str) -> None:
    global _settings_cls, _envd_run
    server = importlib.import_module(envd_module)
    preload = getattr(server, "preload", None)
    if preload is not None:
        preload()
    from aenv.envd.settings import EnvdSettings

    _settings_cls = EnvdSettings
    _envd_run = server.run
    gc.collect()
    gc.freeze()  # objects from preload are never scanned again: their pages stay shared
    Zygote(ctl).serve()


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    opts = dict(zip(args[::2], args[1::2]))
    ctl = int(opts["--control-fd"])
    for extra in filter(None, opts.get("--extra-path", "").split(":")):
        sys.path.insert(0, extra)
    try:
        serve(ctl, opts.get("--envd-module", "aenv.envd.server"))
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        raise
    finally:
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
