"""CRIU checkpoint/restore of container sandboxes: pause/resume, snapshot, fork.

A sandbox (see `zygote.py`) is a process tree whose PID 1 (envd) is a session leader in its
own mnt/uts/ipc/net/pid/cgroup namespaces, with an overlay root (lowerdirs + the workspace's
upper/work), tmpfs /dev, devpts, /proc, ro /sys, tmpfs /run/aenv and the runtime bundle
bind-mounted read-only at its host path. `criu dump -t <init>` saves the whole tree and its
namespaces into an image directory; `criu restore` recreates it:

- **pause**: `dump(..., leave_running=False)` (CRIU kills the tree), later `restore()` into
  the same workspace (same upper) and cgroups.
- **snapshot**: `dump(..., leave_running=True, upper=...)`: CRIU's pre-dump action script
  freezes the freezer cgroup and seals the upper layer into `<images>/upper` (on btrfs a
  read-only snapshot of the workspace subvolume, O(1); elsewhere a copy of the upper,
  reflinked when the filesystem can), CRIU dumps, and the cgroup is thawed. The source's pause is
  `DumpStats.frozen_s`. The caller moves the sealed upper out to become a shared layer.
- **fork / restore a snapshot**: `prepare_workspace()` makes a new, empty workspace (the
  sealed layer is stacked under it as a lower), `create_cgroups()` makes the new sandbox's
  cgroups, `restore()` brings the copy up (N of them may run concurrently from one image).

`restore()` mounts the overlay root on the host at `<workspace>/rootfs` (private
propagation) for CRIU's `--root`, runs CRIU from inside the target cgroups (so the restored
tasks inherit them: `--manage-cgroups=ignore`; CRIU is also given a new cgroup namespace
rooted there, which it does not restore itself), and detaches that host mount as soon as CRIU
is done: the restored mount namespace holds its own reference to the overlay, so nothing of
the sandbox stays mounted on the host. `unmount_root()` is the idempotent cleanup for a
workspace (after a crash in the middle of a restore, or before removing the workspace).
It returns once envd answers `GET /health` on its port inside the restored network
namespace (a fresh one CRIU makes, or an existing one given with `netns=`, e.g. a network
slot).

Owns: image directories given to it, `<workspace>/rootfs` and `<workspace>/criu` (CRIU's
restore work dir with its log), the cgroup directories `create_cgroups()` makes.
Must not touch: the sandbox's processes other than through CRIU and the freezer cgroup; any
other host mount.

Needs CRIU 4.2.1 at /usr/local/sbin/criu (`scripts/install-criu.sh`); see
docs/criu-notes.md for why that version and these flags.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from aenv import faults
from aenv.errors import AenvError, ErrorCode
from aenv.runtime import process, pybundle
from aenv.runtime.container import cgroups, linux
from aenv.storage.usage import apparent_bytes

CRIU = Path("/usr/local/sbin/criu")
CRIU_MIN_VERSION = (4, 2)
NETNS_KEY = "aenv-netns"  # CRIU's name for a network namespace kept outside the image
NETNS_MARK = "netns-external"  # present in an image taken with an external netns
BUNDLE_KEY = "py311"  # the --external key of the runtime bundle's bind mount
# Volumes bind-mounted into the sandbox (external to the image, like the bundle): their
# mount points and --external keys, so that a restore binds each one's host directory there.
VOLUMES_MARK = "volumes.json"
ROOTFS = "rootfs"  # <workspace>/rootfs: the host-side overlay mount for --root
WORKDIR = "criu"  # <workspace>/criu: CRIU's restore work dir (log, lazy-pages socket)
SEALED = "sealed"  # <images>/sealed/upper: the upper layer sealed while frozen (snapshots)
BUNDLE_MARK = "bundle-version"  # the runtime bundle version the image's processes mapped
DUMP_LOG = "dump.log"
RESTORE_LOG = "restore.log"
# A criu run that takes longer is stuck (a task in the kernel, a hung filesystem): it is
# killed and the operation fails with `timeout`; the sandbox is thawed (a dump) or cleaned up
# (a restore). Far above any real run: 100 MiB dumps in ~0.1 s, 4 GiB in a few seconds.
CRIU_TIMEOUT_S = 300.0
_LOG_TAIL = 15
# Error lines CRIU logs on every run on these hosts, which mean nothing (docs/criu-notes.md).
_HARMLESS = re.compile(r"RLIMIT_NOFILE|iptables|ip6tables|Address already assigned|"
                       r"--network-lock")
_HOOK = "aenv-hook.sh"
_HOOK_MARKS = "aenv-hook.times"
# CRIU's --action-script, run by `sh -c` with CRTOOLS_SCRIPT_ACTION set. At pre-dump (before
# CRIU freezes anything, but after its start-up), freeze the cgroup ourselves: CRIU then
# finds it FROZEN at once instead of polling every 100 ms; then copy the upper (snapshots).
# Wall-clock marks (bash $EPOCHREALTIME) go to $AENV_MARKS (<images>/aenv-hook.times) for DumpStats.
_HOOK_SCRIPT = r"""#!/bin/bash
# bash, not sh: its builtins (read, EPOCHREALTIME) keep this path free of fork+exec.
set -e
[ "$CRTOOLS_SCRIPT_ACTION" = pre-dump ] || exit 0
echo "start $EPOCHREALTIME" > "$AENV_MARKS"
# Freeze, and make sure no task is caught in the middle of a vfork: its parent then waits
# uninterruptibly (state D) for a child that is frozen before its exec, which the freezer
# cannot freeze (FREEZING forever) or CRIU cannot seize ("Unseizable ... state D", after
# its 10 s timeout). A shell loop spawning commands is in that window ~10% of the time.
# So: freeze; if it does not settle at once, or a task sits in vfork, thaw, let the child
# exec, and freeze again. Give up after ~5 s (a task stuck in the kernel): CRIU aborts and
# the caller thaws.
deadline=$(( ${EPOCHREALTIME%.*} + 5 ))
while :; do
    echo FROZEN > "$AENV_FREEZER/freezer.state"
    polls=0
    read -r state < "$AENV_FREEZER/freezer.state"
    while [ "$state" != FROZEN ] && [ "$polls" -lt 300 ]; do
        polls=$((polls + 1))
        read -r state < "$AENV_FREEZER/freezer.state"
    done
    in_vfork=
    if [ "$state" = FROZEN ]; then
        mapfile -t pids < "$AENV_FREEZER/tasks"
        for pid in "${pids[@]}"; do
            stack=
            read -r -d '' stack < "/proc/$pid/stack" || true
            if [[ $stack == *vfork* ]]; then in_vfork=$pid; break; fi
        done
        [ -z "$in_vfork" ] && break
    fi
    if [ "${EPOCHREALTIME%.*}" -ge "$deadline" ]; then
        echo "aenv: freezer $AENV_FREEZER still $state${in_vfork:+ (task $in_vfork in vfork)}" >&2
        exit 1
    fi
    echo THAWED > "$AENV_FREEZER/freezer.state"
    sleep 0.002
done
echo "frozen $EPOCHREALTIME" >> "$AENV_MARKS"
if [ -n "${AENV_UPPER:-}" ]; then
    if [ -n "${AENV_SEAL_SUBVOLUME:-}" ]; then
        # O(1): a read-only btrfs snapshot of the workspace subvolume holding the upper.
        btrfs -q subvolume snapshot -r "${AENV_UPPER%/*}" "$AENV_SEALED" >/dev/null
    else
        mkdir "$AENV_SEALED"
        cp -a --reflink=auto -- "$AENV_UPPER" "$AENV_SEALED/upper"
    fi
    echo "copied $EPOCHREALTIME" >> "$AENV_MARKS"
fi
"""


# Why a sandbox in a user namespace (SecurityConfig.userns) cannot be paused, snapshotted or
# forked: CRIU 4.2.1 dumps a tree in a user namespace only if every other namespace of it
# belongs to that user namespace (criu/namespaces.c, "One or more namespaces doesn't belong
# to the target user namespace"), and it restores them by creating them inside it. Ours
# belong to the host's user namespace on purpose: the network slot (made ahead of time by the
# host, veth on the bridge) and the mount namespace whose mounts need the host's root
# (idmapped overlay root). Re-creating mnt/uts/ipc/net inside the user namespace lets CRIU
# dump and restore a loopback-only sandbox, but CRIU's root task then runs as the sandbox's
# root: it cannot join a slot's network namespace (the default: internet access), mount
# sysfs for it, or open an external bind mount's source under a directory it cannot search
# (EACCES, measured). Lifting this needs CRIU patches (docs/criu-notes.md).
USERNS_NOT_CHECKPOINTABLE = (
    "sandboxes in user namespaces (security.userns) cannot be checkpointed by CRIU 4.2.1: "
    "pause, snapshot and fork need security.userns off")


@dataclass(frozen=True)
class UsernsRange:
    """The host ids a node's sandboxes run as: ids 0..size-1 of each sandbox's user
    namespace are host ids host_id.. (config: SecurityConfig.userns_*)."""

    host_id: int
    size: int


@dataclass(frozen=True)
class DumpStats:
    """Timings of one dump, in seconds. `frozen_s`: how long the sandbox was not running
    (for a pause, from the start of CRIU's dump until it killed the tree)."""

    frozen_s: float
    copy_s: float  # the upper layer's copy (0 without one)
    criu_s: float  # the `criu dump` process
    total_s: float
    image_bytes: int
    log: Path


@dataclass(frozen=True)
class RestoreResult:
    pid: int  # the restored PID 1, on the host
    start_time: int  # its start time (linux.proc_start_time), for handles
    timings: dict[str, float] = field(default_factory=dict)
    log: Path | None = None
    bundle_version: str | None = None  # of the runtime bundle it was restored with
    # With lazy=True: the `criu lazy-pages` daemon still pushing pages; it exits by itself
    # once all are in. The caller owns it (await its wait(), or kill it).
    lazy_daemon: asyncio.subprocess.Process | None = None


# --------------------------------------------------------------------------- criu binary


async def check_criu(criu: Path = CRIU) -> str:
    """CRIU's version string; AenvError(NOT_SUPPORTED) if it is missing, too old or lacks our
    patches. dump() and restore() do not check: their caller does, once (the driver)."""
    hint = "run scripts/install-criu.sh (as root) to install CRIU 4.2.1"
    try:
        done = await process.run([str(criu), "--version"])
    except OSError as exc:
        raise AenvError(ErrorCode.NOT_SUPPORTED, f"criu not usable at {criu} ({exc}): {hint}"
                        ) from None
    out = done.output
    m = re.search(rb"Version:\s*(\d+)\.(\d+)(?:\.(\d+))?", out)
    if done.returncode != 0 or m is None:
        raise AenvError(ErrorCode.NOT_SUPPORTED,
                        f"criu at {criu} does not report a version: {hint}")
    version = ".".join(g.decode() for g in m.groups() if g is not None)
    if (int(m.group(1)), int(m.group(2))) < CRIU_MIN_VERSION:
        raise AenvError(ErrorCode.NOT_SUPPORTED,
                        f"criu {version} at {criu} is too old (need >= 4.2): {hint}")
    # Our patches (scripts/criu-aenv-fast.patch) are required, not an optimisation only:
    # restores rely on CRIU_ENTER_CGROUPS to put the tasks into the sandbox's cgroups. A
    # patched criu refuses a cgroup that does not exist; a stock one ignores the variable.
    probe = await process.run([str(criu), "--version"],
                              env={**os.environ, "CRIU_ENTER_CGROUPS": "/nonexistent-aenv-probe"})
    if probe.returncode == 0:
        raise AenvError(ErrorCode.NOT_SUPPORTED,
                        f"criu at {criu} lacks aenv's patches (CRIU_ENTER_CGROUPS): {hint}")
    return version


def _log_tail(log: Path, lines: int = _LOG_TAIL) -> str:
    try:
        text = log.read_text(errors="replace").splitlines()
    except OSError as exc:
        return f"(no log: {exc})"
    text = [ln for ln in text if not _HARMLESS.search(ln)]
    errors = [ln for ln in text if "Error" in ln]
    tail = text[-lines:]
    # The first error lines usually name the cause; the tail shows where it stopped.
    picked = [ln for ln in errors[:5] if ln not in tail] + tail
    return "\n".join(picked)


async def _run_criu(args: list[str], log: Path, what: str, criu: Path,
                    cgroup_dirs: Sequence[Path] = (), env: dict[str, str] | None = None,
                    pass_fds: Sequence[int] = (), crash: str | None = None) -> float:
    """Run criu to completion; seconds taken. With `cgroup_dirs`, criu first moves itself
    into them and into a new cgroup namespace rooted there (our patch's CRIU_ENTER_CGROUPS;
    CRIU does not restore cgroup namespaces with --manage-cgroups=ignore), so that the
    restored tasks inherit both. Done inside criu rather than in a preexec hook here, which
    would turn the vfork+exec of criu into a full fork of this (large) process: ~10 ms more
    per restore on a nested VM."""
    if cgroup_dirs:
        env = {**(env if env is not None else os.environ),
               "CRIU_ENTER_CGROUPS": ":".join(str(d) for d in cgroup_dirs)}
    t0 = time.monotonic()
    crash_timer = faults.crash_soon(crash) if crash is not None else None
    try:
        done = await process.run([str(criu), *args], env=env, pass_fds=pass_fds,
                                 timeout=CRIU_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as exc:
        raise AenvError(ErrorCode.INTERNAL, f"{what}: cannot start criu: {exc}") from None
    except TimeoutError:
        raise AenvError(ErrorCode.TIMEOUT, f"{what}: criu did not finish in "
                        f"{CRIU_TIMEOUT_S:.0f} s and was killed (log {log}):\n"
                        f"{_log_tail(log)}") from None
    finally:
        if crash_timer is not None:
            crash_timer.cancel()
    if done.returncode != 0:
        msg = done.output.decode(errors="replace").strip()[-500:]
        raise AenvError(ErrorCode.INTERNAL,
                        f"{what} failed (criu exit {done.returncode}; log {log}):\n"
                        f"{_log_tail(log)}" + (f"\n{msg}" if msg else ""))
    return time.monotonic() - t0


# --------------------------------------------------------------------------- freezer


def _freezer_state(freezer: Path) -> str:
    return (freezer / "freezer.state").read_text().strip()


async def freeze(freezer: Path, timeout: float = 10.0) -> None:
    """Freeze every task of a v1 freezer cgroup; returns once they all are."""
    (freezer / "freezer.state").write_text("FROZEN")
    deadline = time.monotonic() + timeout
    delay = 0.0002
    while _freezer_state(freezer) != "FROZEN":
        if time.monotonic() > deadline:
            with contextlib.suppress(OSError):
                (freezer / "freezer.state").write_text("THAWED")
            raise AenvError(ErrorCode.INTERNAL, f"cgroup {freezer} does not freeze")
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.01)


def thaw(freezer: Path) -> None:
    (freezer / "freezer.state").write_text("THAWED")


# --------------------------------------------------------------------------- files


async def prepare_workspace(workspace: Path) -> None:
    """A new workspace for a restore, with an empty `upper` and `work`: a btrfs subvolume
    where the filesystem is btrfs, so that its upper can be sealed in O(1) later. The image's
    own writable layer is not copied: the caller stacks it, sealed, under the new upper as a
    read-only lower layer."""
    if workspace.exists():
        raise AenvError(ErrorCode.CONFLICT, f"workspace {workspace} is in use")

    def make() -> None:
        workspace.parent.mkdir(parents=True, exist_ok=True)
        if linux.on_btrfs(str(workspace.parent)):
            linux.subvolume_create(str(workspace))
            workspace.chmod(0o755)
        else:
            workspace.mkdir(0o755)
        (workspace / "upper").mkdir(0o755)
        (workspace / "work").mkdir(0o755)

    await asyncio.to_thread(make)


def seal_layer(images_dir: Path) -> Path | None:
    """The directory a snapshot sealed its writable layer into (`<images>/sealed`, the
    layer itself is its `upper`), or None if it holds none."""
    path = images_dir / SEALED
    return path if (path / "upper").is_dir() else None


# --------------------------------------------------------------------------- cgroups


def create_cgroups(layout: cgroups.CgroupLayout, sandbox_id: str, *, memory_mb: int,
                   cpu_count: int, pids_max: int) -> list[Path]:
    """The cgroup set of a sandbox made by restore (what the fork-server does for a create):
    device rules and limits. Returns the directories to give `restore(cgroup_dirs=...)`.
    Blocking (a few ms)."""
    cfg = layout.zygote_config()
    static: dict[str, list[tuple[str, str, bool]]] = cfg["static"]  # type: ignore[assignment]
    limits = layout.limits(memory_mb, cpu_count, pids_max)
    dirs = []
    for ctrl in cgroups.CONTROLLERS:
        path = layout.path(ctrl, sandbox_id)
        path.mkdir(mode=0o755)
        dirs.append(path)
        for file, value, required in [*static.get(ctrl, ()), *limits.get(ctrl, ())]:
            try:
                (path / file).write_text(value)
            except FileNotFoundError:
                if required:
                    raise
    return dirs


def cgroup_dirs(layout: cgroups.CgroupLayout, sandbox_id: str) -> list[Path]:
    """The existing cgroup set of `sandbox_id` (e.g. a paused sandbox's, for a resume)."""
    return [layout.path(ctrl, sandbox_id) for ctrl in cgroups.CONTROLLERS]


# --------------------------------------------------------------------------- dump


async def dump(init_pid: int, images_dir: Path, *, freezer: Path, leave_running: bool,
               upper: Path | None = None, bundle: Path = pybundle.BUNDLE_DIR,
               bundle_version: str | None = None, external_netns: bool = False,
               criu: Path = CRIU, crash: str | None = None,
               volumes: Sequence[str] = ()) -> DumpStats:
    """Checkpoint the sandbox whose PID 1 is `init_pid` (host pid) into `images_dir` (made
    if missing; must hold no image yet). `freezer`: the sandbox's v1 freezer cgroup.
    `volumes`: mount points (inside the sandbox) of volume bind mounts, left out of the
    image as external mounts (their data is never copied); `restore` needs their sources.

    leave_running=False (pause): CRIU kills the tree after the dump; the workspace's upper
    stays as it is and is reused by the resume.
    leave_running=True (snapshot): the tree keeps running. With `upper`, it is copied to
    `<images>/upper` while the tree is frozen, so that files and memory agree.
    external_netns: the sandbox's network namespace belongs to the host side (a network
    slot with a veth to the bridge): it is not dumped, and the restore must be given one.

    The cgroup is frozen by CRIU's pre-dump hook (after CRIU's own start-up, and without
    CRIU's 100 ms freezer polling) and thawed when CRIU is done, whatever happened: a failed
    dump leaves the sandbox running, a pause leaves an empty, thawed cgroup for the resume.
    """
    t0 = time.monotonic()
    if os.stat(f"/proc/{init_pid}/ns/user").st_ino != os.stat("/proc/self/ns/user").st_ino:
        raise AenvError(ErrorCode.NOT_SUPPORTED, USERNS_NOT_CHECKPOINTABLE)
    images_dir.mkdir(parents=True, exist_ok=True)
    if (images_dir / "inventory.img").exists():
        raise AenvError(ErrorCode.CONFLICT, f"{images_dir} already holds an image")
    log = images_dir / DUMP_LOG
    # The bundle files the tree has mapped: the version it started (or was restored) with.
    version = bundle_version or pybundle.bundle_id(bundle)
    if version is not None:
        (images_dir / BUNDLE_MARK).write_text(version)
    hook = images_dir / _HOOK
    hook.write_text(_HOOK_SCRIPT)
    hook.chmod(0o700)
    env = {**os.environ, "AENV_FREEZER": str(freezer),
           "AENV_MARKS": str(images_dir / _HOOK_MARKS),
           # Our CRIU patch (scripts/criu-aenv-fast.patch): run the hook for pre-dump only
           # (not twice more while the tree is frozen), and leave the parasite by stepping
           # syscalls (a hardware breakpoint costs ~20 ms under nested virtualisation).
           "CRIU_SCRIPT_ACTIONS": "pre-dump", "CRIU_NO_BREAKPOINTS": "1"}
    if upper is not None and leave_running:
        env |= {"AENV_UPPER": str(upper), "AENV_SEALED": str(images_dir / SEALED)}
        if upper.name == "upper" and linux.is_subvolume(str(upper.parent)) \
                and linux.on_btrfs(str(images_dir)):
            env["AENV_SEAL_SUBVOLUME"] = "1"
    args = ["dump", "-t", str(init_pid), "-D", str(images_dir), "-o", DUMP_LOG,
            "--external", f"mnt[{bundle}]:{BUNDLE_KEY}",
            # No network lock: the sandbox's TCP connections are closed at restore anyway
            # (--tcp-close), and locking and unlocking with nft cost ~15 ms per checkpoint.
            "--manage-cgroups=ignore", "--network-lock", "skip",
            "--freeze-cgroup", str(freezer), "--tcp-close",
            # A connection still in a listener's accept queue (a client's request arriving
            # at that moment: envd's health check, a proxied request) made the whole dump
            # fail ("In-flight connection"): it is dropped instead, and its client retries.
            "--skip-in-flight",
            "--action-script", str(hook)]
    if leave_running:
        args.append("--leave-running")
    if external_netns:
        inode = os.stat(f"/proc/{init_pid}/ns/net").st_ino
        args += ["--external", f"net[{inode}]:{NETNS_KEY}"]
        (images_dir / NETNS_MARK).touch()
    keys = {f"aenv-vol{i}": path for i, path in enumerate(volumes)}
    for key, path in keys.items():
        args += ["--external", f"mnt[{path}]:{key}"]
    if keys:
        (images_dir / VOLUMES_MARK).write_text(json.dumps(keys))
    try:
        criu_s = await _run_criu(args, log, f"criu dump of pid {init_pid}", criu, env=env,
                                 crash=crash)
    finally:
        with contextlib.suppress(OSError):
            thaw(freezer)
        thawed_at = time.time()
    marks = {}
    for line in (images_dir / _HOOK_MARKS).read_text().splitlines():
        key, _, value = line.partition(" ")
        marks[key] = float(value)
    hook.unlink()
    size = await asyncio.to_thread(apparent_bytes, images_dir)
    return DumpStats(frozen_s=thawed_at - marks["frozen"],
                     copy_s=marks.get("copied", marks["frozen"]) - marks["frozen"],
                     criu_s=criu_s, total_s=time.monotonic() - t0, image_bytes=size, log=log)


# --------------------------------------------------------------------------- restore


def mount_root(workspace: Path, lower: Sequence[Path]) -> Path:
    """Mount the sandbox's overlay root (lowerdirs top first, `<workspace>/upper`,
    `<workspace>/work`) at `<workspace>/rootfs`, private. Blocking."""
    target = workspace / ROOTFS
    target.mkdir(exist_ok=True)
    linux.mount_overlay(str(target), ":".join(str(p) for p in lower), str(workspace / "upper"),
                        str(workspace / "work"))
    try:
        linux.mount(None, str(target), None, linux.MS_PRIVATE)
    except OSError:
        linux.umount2(str(target), linux.MNT_DETACH)
        raise
    return target


def unmount_root(workspace: Path) -> None:
    """Detach `<workspace>/rootfs` if mounted and remove it. Idempotent; blocking. The
    driver calls it before removing a workspace a restore used."""
    target = workspace / ROOTFS
    for _ in range(8):  # stacked mounts (a retried restore)
        try:
            linux.umount2(str(target), linux.MNT_DETACH)
        except OSError:
            break
    with contextlib.suppress(OSError):
        target.rmdir()


async def restore(images_dir: Path, *, workspace: Path, lower: Sequence[Path],
                  cgroup_dirs: Sequence[Path], envd_port: int = 49983,
                  netns: Path | None = None, lazy: bool = False,
                  bundle: Path = pybundle.BUNDLE_DIR, ready_timeout: float = 30.0,
                  criu: Path = CRIU, crash: str | None = None,
                  volumes: dict[str, Path] | None = None) -> RestoreResult:
    """Bring back the tree saved in `images_dir` with its root overlay on `lower` +
    `<workspace>/upper` (+ `/work`), its tasks in `cgroup_dirs` (which must exist), in the
    network namespace `netns` (a file such as a network slot's /run/aenv/netns/<slot>;
    None: a fresh loopback-only one made by CRIU). lazy: memory pages are served on demand
    by a `criu lazy-pages` daemon (it exits by itself once every page is pushed).

    `volumes` (mount point -> host directory) must name every volume the image left out
    (`image_volumes`); more are ignored (the caller mounts them once the tree runs).

    Returns once envd answers on `envd_port` inside the restored network namespace.
    """
    bundle, bundle_version = _bundle_of(images_dir, bundle)
    externals: list[str] = []
    for key, path in image_volumes(images_dir).items():
        source = (volumes or {}).get(path)
        if source is None:
            raise AenvError(ErrorCode.INVALID_ARGUMENT,
                            f"{images_dir} has a volume mounted at {path}: the restore must "
                            "mount a volume there")
        externals += ["--external", f"mnt[{key}]:{source}"]
    t0 = time.monotonic()
    timings: dict[str, float] = {}
    work = workspace / WORKDIR
    if work.exists():
        await asyncio.to_thread(shutil.rmtree, work, True)
    work.mkdir(parents=True)
    (workspace / "work").mkdir(exist_ok=True)
    pidfile = work / "pid"
    log = work / RESTORE_LOG
    try:
        await asyncio.to_thread(mount_root, workspace, lower)
    except OSError as exc:
        raise AenvError(ErrorCode.INTERNAL, f"restore: overlay root in {workspace}: {exc}"
                        ) from None
    timings["mount"] = time.monotonic() - t0
    args = ["restore", "-d", "-D", str(images_dir), "-W", str(work), "-o", RESTORE_LOG,
            "--root", str(workspace / ROOTFS), "--pidfile", str(pidfile),
            "--external", f"mnt[{BUNDLE_KEY}]:{bundle}", *externals,
            "--manage-cgroups=ignore", "--tcp-close", "--network-lock", "skip"]
    netns_fd: int | None = None
    if (images_dir / NETNS_MARK).exists():
        # The image left its network namespace out: hand CRIU the one to use instead.
        if netns is None:
            raise AenvError(ErrorCode.INVALID_ARGUMENT,
                            f"{images_dir} was taken with an external network namespace; "
                            "the restore needs one")
        netns_fd = os.open(netns, os.O_RDONLY)
        args += ["--inherit-fd", f"fd[{netns_fd}]:{NETNS_KEY}"]
    elif netns is not None:
        args += ["--join-ns", f"net:{netns}"]
    daemon: asyncio.subprocess.Process | None = None
    try:
        try:
            if lazy:
                daemon = await _start_lazy_daemon(images_dir, work, criu)
                args.append("--lazy-pages")
                timings["lazy_daemon"] = time.monotonic() - t0 - timings["mount"]
            timings["criu"] = await _run_criu(args, log, f"criu restore of {images_dir}", criu,
                                              cgroup_dirs, pass_fds=(() if netns_fd is None
                                                                     else (netns_fd,)),
                                              crash=crash)
        finally:
            if netns_fd is not None:
                os.close(netns_fd)
            # The restored mount namespace keeps the overlay alive on its own.
            await asyncio.to_thread(unmount_root, workspace)
        pid = int(pidfile.read_text().split()[0])
        start_time = linux.proc_start_time(pid)
        if start_time is None:
            raise AenvError(ErrorCode.INTERNAL, f"restored init {pid} exited at once (log {log})")
        t_ready = time.monotonic()
        await wait_ready(pid, envd_port, timeout=ready_timeout)
    except BaseException:
        if daemon is not None and daemon.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                daemon.kill()
            await daemon.wait()
        raise
    timings["ready"] = time.monotonic() - t_ready
    timings["total"] = time.monotonic() - t0
    return RestoreResult(pid=pid, start_time=start_time, timings=timings, log=log,
                         bundle_version=bundle_version, lazy_daemon=daemon)


def image_volumes(images_dir: Path) -> dict[str, str]:
    """The volume mounts an image left out: --external key -> mount point in the sandbox."""
    try:
        raw = json.loads((images_dir / VOLUMES_MARK).read_text())
    except FileNotFoundError:
        return {}
    return {str(k): str(v) for k, v in raw.items()}


def _bundle_of(images_dir: Path, current: Path) -> tuple[Path, str | None]:
    """The runtime bundle an image must be restored with, and its version: the version its
    processes had mapped (the current one, or one a rebuild archived)."""
    try:
        version = (images_dir / BUNDLE_MARK).read_text().strip()
    except FileNotFoundError:
        return current, None  # an image from before bundles were versioned
    found = pybundle.resolve(version, current)
    if found is None:
        raise AenvError(ErrorCode.UNAVAILABLE,
                        f"{images_dir} was taken with runtime bundle {version}, which is no "
                        f"longer installed (expected {pybundle.archived(current, version)})")
    return found, version


async def _start_lazy_daemon(images_dir: Path, work: Path, criu: Path
                             ) -> asyncio.subprocess.Process:
    log = work / "lazy-pages.log"
    proc = await asyncio.create_subprocess_exec(
        str(criu), "lazy-pages", "-D", str(images_dir), "-W", str(work),
        "-o", "lazy-pages.log", stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    sock = work / "lazy-pages.socket"
    deadline = time.monotonic() + 10
    while not sock.exists():
        if proc.returncode is not None or time.monotonic() > deadline:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()
            raise AenvError(ErrorCode.INTERNAL,
                            f"criu lazy-pages did not start (log {log}):\n{_log_tail(log)}")
        await asyncio.sleep(0.001)
    return proc


async def wait_ready(pid: int, port: int, timeout: float = 30.0) -> None:
    """Until envd (pid `pid`'s network namespace, 127.0.0.1:`port`) answers GET /health."""
    deadline = time.monotonic() + timeout
    last = ""
    delay = 0.001
    while True:
        try:
            sock = _socket_in_netns(pid)
        except OSError as exc:
            raise AenvError(ErrorCode.UNAVAILABLE, f"restored sandbox {pid} is gone: {exc}"
                            ) from None
        try:
            loop = asyncio.get_running_loop()
            async with asyncio.timeout(max(deadline - time.monotonic(), 0.01)):
                await loop.sock_connect(sock, ("127.0.0.1", port))
                await loop.sock_sendall(
                    sock, b"GET /health HTTP/1.1\r\nHost: envd\r\nConnection: close\r\n\r\n")
                reply = await loop.sock_recv(sock, 64)
            if reply.startswith(b"HTTP/1.1 2"):
                return
            last = repr(reply[:64])
        except (OSError, TimeoutError) as exc:
            last = str(exc) or type(exc).__name__
        finally:
            sock.close()
        if time.monotonic() > deadline:
            raise AenvError(ErrorCode.TIMEOUT,
                            f"restored envd (pid {pid}) not ready on :{port}: {last}")
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.05)


def _socket_in_netns(pid: int) -> socket.socket:
    """A non-blocking TCP socket created in `pid`'s network namespace (setns of this thread
    and back, with no await in between)."""
    host = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        target = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            linux.setns(target, linux.CLONE_NEWNET)
            try:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            finally:
                linux.setns(host, linux.CLONE_NEWNET)
        finally:
            os.close(target)
    finally:
        os.close(host)
    sock.setblocking(False)
    return sock
