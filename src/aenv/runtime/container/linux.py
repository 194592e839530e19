"""Thin ctypes wrappers over the Linux syscalls the container driver needs and python 3.11
lacks: unshare, setns, mount, umount2, pivot_root, open_tree/move_mount, sethostname,
close_range, prctl, seccomp (loading a BPF program compiled elsewhere), plus small /proc
helpers.

Owns: nothing; pure functions that raise OSError with the right errno.
Must not touch: anything by itself. STDLIB ONLY: this module is copied into the runtime bundle
and runs in the fork-server and in every sandbox's init, as well as in the host driver.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import shutil
import socket
import struct

# <linux/sched.h>
CLONE_FS = 0x00000200
CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

# <linux/mount.h>
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MNT_DETACH = 2

OPEN_TREE_CLONE = 1
OPEN_TREE_CLOEXEC = os.O_CLOEXEC
AT_EMPTY_PATH = 0x1000
AT_RECURSIVE = 0x8000
MOVE_MOUNT_F_EMPTY_PATH = 0x4
MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4
MOUNT_ATTR_IDMAP = 0x00100000

# x86_64 syscall numbers (the only architecture the bundle is built for).
_SYS_PIVOT_ROOT = 155
_SYS_OPEN_TREE = 428
_SYS_MOVE_MOUNT = 429
_SYS_CLOSE_RANGE = 436
_SYS_MOUNT_SETATTR = 442
_SYS_SECCOMP = 317

# <linux/seccomp.h>
SECCOMP_SET_MODE_FILTER = 1
SECCOMP_FILTER_FLAG_TSYNC = 1

PR_SET_NAME = 15
PR_CAPBSET_DROP = 24
PR_SET_CHILD_SUBREAPER = 36

_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1
_IFF_RUNNING = 0x40

# dlopen(NULL): the libc already mapped into this process (the bundle's, inside sandboxes),
# so no new file gets mapped.
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.unshare.argtypes = [ctypes.c_int]
_libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
_libc.sethostname.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                        ctypes.c_ulong]


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def _b(path: str | None) -> bytes | None:
    return None if path is None else os.fsencode(path)


def unshare(flags: int) -> None:
    _check(_libc.unshare(flags), "unshare")


def setns(fd: int, nstype: int) -> None:
    _check(_libc.setns(fd, nstype), "setns")


def mount(source: str | None, target: str, fstype: str | None = None, flags: int = 0,
          data: str | None = None) -> None:
    _check(_libc.mount(_b(source), _b(target), _b(fstype), flags, _b(data)),
           f"mount {fstype or ''} {source} on {target}")


def mount_overlay(target: str, lower: str, upper: str, work: str) -> None:
    """A sandbox's overlay root, `volatile`: overlayfs then never syncs the upper filesystem,
    which it otherwise does for the whole filesystem (every sandbox's files) at each unmount,
    i.e. whenever a sandbox exits or is paused: 100-200 ms of writeback for a sandbox that
    holds 100 MiB, paid inside the pause, and one syncfs per sandbox killed. fsync inside a
    sandbox is a no-op too; a running sandbox does not survive the host anyway. What must
    survive (a paused sandbox) is synced explicitly. A volatile mount leaves
    <work>/work/incompat/volatile behind, and overlayfs refuses to mount that work dir again
    until it is gone (its flag for "the upper may not have survived a crash"): whoever mounts
    a workspace again knows its upper, so the flag goes first."""
    flag = os.path.join(work, "work", "incompat")
    if os.path.lexists(flag):
        shutil.rmtree(flag)
    mount("overlay", target, "overlay", 0,
          f"lowerdir={lower},upperdir={upper},workdir={work},volatile")


def syncfs(fd: int) -> None:
    """Write out everything dirty of the filesystem `fd` is on (Python's os has no syncfs)."""
    _check(_libc.syncfs(fd), "syncfs")


def umount2(target: str, flags: int = 0) -> None:
    _check(_libc.umount2(_b(target), flags), f"umount {target}")


def pivot_root(new_root: str, put_old: str) -> None:
    _check(_libc.syscall(_SYS_PIVOT_ROOT, _b(new_root), _b(put_old)), "pivot_root")


def open_tree(path: str, flags: int) -> int:
    """A detached clone of the mount at `path`, as an fd (new mount API, Linux >= 5.2)."""
    return _check(_libc.syscall(_SYS_OPEN_TREE, ctypes.c_int(-100), _b(path),
                                ctypes.c_uint(flags)), f"open_tree {path}")


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def mount_setattr_fd(fd: int, attr_set: int, recursive: bool = True,
                     userns_fd: int = 0) -> None:
    """Set attributes of the (detached) mount `fd`; with MOUNT_ATTR_IDMAP, `userns_fd` is a
    user namespace whose uid/gid maps the mount applies (an idmapped mount)."""
    attr = _MountAttr(attr_set, 0, 0, userns_fd)
    flags = AT_EMPTY_PATH | (AT_RECURSIVE if recursive else 0)
    _check(_libc.syscall(_SYS_MOUNT_SETATTR, ctypes.c_int(fd), b"", ctypes.c_uint(flags),
                         ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr))),
           "mount_setattr")


def idmapped_tree(path: str, userns_fd: int) -> int:
    """A detached clone of `path` (not recursive: layers are plain directories) whose
    owners are shifted by the maps of the user namespace `userns_fd`, read-only: an on-disk
    uid 0 shows as the kernel uid that namespace maps 0 to."""
    fd = open_tree(path, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC)
    try:
        mount_setattr_fd(fd, MOUNT_ATTR_IDMAP | MOUNT_ATTR_RDONLY, recursive=False,
                         userns_fd=userns_fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def move_mount_fd(fd: int, target: str) -> None:
    _check(_libc.syscall(_SYS_MOVE_MOUNT, ctypes.c_int(fd), b"", ctypes.c_int(-100),
                         _b(target), ctypes.c_uint(MOVE_MOUNT_F_EMPTY_PATH)),
           f"move_mount to {target}")


def mount_nosuid_nodev(path: str) -> bool:
    """Make `path` (a directory) be on a mount with nosuid and nodev: a setuid file or a
    device node below it is then inert when run or opened through it. Remounts `path` in
    place if it is a mountpoint, else bind-mounts it onto itself first (recursively, so
    mounts below stay visible). Other mount flags are kept. Returns whether it made a new
    mount (the caller detaches it with umount2(path, MNT_DETACH) when done); a no-op when
    the flags are already there. Needs root."""
    flags = os.statvfs(path).f_flag
    if flags & os.ST_NOSUID and flags & os.ST_NODEV:
        return False
    made = not os.path.ismount(path)
    if made:
        mount(path, path, None, MS_BIND | MS_REC)
    keep = (MS_RDONLY if flags & os.ST_RDONLY else 0) | (MS_NOEXEC if flags & os.ST_NOEXEC
                                                          else 0)
    try:
        mount(None, path, None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV | keep)
    except BaseException:
        if made:
            umount2(path, MNT_DETACH)
        raise
    return made


def sethostname(name: str) -> None:
    raw = name.encode()
    _check(_libc.sethostname(raw, len(raw)), "sethostname")


def close_range(first: int, last: int = 0xFFFFFFFF) -> None:
    """Close fds first..last (inclusive) in one syscall, however many are open."""
    if first > last:
        return
    _check(_libc.syscall(_SYS_CLOSE_RANGE, ctypes.c_uint(first), ctypes.c_uint(last),
                         ctypes.c_uint(0)), "close_range")


def close_fds_except(keep: set[int], first: int = 3) -> None:
    start = first
    for fd in sorted(k for k in keep if k >= first):
        close_range(start, fd - 1)
        start = fd + 1
    close_range(start)


def prctl(option: int, arg2: int = 0) -> None:
    _check(_libc.prctl(option, arg2, 0, 0, 0), f"prctl {option}")


def set_comm(name: str) -> None:
    buf = ctypes.create_string_buffer(name.encode()[:15])
    _check(_libc.prctl(PR_SET_NAME, ctypes.cast(buf, ctypes.c_void_p).value or 0, 0, 0, 0),
           "prctl PR_SET_NAME")


def drop_bounding_caps(keep: set[int]) -> None:
    """Remove every capability not in `keep` from the bounding set: programs executed later
    (even setuid root ones) can never gain them."""
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for cap in range(last + 1):
        if cap not in keep:
            prctl(PR_CAPBSET_DROP, cap)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class SeccompProgram:
    """A seccomp BPF program (struct sock_filter[], as libseccomp's export_bpf writes it),
    laid out for the seccomp syscall once: the fork-server builds it, each sandbox child only
    makes the syscall (no allocation there, whose copy-on-write faults cost a fresh fork
    about as much as the kernel's own work, ~0.15 ms)."""

    def __init__(self, program: bytes) -> None:
        if not program or len(program) % 8:
            raise OSError(errno.EINVAL, f"seccomp: a BPF program of {len(program)} bytes")
        self._buf = ctypes.create_string_buffer(program, len(program))
        self._prog = _SockFprog(len(program) // 8, ctypes.cast(self._buf, ctypes.c_void_p).value)
        self._args = (ctypes.c_uint(SECCOMP_SET_MODE_FILTER),
                      ctypes.c_uint(SECCOMP_FILTER_FLAG_TSYNC), ctypes.byref(self._prog))

    def load(self) -> None:
        """Install the filter on the calling process, every thread of it (TSYNC), and
        everything it forks or executes from now on; it can never be removed. Needs
        CAP_SYS_ADMIN (or no_new_privs, which we do not set: setuid programs such as sudo
        keep working)."""
        _check(_libc.syscall(_SYS_SECCOMP, *self._args), "seccomp")


def load_seccomp(program: bytes) -> None:
    """SeccompProgram(program).load()."""
    SeccompProgram(program).load()


def interface_up(name: str = "lo") -> None:
    """Set IFF_UP on an interface of the caller's network namespace (an ioctl, no netlink)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14x", name.encode(), 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s.fileno(), _SIOCSIFFLAGS,
                    struct.pack("16sH14x", name.encode(), flags | _IFF_UP | _IFF_RUNNING))


def proc_start_time(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot (field 22 of /proc/PID/stat), or None if
    the process is gone or a zombie. With the pid it identifies a process across pid reuse."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError as exc:
        if exc.errno in (errno.ESRCH, errno.ENOENT):
            return None
        raise
    fields = raw[raw.rindex(b")") + 2:].split()
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


# --------------------------------------------------------------------------- btrfs
# <linux/btrfs.h>: a writable layer that is a btrfs subvolume can be sealed into a read-only
# snapshot in O(1) (no data or metadata copied), which is how snapshots and forks share it.
BTRFS_SUPER_MAGIC = 0x9123683E
_BTRFS_IOC_SUBVOL_CREATE = (1 << 30) | (4096 << 16) | (0x94 << 8) | 14
_BTRFS_IOC_SNAP_DESTROY = (1 << 30) | (4096 << 16) | (0x94 << 8) | 15
_BTRFS_IOC_SNAP_CREATE_V2 = (1 << 30) | (4096 << 16) | (0x94 << 8) | 23
_BTRFS_SUBVOL_RDONLY = 1 << 1
_BTRFS_FIRST_FREE_OBJECTID = 256  # the inode number of every subvolume's root directory


class _Statfs(ctypes.Structure):
    _fields_ = [("f_type", ctypes.c_long), ("f_bsize", ctypes.c_long),
                ("f_blocks", ctypes.c_ulong), ("f_bfree", ctypes.c_ulong),
                ("f_bavail", ctypes.c_ulong), ("f_files", ctypes.c_ulong),
                ("f_ffree", ctypes.c_ulong), ("f_fsid", ctypes.c_int * 2),
                ("f_namelen", ctypes.c_long), ("f_frsize", ctypes.c_long),
                ("f_flags", ctypes.c_long), ("f_spare", ctypes.c_long * 4)]


def fs_type(path: str) -> int:
    """statfs(2) f_type of the filesystem holding `path` (e.g. BTRFS_SUPER_MAGIC)."""
    buf = _Statfs()
    _check(_libc.statfs(_b(path), ctypes.byref(buf)), f"statfs {path}")
    return int(buf.f_type) & 0xFFFFFFFF


def on_btrfs(path: str) -> bool:
    return fs_type(path) == BTRFS_SUPER_MAGIC


def is_subvolume(path: str) -> bool:
    st = os.lstat(path)
    return st.st_ino == _BTRFS_FIRST_FREE_OBJECTID and on_btrfs(path)


def _vol_args(name: str, fd: int = 0) -> bytearray:
    """struct btrfs_ioctl_vol_args {s64 fd; char name[4088];}"""
    raw = os.fsencode(name)
    if b"/" in raw or len(raw) > 4087:
        raise OSError(errno.EINVAL, f"bad subvolume name {name!r}")
    return bytearray(struct.pack("q4088s", fd, raw))


def _on_parent(path: str, request: int, build: object) -> None:
    parent = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.ioctl(parent, request, build(os.path.basename(path)))  # type: ignore[operator]
    finally:
        os.close(parent)


def subvolume_create(path: str) -> None:
    """mkdir, but the new directory is a btrfs subvolume (so it can be snapshotted)."""
    _on_parent(path, _BTRFS_IOC_SUBVOL_CREATE, _vol_args)


def subvolume_snapshot(source: str, dest: str, readonly: bool = True) -> None:
    """A snapshot of the subvolume `source` at the new path `dest` (same filesystem)."""
    src = os.open(source, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        flags = _BTRFS_SUBVOL_RDONLY if readonly else 0

        def args(name: str) -> bytearray:
            # struct btrfs_ioctl_vol_args_v2 {s64 fd; u64 transid, flags; u64 unused[4];
            # char name[4040];}
            raw = os.fsencode(name)
            if b"/" in raw or len(raw) > 4039:
                raise OSError(errno.EINVAL, f"bad snapshot name {name!r}")
            return bytearray(struct.pack("qQQ32x4040s", src, 0, flags, raw))

        _on_parent(dest, _BTRFS_IOC_SNAP_CREATE_V2, args)
    finally:
        os.close(src)


def subvolume_delete(path: str) -> None:
    """Delete the subvolume at `path` with everything in it (also a read-only one)."""
    _on_parent(path, _BTRFS_IOC_SNAP_DESTROY, _vol_args)


# btrfs quota groups: every subvolume has one (0/<subvolume id>). With *simple* quotas
# (kernel >= 6.7) an extent is charged once, to the subvolume that wrote it, so a snapshot
# costs nothing (unlike full qgroups, which walk backrefs to share charges). A sandbox's
# workspace is a subvolume: its qgroup limit is the sandbox's disk size.
_BTRFS_IOC_QUOTA_CTL = (3 << 30) | (16 << 16) | (0x94 << 8) | 40  # _IOWR(.., 40, 16 bytes)
_BTRFS_IOC_QGROUP_LIMIT = (2 << 30) | (48 << 16) | (0x94 << 8) | 43  # _IOR(.., 43, 48 bytes)
_BTRFS_QUOTA_CTL_ENABLE_SIMPLE_QUOTA = 4
_BTRFS_QGROUP_LIMIT_MAX_RFER = 1
_BTRFS_QGROUP_LIMIT_MAX_EXCL = 2


def btrfs_enable_simple_quota(path: str) -> None:
    """Turn on simple quotas for the btrfs filesystem holding `path`. Idempotent: a no-op
    when quotas (simple or full) are on already. EINVAL on kernels without simple quotas."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        # struct btrfs_ioctl_quota_ctl_args {u64 cmd; u64 status;}
        fcntl.ioctl(fd, _BTRFS_IOC_QUOTA_CTL,
                    bytearray(struct.pack("QQ", _BTRFS_QUOTA_CTL_ENABLE_SIMPLE_QUOTA, 0)))
    finally:
        os.close(fd)


def subvolume_limit(path: str, max_bytes: int | None) -> None:
    """Limit what the subvolume `path` may hold (its quota group's referenced and exclusive
    bytes; equal under simple quotas); None removes the limit. Writes past it fail with
    EDQUOT. Needs quotas on (btrfs_enable_simple_quota)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        # struct btrfs_ioctl_qgroup_limit_args {u64 qgroupid; struct btrfs_qgroup_limit
        # {u64 flags, max_rfer, max_excl, rsv_rfer, rsv_excl;}}; qgroupid 0 = fd's subvolume.
        flags = _BTRFS_QGROUP_LIMIT_MAX_RFER | _BTRFS_QGROUP_LIMIT_MAX_EXCL
        limit = max_bytes if max_bytes is not None else 2**64 - 1
        fcntl.ioctl(fd, _BTRFS_IOC_QGROUP_LIMIT,
                    bytearray(struct.pack("QQQQQQ", 0, flags, limit, limit, 0, 0)))
    finally:
        os.close(fd)

