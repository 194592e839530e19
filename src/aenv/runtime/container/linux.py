"""Thin ctypes wrappers over the Linux syscalls the container driver needs and python 3.11
lacks: unshare, setns, mount, umount2, pivot_root, open_tree/move_mount, sethostname,
close_range, prctl, plus small /proc helpers.

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

# x86_64 syscall numbers (the only architecture the bundle is built for).
_SYS_PIVOT_ROOT = 155
_SYS_OPEN_TREE = 428
_SYS_MOVE_MOUNT = 429
_SYS_CLOSE_RANGE = 436
_SYS_MOUNT_SETATTR = 442

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


def mount_setattr_fd(fd: int, attr_set: int, recursive: bool = True) -> None:
    attr = _MountAttr(attr_set, 0, 0, 0)
    flags = AT_EMPTY_PATH | (AT_RECURSIVE if recursive else 0)
    _check(_libc.syscall(_SYS_MOUNT_SETATTR, ctypes.c_int(fd), b"", ctypes.c_uint(flags),
                         ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr))),
           "mount_setattr")


def move_mount_fd(fd: int, target: str) -> None:
    _check(_libc.syscall(_SYS_MOVE_MOUNT, ctypes.c_int(fd), b"", ctypes.c_int(-100),
                         _b(target), ctypes.c_uint(MOVE_MOUNT_F_EMPTY_PATH)),
           f"move_mount to {target}")


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
