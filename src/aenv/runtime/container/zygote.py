"""The container fork-server ("zygote") and the in-sandbox setup of each forked child.

A long-lived process on the bundled runtime python (`aenv.runtime.pybundle`), started by the
container driver. It imports envd once (`aenv.envd.server.preload()`, then `gc.freeze()`) and
forks sandboxes from that warm interpreter: create latency stays in milliseconds and forked
envds share the interpreter's pages (small idle memory per sandbox).

Each child is forked into a fresh pid namespace (the zygote unshares CLONE_NEWPID for its
next child only, then setns()es back), so the child is directly pid 1 of its sandbox and our
own child: no intermediate process. Children are made ahead of time ("warm"): while idle the
zygote keeps `warm` children that already did everything not specific to a sandbox: closed
inherited fds, made and joined a cgroup set `warm-<zygote pid>-<n>` with the device rules,
unshared mount/uts/ipc/cgroup (and, unless slots are in use, network) namespaces, dropped the
capability bounding set, staged a workspace skeleton, and built /dev, /proc and /run/aenv as
detached mount trees next to a clone of the bundle. A request hands one of them its spec; the
child renames its cgroup set and staged workspace to the sandbox's, sets the limits, joins its
network slot, mounts the overlay root, pivot_roots, moves the prepared trees into place,
mounts /sys, opens envd's listen socket, reports ready and becomes envd (~3 ms of CPU). With
no warm child left the same happens in a freshly forked one. At most one setup per CPU runs
at a time, the rest wait in order: under fair scheduling a burst of N concurrent setups would
all finish together at the end, in order the first ones are ready early.

Protocol with the driver (control socket; one JSON object per line):
    driver -> zygote: {"op": "configure", "warm": N, "bundle": DIR, "staging": DIR,
                       "cgroups": {...}, "max_setups": N | null,
                       "seccomp": HEX | null}                           first, once
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

import collections
import dataclasses
import errno
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
from collections.abc import Callable
from typing import Any

from aenv.runtime.container import linux

# Capabilities kept in the bounding set for everything a sandbox executes: Docker's default
# set less NET_RAW (raw and packet sockets forge frames; ping uses ICMP datagram sockets,
# which `ping_group_range` allows; a binary with the file capability cap_net_raw+ep, such as
# Debian's ping, fails to exec with EPERM). Notably absent too: SYS_ADMIN (mount, ...),
# NET_ADMIN, SYS_MODULE, SYS_PTRACE, SYS_RAWIO.
KEEP_CAPS = {0, 1, 3, 4, 5, 6, 7, 8, 10, 18, 27, 29, 31}

_DEVICES = (  # name, major, minor (char devices in the sandbox's /dev, see populate_dev)
    ("null", 1, 3), ("zero", 1, 5), ("full", 1, 7), ("random", 1, 8), ("urandom", 1, 9),
    ("tty", 5, 0),
)
_DEV_LINKS = (("ptmx", "pts/ptmx"), ("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
              ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2"),
              ("core", "/proc/kcore"))
# Host-wide knobs in /proc that root inside a sandbox must not write (sysrq, sysctl, ...).
_PROC_READONLY = ("bus", "fs", "irq", "sys", "sysrq-trigger")
# Host information in /proc and /sys nobody inside needs: hidden behind /dev/null or MASK_DIR.
_PROC_MASKED_FILES = ("kcore", "keys", "latency_stats", "timer_list", "sched_debug")
_PROC_MASKED_DIRS = ("acpi", "scsi")

SANDBOX_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# envd's directory (its log) inside the sandbox: from the driver's own top layer, written in
# the sandbox's upper; the host reads it through /proc/<init pid>/root/run/aenv/envd.log.
RUN_DIR = "/run/aenv"
MASK_DIR = RUN_DIR + "/.mask"  # empty and read-only: bind-mounted over masked directories
ETC_FILES = ("hostname", "hosts", "resolv.conf")
ENVD_LOG = RUN_DIR + "/envd.log"


def _now() -> float:
    return time.monotonic()  # CLOCK_MONOTONIC is system-wide: comparable across processes


def _send_line(fd: int, msg: dict[str, Any]) -> None:
    """Write one JSON line on a blocking or non-blocking stream fd, completely."""
    _send_all(fd, (json.dumps(msg) + "\n").encode())


def _send_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
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


def _prepare(cfg: dict[str, Any], name: str, own_netns: bool) -> dict[str, int]:
    """Everything not specific to a sandbox; done ahead of time by warm children. Returns
    fds of detached mount trees (the bundle, /dev, /proc, /run/aenv) to move into place
    after pivot_root."""
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
    # The cgroup namespace's root is this (soon renamed) cgroup set.
    linux.unshare(linux.CLONE_NEWCGROUP | linux.CLONE_NEWNS | linux.CLONE_NEWUTS
                  | linux.CLONE_NEWIPC)
    if own_netns:
        # Made now: creating a network namespace takes the kernel's rtnl lock, so a burst of
        # creates would queue on it (~4 ms each). Sandboxes with internet access use a slot.
        _new_netns()
    # Nothing mounted from here on may propagate back to the host.
    linux.mount(None, "/", None, linux.MS_REC | linux.MS_PRIVATE)
    # Programs the sandbox executes never get more than these (envd itself keeps its caps).
    linux.drop_bounding_caps(KEEP_CAPS)
    # Mounts are prepared as detached trees and moved into place after pivot_root: then a
    # template's symlinks (/opt -> /, ...) resolve inside the sandbox root and can never
    # redirect a mount or a write onto the host.
    fds = {"bundle": linux.open_tree(cfg["bundle"], linux.OPEN_TREE_CLONE
                                     | linux.OPEN_TREE_CLOEXEC | linux.AT_RECURSIVE)}
    linux.mount_setattr_fd(fds["bundle"], linux.MOUNT_ATTR_RDONLY | linux.MOUNT_ATTR_NOSUID
                           | linux.MOUNT_ATTR_NODEV)
    # The workspace skeleton, renamed into place by the request: creating an inode can cost
    # ~0.3 ms on a busy ext4, and a workspace needs seven.
    stage = os.path.join(cfg["staging"], name)
    for d in ("", "upper", "work", "upper/etc"):
        if d == "" and cfg.get("subvolumes"):
            # On btrfs the workspace (upper and overlay's work dir, which must share a
            # subvolume) is a subvolume: a snapshot seals the upper in O(1).
            linux.subvolume_create(stage)
            os.chmod(stage, 0o755)
        else:
            os.mkdir(os.path.join(stage, d), 0o755)
    for f in ETC_FILES:
        os.close(os.open(os.path.join(stage, "upper/etc", f), os.O_WRONLY | os.O_CREAT, 0o644))
    # /proc (this is already the sandbox's pid namespace), built on a scratch tmpfs mounted
    # over our own empty work dir, in our private namespace. /dev and /run/aenv are plain
    # directories of the driver's layer (see populate_dev): every tmpfs in a sandbox costs
    # each checkpoint and restore a tar run (~15 ms each way).
    scratch = os.path.join(stage, "work")
    linux.mount("scratch", scratch, "tmpfs", 0, "size=64k")
    os.mkdir(os.path.join(scratch, "proc"))
    _build_proc(os.path.join(scratch, "proc"))
    fds["proc"] = linux.open_tree(os.path.join(scratch, "proc"), linux.OPEN_TREE_CLONE
                                  | linux.OPEN_TREE_CLOEXEC | linux.AT_RECURSIVE)
    linux.umount2(scratch, linux.MNT_DETACH)
    if cfg.get("userns"):
        fds["userns"] = _new_userns(int(cfg["userns"]["host_id"]), int(cfg["userns"]["size"]),
                                    fds["proc"])
    return fds


def populate_dev(dev: str) -> None:
    """The sandbox's /dev as a directory of the driver's top layer: device nodes, links and
    the mountpoints of devpts and /dev/shm. Opaque, so a template's own /dev never shows.
    Run by the host driver (as root) when it makes its layer. Idempotent."""
    os.makedirs(dev, 0o755, exist_ok=True)
    os.chmod(dev, 0o755)
    os.setxattr(dev, "trusted.overlay.opaque", b"y")
    old = os.umask(0)
    try:
        for name, major, minor in _DEVICES:
            path = os.path.join(dev, name)
            st = os.lstat(path) if os.path.lexists(path) else None
            if st is None or st.st_rdev != os.makedev(major, minor) or not stat.S_ISCHR(
                    st.st_mode):
                if st is not None:
                    os.unlink(path)
                os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
            os.chmod(path, 0o666)
        for name, target in _DEV_LINKS:
            path = os.path.join(dev, name)
            if os.path.lexists(path):
                if os.path.islink(path) and os.readlink(path) == target:
                    continue
                os.unlink(path)
            os.symlink(target, path)
        for name, mode in (("pts", 0o755), ("shm", 0o1777)):
            os.makedirs(os.path.join(dev, name), mode, exist_ok=True)
            os.chmod(os.path.join(dev, name), mode)
    finally:
        os.umask(old)


def _build_proc(proc: str) -> None:
    linux.mount("proc", proc, "proc", linux.MS_NOSUID | linux.MS_NODEV | linux.MS_NOEXEC)
    for name in _PROC_READONLY:
        path = os.path.join(proc, name)
        if os.path.exists(path):
            _bind_readonly(path)


def _mask_host_information() -> None:
    """Hide /proc and /sys entries with host information behind the sandbox's own /dev/null
    and an empty read-only directory of the driver's layer: bind mounts from the sandbox's
    root, which a checkpoint records as such (a tmpfs mask would cost a tar run)."""
    for name in _PROC_MASKED_FILES:
        path = os.path.join("/proc", name)
        if os.path.exists(path):
            linux.mount("/dev/null", path, None, linux.MS_BIND)
    for path in (*(os.path.join("/proc", d) for d in _PROC_MASKED_DIRS), "/sys/firmware"):
        if os.path.isdir(path):
            linux.mount(MASK_DIR, path, None, linux.MS_BIND)
            linux.mount(MASK_DIR, path, None, linux.MS_BIND | linux.MS_REMOUNT | linux.MS_RDONLY
                        | linux.MS_NOSUID | linux.MS_NODEV | linux.MS_NOEXEC)


def _shm_mb(memory_mb: int) -> int:
    """/dev/shm's size: half the sandbox's memory, as a tmpfs defaults to half of a machine's
    RAM. Its pages are charged to the sandbox's memory cgroup and no OOM kill frees them: a
    /dev/shm as large as the limit, once full, would leave nothing for envd."""
    return max(memory_mb // 2, 1)


def _protect_from_oom() -> None:
    """envd is never its own sandbox's OOM victim: oom_score_adj -1000 (what it starts gets
    +100 again, process.py). Lowering it needs CAP_SYS_RESOURCE of the host's user namespace,
    which a host that is itself a container may not grant: then envd stays at 0, still behind
    every command (+100), and a full /dev/shm leaves it room (`_shm_mb`)."""
    try:
        _write_to("/proc/self/oom_score_adj", "-1000")
    except PermissionError:
        pass


def _new_netns() -> None:
    linux.unshare(linux.CLONE_NEWNET)
    linux.interface_up("lo")
    # As in network slots (network.py sets them there) and Docker.
    _unprivileged_net_sysctls()


def _place_workspace(stage: str, ws: str) -> None:
    """Move the staged skeleton to the workspace path; build it there if that fails (another
    filesystem, or a workspace directory that already has content)."""
    try:
        os.rename(stage, ws)
        return
    except FileNotFoundError:
        os.makedirs(os.path.dirname(ws), exist_ok=True)
        try:
            os.rename(stage, ws)
            return
        except OSError:
            pass
    except OSError:
        pass
    for d in ("upper/etc", "work"):
        os.makedirs(os.path.join(ws, d), 0o755, exist_ok=True)
    _remove_tree(stage)


def _remove_tree(path: str) -> None:
    for root, dirs, files in os.walk(path, topdown=False):
        for f in files:
            os.unlink(os.path.join(root, f))
        for d in dirs:
            os.rmdir(os.path.join(root, d))
    if os.path.isdir(path):
        os.rmdir(path)


def _write_etc(upper: str, spec: dict[str, Any], shift: int = 0) -> None:
    """/etc/hostname, /etc/hosts (and /etc/resolv.conf with internet access) written in the
    upper layer before mounting: no copy-up at run time. They shadow the template's files
    whatever those are (a symlink into /run would dangle in a sandbox). `shift`: the host
    id of the sandbox's root in a user namespace (the upper holds shifted ids), else 0."""
    etc = os.path.join(upper, "etc")
    shifted = set(spec.get("lower_shifted", ()))
    for layer in spec["lower"]:
        try:
            st = os.lstat(os.path.join(layer, "etc"))
        except FileNotFoundError:
            continue
        if not stat.S_ISDIR(st.st_mode):
            _remove_tree(etc)  # a template with an unusual /etc: leave it alone
            return
        # A merged directory takes its attributes from the upper layer: copy the template's
        # (shifted like the idmapped mount of its layer shows it).
        by = 0 if layer in shifted else shift
        os.makedirs(etc, exist_ok=True)
        os.chown(etc, st.st_uid + by, st.st_gid + by)
        os.chmod(etc, stat.S_IMODE(st.st_mode))
        break
    else:
        os.makedirs(etc, 0o755, exist_ok=True)
    contents = {"hostname": spec["hostname"] + "\n", "hosts": spec["hosts"],
                "resolv.conf": spec.get("resolv_conf")}
    for name, content in contents.items():
        path = os.path.join(etc, name)
        if content is None:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            continue
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        try:
            if shift:
                os.fchown(fd, shift, shift)
            os.write(fd, content.encode())
        finally:
            os.close(fd)


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


def _idmap_layers(spec: dict[str, Any], userns_fd: int) -> list[str]:
    """The lower layers for an overlay root in a user namespace: each layer holding host ids
    (a template's, the driver's) gets an idmapped mount over its own path, in our private
    mount namespace; layers holding shifted ids (`lower_shifted`) stay as they are. Attached
    rather than given to overlayfs as fds: closing a detached tree costs an RCU grace
    period (~5 ms each here), while these go with the host's root tree, detached anyway
    after pivot_root."""
    shifted = set(spec.get("lower_shifted", ()))
    paths = []
    for layer in spec["lower"]:
        path = os.path.realpath(layer)  # move_mount does not follow a final symlink
        if layer not in shifted:
            try:
                fd = linux.idmapped_tree(path, userns_fd)
            except OSError as exc:  # e.g. an on-demand (FUSE) layer: no idmapped mounts
                raise OSError(exc.errno, f"layer {layer} cannot be idmapped into the sandbox's "
                              f"user namespace ({exc.strerror})") from None
            try:
                linux.move_mount_fd(fd, path)
            finally:
                os.close(fd)  # attached: closing it unmounts nothing
        paths.append(path)
    return paths


def _unprivileged_net_sysctls() -> None:
    """Ping without CAP_NET_RAW (which no sandbox has) and ports below 1024 without
    CAP_NET_BIND_SERVICE (which root in a user namespace lacks: our network namespace
    belongs to the host's): every uid may bind ports below 1024 and open ICMP echo sockets,
    as root in a container expects. Written through the host's /proc (the sandbox's /proc/sys is
    read-only), which shows the calling task's network namespace."""
    _write_to("/proc/sys/net/ipv4/ip_unprivileged_port_start", "0")
    _write_to("/proc/sys/net/ipv4/ping_group_range", "0 2147483647")


def _new_userns(host_id: int, size: int, proc_fd: int) -> int:
    """An fd of a new user namespace, this sandbox's own, mapping ids 0..size-1 to
    host_id.. . Made ahead of time (warm children): `unshare --user cat` (posix_spawn:
    vfork+exec, so none of our pages become copy-on-write) makes it, and we, privileged in
    the parent namespace (only such a process may write a map of more than its own id),
    write its maps. `proc_fd`: our pid namespace's /proc (our _build_proc tree), in which
    that child's pid means it. Its layers' idmapped mounts use the namespace too."""
    to_cat, cat_in = os.pipe()
    cat_out, from_cat = os.pipe()
    try:
        pid = os.posix_spawnp("unshare", ["unshare", "--user", "--", "cat"],
                              {"PATH": "/usr/bin:/bin"},
                              file_actions=[(os.POSIX_SPAWN_DUP2, to_cat, 0),
                                            (os.POSIX_SPAWN_DUP2, from_cat, 1)])
    except BaseException:
        for fd in (to_cat, cat_in, cat_out, from_cat):
            os.close(fd)
        raise
    os.close(to_cat)
    os.close(from_cat)
    try:
        os.write(cat_in, b"u")
        if os.read(cat_out, 1) != b"u":  # cat answers: the namespace exists
            raise OSError(errno.ECHILD, "unshare --user failed")
        for name in ("uid_map", "gid_map"):
            fd = os.open(f"{pid}/{name}", os.O_WRONLY, dir_fd=proc_fd)
            try:
                os.write(fd, f"0 {host_id} {size}\n".encode())
            finally:
                os.close(fd)
        return os.open(f"{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC, dir_fd=proc_fd)
    finally:
        os.close(cat_in)  # EOF: cat exits
        os.close(cat_out)
        os.waitpid(pid, 0)


def _enter_userns(userns_fd: int) -> None:
    """Become root of this sandbox's user namespace (made by _new_userns), as the very last
    privileged step (everything above needed the host's root: cgroups, the network slot,
    mounts). Entering resets the capability bounding set to full: dropped again here. Every
    namespace made before stays owned by the host's user namespace, so the sandbox's root
    has no capability over its own mounts, network or hostname (as if it had not unshared
    them), nor over anything of the host."""
    linux.setns(userns_fd, linux.CLONE_NEWUSER)
    os.close(userns_fd)
    os.setgroups([])
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)
    # Changing ids left envd non-dumpable; kept so: only the host's root may ptrace it.
    linux.drop_bounding_caps(KEEP_CAPS)


class StaleMounts(Exception):
    """A warm child's copy of the host mounts predates a mount the request needs."""


def _same_as_host(path: str, zygote_pid: int) -> bool:
    """Whether `path` (or its nearest existing ancestor) is the same file in our mount
    namespace and in the zygote's (the host's)."""
    while True:
        try:
            mine = os.stat(path)
            break
        except FileNotFoundError:
            parent = os.path.dirname(path)
            if parent == path:
                return True
            path = parent
    theirs = os.stat(f"/proc/{zygote_pid}/root{path}")
    return (mine.st_dev, mine.st_ino) == (theirs.st_dev, theirs.st_ino)


def _become_sandbox(cfg: dict[str, Any], name: str, spec: dict[str, Any], chan: int,
                    trees: dict[str, int], own_netns: bool, laps: _Laps) -> socket.socket:
    """The sandbox-specific part of the setup, in the child. Returns envd's listen socket."""
    # A warm child copied the host's mount table when it was made: a layer on a filesystem
    # mounted since then would silently resolve to the empty directory beneath it.
    for path in (*spec["lower"], spec["workspace"], cfg["staging"]):
        if not _same_as_host(path, cfg["zygote_pid"]):
            raise StaleMounts(path)
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
    elif not own_netns:
        _new_netns()
    userns = cfg.get("userns")
    root_id = int(userns["host_id"]) if userns else 0  # the sandbox root's host uid/gid
    laps("netns")
    ws = spec["workspace"]
    _place_workspace(os.path.join(cfg["staging"], name), ws)
    upper, work = os.path.join(ws, "upper"), os.path.join(ws, "work")
    _write_etc(upper, spec, root_id)
    # Mounted over the workspace directory itself: any directory of our private mount
    # namespace will do as the future root, and this one costs no extra inode.
    if userns:
        # The upper holds shifted ids on disk and is not idmapped; its root directory is the
        # sandbox's "/" (and marks a sealed copy of it as holding shifted ids).
        os.chown(upper, root_id, root_id)
        linux.mount_overlay(ws, ":".join(_idmap_layers(spec, trees["userns"])), upper, work)
    else:
        linux.mount_overlay(ws, ":".join(spec["lower"]), upper, work)
    laps("overlay")
    os.chdir(ws)
    linux.pivot_root(".", ".")
    linux.umount2(".", linux.MNT_DETACH)  # the host root, stacked on top by pivot_root
    os.chdir("/")
    laps("pivot")
    for key, path in (("proc", "/proc"), ("bundle", cfg["bundle"])):
        _mkdirs(path)  # normally present (template, driver layer): no copy-up
        linux.move_mount_fd(trees[key], path)
        os.close(trees[key])
    # /dev is the driver layer's directory; only its pseudo-filesystems are mounted. The
    # /dev/shm tmpfs's pages count in the memory cgroup: half its size (_shm_mb).
    # Ids in mount options are read in our (the host's) user namespace: shifted by hand.
    linux.mount("devpts", "/dev/pts", "devpts", linux.MS_NOSUID | linux.MS_NOEXEC,
                f"newinstance,ptmxmode=0666,mode=0620,gid={root_id + 5}")
    linux.mount("shm", "/dev/shm", "tmpfs", linux.MS_NOSUID | linux.MS_NODEV,
                f"mode=1777,size={_shm_mb(int(spec['memory_mb']))}m"
                + (f",uid={root_id},gid={root_id}" if userns else ""))
    # sysfs shows the network namespace of whoever mounts it: only now is ours final.
    _mkdirs("/sys", 0o555)
    linux.mount("sysfs", "/sys", "sysfs",
                linux.MS_RDONLY | linux.MS_NOSUID | linux.MS_NODEV | linux.MS_NOEXEC)
    _mask_host_information()
    # stdio: /dev/null in, envd's log (in the driver layer's /run/aenv) out. No code of
    # anyone ran in this root yet, so these paths are ours.
    null = os.open("/dev/null", os.O_RDWR)
    log = os.open(ENVD_LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    if userns:
        os.fchown(log, root_id, root_id)  # the sandbox's root may read its envd's log
    for fd, targets in ((null, (0,)), (log, (1, 2))):
        for target in targets:
            os.dup2(fd, target)
        os.close(fd)
    # Python's stdio objects follow fds 1 and 2, now envd's log (they live forever).
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    laps("mounts")
    linux.sethostname(spec["hostname"])
    listen = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listen.bind((spec["envd"]["host"], int(spec["envd"]["port"])))
    listen.listen(4096)
    # Every other fd goes: CRIU refuses to dump fds it cannot account for.
    linux.close_fds_except({chan, listen.fileno(), *([trees["userns"]] if userns else [])})
    laps("listen")
    return listen


@dataclasses.dataclass(frozen=True)
class Envd:
    """envd's entry points, imported once by the zygote before any fork."""

    settings: Callable[..., Any]  # aenv.envd.settings.EnvdSettings
    run: Callable[..., None]  # aenv.envd.server.run(settings, listen_socket=...)


def _child(cfg: dict[str, Any], envd: Envd, name: str, chan: int,
           spec_line: bytes | None, own_netns: bool) -> None:
    """Body of every forked child. Never returns."""
    code = 1
    try:
        laps = _Laps()
        linux.close_fds_except({chan})
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.set_blocking(chan, True)
        trees = _prepare(cfg, name, own_netns)
        laps("prepare")
        if spec_line is None:
            spec_line = _read_line(chan)  # warm: wait here until a request comes
            if not spec_line:
                code = 0
                return  # the zygote went away
            laps = _Laps()  # time the request, not the idle wait
        spec = json.loads(spec_line)
        listen = _become_sandbox(cfg, name, spec, chan, trees, own_netns, laps)
        _protect_from_oom()  # before the user namespace and seccomp: it needs the host's root
        if cfg.get("userns"):
            _enter_userns(trees["userns"])
            laps("userns")
        os.environ.clear()
        os.environ.update({"PATH": SANDBOX_PATH, "HOME": "/root"})
        settings = envd.settings(**spec["envd"])
        if cfg["seccomp"] is not None:
            # Last: every setup syscall above is one the filter refuses (mount, setns, ...).
            # Inherited by envd and all it runs; CRIU dumps and restores it with the process.
            cfg["seccomp"].load()
            laps("seccomp")
        # The kernel queues connections on a listening socket, so envd is reachable now,
        # even though its event loop starts a few milliseconds later.
        _send_line(chan, {"ready": True, "t0": laps.marks[0][1], "laps": laps.report()})
        os.close(chan)
        linux.set_comm("envd")
        envd.run(settings, listen_socket=listen)
        code = 0
    except StaleMounts:
        _send_line(chan, {"stale": True})  # nothing done yet: the zygote retries cold
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


class _Kid:
    """A forked child, warm (no spec yet) or working on a request."""

    __slots__ = ("buf", "chan", "has_slot", "name", "pid", "req_id", "spec", "start_time", "t0",
                 "times")

    def __init__(self, pid: int, chan: int, name: str) -> None:
        self.spec: bytes = b""
        self.has_slot = False
        self.name = name  # its cgroup set until a request renames it to the sandbox id
        self.pid = pid
        self.start_time = linux.proc_start_time(pid)
        self.chan = chan
        self.buf = b""
        self.req_id: int | None = None
        self.t0 = 0.0
        self.times: dict[str, float] = {}


class Zygote:
    """The fork-server's state and event loop (one per process)."""

    def __init__(self, ctl: int, envd: Envd) -> None:
        self.ctl = ctl
        self.envd = envd
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
        self.retired: dict[int, str] = {}  # pid -> cgroup set of children that never served
        self.exited: set[int] = set()  # reaped before their channel was read to the end
        # Requests beyond `max_setups` wait here, first come first served. With the CPU
        # shared fairly, N concurrent setups would all finish together at the end of a
        # burst; a few at a time, the first sandboxes are ready after a few milliseconds.
        self.queue: collections.deque[tuple[int, bytes, float, bool]] = collections.deque()
        self.max_setups = max(1, len(os.sched_getaffinity(0)))
        self.expect_slot = False

    def fork(self, spec_line: bytes | None, own_netns: bool) -> _Kid:
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
                _child(self.cfg, self.envd, name, chan, spec_line, own_netns)  # no return
        finally:
            if pid != 0:
                linux.setns(self.own_pidns, linux.CLONE_NEWPID)
        theirs.close()
        chan = ours.detach()
        os.set_blocking(chan, False)
        kid = _Kid(pid, chan, name)
        self.by_chan[chan] = kid
        self.sel.register(chan, selectors.EVENT_READ, None)
        return kid

    def drop(self, kid: _Kid) -> None:
        self.sel.unregister(kid.chan)
        os.close(kid.chan)
        self.by_chan.pop(kid.chan, None)
        self.busy.pop(kid.chan, None)
        self.exited.discard(kid.pid)
        if kid in self.warm:
            self.warm.remove(kid)

    def retire(self, kid: _Kid) -> None:
        """Drop a child that did not become a sandbox; its warm cgroup set goes once it has
        exited (a no-op if it got as far as renaming the set to a sandbox id)."""
        exited = kid.pid in self.exited
        self.drop(kid)
        if exited:
            self.rm_cgroups(kid.name)
        else:
            self.retired[kid.pid] = kid.name

    def reaped(self, pid: int) -> None:
        name = self.retired.pop(pid, None)
        if name is not None:
            self.rm_cgroups(name)
        elif pid in {k.pid for k in self.by_chan.values()}:
            self.exited.add(pid)  # its last words are still in its channel

    def rm_cgroups(self, name: str) -> None:
        try:
            _remove_tree(os.path.join(self.cfg["staging"], name))
        except OSError:
            pass  # renamed into a workspace, or the driver's sweep gets it later
        cg = self.cfg["cgroups"]
        for ctrl in cg["controllers"]:
            try:
                os.rmdir(os.path.join(cg["root"], ctrl, cg["parent"], name))
            except OSError:
                pass  # never made, renamed, or the driver's sweep gets it later

    def spawn(self, req_id: int, spec: dict[str, Any]) -> None:
        t0 = _now()
        # Warm children to come make their own network namespace only if the latest request
        # did not bring a slot: a namespace made for nothing costs its teardown too.
        self.expect_slot = bool(spec.get("netns"))
        if spec.get("netns"):
            # Warm children copied the host's mounts before this slot's nsfs bind mount
            # existed: let them open it through our (the host's) mount namespace.
            spec["netns"] = f"/proc/{os.getpid()}/root{spec['netns']}"
        self.queue.append((req_id, (json.dumps(spec) + "\n").encode(), t0, self.expect_slot))
        self.dispatch()

    def dispatch(self) -> None:
        while self.queue and len(self.busy) < self.max_setups:
            req_id, line, t0, has_slot = self.queue.popleft()
            self.hand_over(req_id, line, t0, has_slot, allow_warm=True)

    def hand_over(self, req_id: int, line: bytes, t0: float, has_slot: bool,
                  allow_warm: bool) -> None:
        if self.warm and allow_warm:
            kid = self.warm.pop(0)
            _send_all(kid.chan, line)
        else:
            kid = self.fork(line, own_netns=not has_slot)
        kid.req_id, kid.t0, kid.spec, kid.has_slot = req_id, t0, line, has_slot
        kid.times = {"queued": _now() - t0, "warm": 1.0 if allow_warm else 0.0}
        self.busy[kid.chan] = kid
        if kid.start_time is None:
            self.finish(kid, "sandbox init exited during setup")

    def finish(self, kid: _Kid, error: str | None) -> None:
        if kid.req_id is not None:
            kid.times["total"] = _now() - kid.t0
            if error is None:
                _send_line(self.ctl, {"id": kid.req_id, "ok": True, "pid": kid.pid,
                                      "start_time": kid.start_time, "t": kid.times})
                self.drop(kid)
            else:
                _send_line(self.ctl, {"id": kid.req_id, "ok": False, "error": error,
                                      "pid": kid.pid})
                self.retire(kid)
            self.dispatch()
        else:
            if error is not None:
                self.failures += 1
                self.last_error = error
            self.retire(kid)

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
            if msg.get("stale") and kid.req_id is not None:
                # The host mounted something since the warm pool was made: retry in a fresh
                # child, and renew the whole pool.
                req_id, line, t0, has_slot = kid.req_id, kid.spec, kid.t0, kid.has_slot
                kid.req_id = None
                self.retire(kid)
                for old in list(self.warm):
                    self.retire(old)  # EOF makes them exit
                self.hand_over(req_id, line, t0, has_slot, allow_warm=False)
                return
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
                self.cfg = {**req, "zygote_pid": os.getpid(),
                            # the BPF program every sandbox loads (seccomp.py on the host)
                            "seccomp": linux.SeccompProgram(bytes.fromhex(req["seccomp"]))
                            if req.get("seccomp") else None}
                self.warm_target = int(req.get("warm", 0))
                self.max_setups = int(req.get("max_setups") or self.max_setups)
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
                and not self.queue and self.failures < 3
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
                        self.reaped(pid)
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
                self.warm.append(self.fork(None, own_netns=not self.expect_slot))


def serve(ctl: int, envd_module: str) -> None:
    from aenv.envd.lean import block_ssl

    block_ssl()  # envd never speaks TLS; OpenSSL would cost every sandbox ~1.3 MiB private
    server = importlib.import_module(envd_module)
    preload = getattr(server, "preload", None)
    if preload is not None:
        preload()
    from aenv.envd.settings import EnvdSettings

    gc.collect()
    gc.freeze()  # objects from preload are never scanned again: their pages stay shared
    Zygote(ctl, Envd(EnvdSettings, server.run)).serve()


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    opts = dict(zip(args[::2], args[1::2]))
    ctl = int(opts["--control-fd"])
    for extra in filter(None, opts.get("--extra-path", "").split(":")):
        sys.path.insert(0, extra)
    try:
        serve(ctl, opts.get("--envd-module", "aenv.envd.server"))
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
