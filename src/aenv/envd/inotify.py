"""Directory watching with Linux inotify, through ctypes (the stdlib has no binding).

Owns: one inotify descriptor per watch, read from the event loop; recursive watches that
add new subdirectories as they appear; translating inotify masks into envd's event types
the way Go's fsnotify does (CREATE for create/moved-to, RENAME for moved-from/move-self,
CHMOD for attrib, WRITE for modify, REMOVE for delete/delete-self). Event names are
relative to the watched directory. Every filesystem access of a watch (adding watches,
scanning new subdirectories, the callback's entry infos) happens inside `guard()`, so a
watch sees only what its user may read.

`ctypes` is imported on first use, so an envd that never watches a directory does not pay
for it (`server.preload()` imports it up front for a fork server).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import struct
from collections.abc import Callable
from typing import Any

from aenv.envd.log import log

IN_MODIFY = 0x2
IN_ATTRIB = 0x4
IN_MOVED_FROM = 0x40
IN_MOVED_TO = 0x80
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ONLYDIR = 0x01000000
IN_DONT_FOLLOW = 0x02000000
IN_ISDIR = 0x40000000
WATCH_MASK = (
    IN_MODIFY | IN_ATTRIB | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_DELETE_SELF | IN_MOVE_SELF
)

CREATE = "EVENT_TYPE_CREATE"
WRITE = "EVENT_TYPE_WRITE"
REMOVE = "EVENT_TYPE_REMOVE"
RENAME = "EVENT_TYPE_RENAME"
CHMOD = "EVENT_TYPE_CHMOD"

_EVENT = struct.Struct("iIII")
_libc: Any = None


def _lib() -> Any:
    global _libc
    if _libc is None:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.inotify_init1.argtypes = [ctypes.c_int]
        libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        libc.inotify_rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]
        _libc = (libc, ctypes.get_errno)
    return _libc


def preload() -> None:
    _lib()


# callback(name relative to the root, event type, absolute path)
Callback = Callable[[str, str, str], None]


class Watcher:
    def __init__(
        self,
        root: str,
        recursive: bool,
        callback: Callback,
        guard: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
    ) -> None:
        self.root = root
        self.recursive = recursive
        self._callback = callback
        self._guard = guard
        self._fd = -1
        self._dirs: dict[int, str] = {}
        self._loop = asyncio.get_running_loop()
        self._full_warned = False

    def start(self) -> None:
        libc, get_errno = _lib()
        fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            raise OSError(get_errno(), f"inotify_init1: {os.strerror(get_errno())}")
        self._fd = fd
        try:
            with self._guard():
                self._add(self.root, root=True)
                if self.recursive:
                    self._add_children(self.root, report=False)
        except BaseException:
            self.close()
            raise
        self._loop.add_reader(fd, self._readable)

    def close(self) -> None:
        if self._fd >= 0:
            self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = -1
            self._dirs.clear()

    def _add(self, path: str, root: bool = False) -> None:
        libc, get_errno = _lib()
        mask = WATCH_MASK if root else WATCH_MASK | IN_ONLYDIR | IN_DONT_FOLLOW
        wd = libc.inotify_add_watch(self._fd, os.fsencode(path), mask)
        if wd < 0:
            error = get_errno()
            if root:
                raise OSError(error, f"error adding path {path} to watcher: {os.strerror(error)}")
            if not self._full_warned:
                self._full_warned = True
                log(f"watch of {path} not added: {os.strerror(error)}")
            return
        self._dirs[wd] = path

    def _add_children(self, directory: str, report: bool) -> None:
        """Watch every directory below `directory`; report what a new directory already
        holds (it was filled before its watch existed, e.g. `mkdir -p a/b/c`)."""
        try:
            with os.scandir(directory) as it:
                children = list(it)
        except OSError:
            return
        for child in children:
            try:
                is_dir = stat.S_ISDIR(child.stat(follow_symlinks=False).st_mode)
            except OSError:
                continue
            if report:
                self._emit(child.path, [CREATE])
            if is_dir:
                self._add(child.path)
                self._add_children(child.path, report)

    def _readable(self) -> None:
        try:
            data = os.read(self._fd, 64 * 1024)
        except BlockingIOError:
            return
        except OSError as e:
            log(f"inotify read failed: {e}")
            return
        offset = 0
        with self._guard():
            while offset + _EVENT.size <= len(data):
                wd, mask, _cookie, length = _EVENT.unpack_from(data, offset)
                start = offset + _EVENT.size
                name = data[start : start + length].split(b"\0", 1)[0]
                offset = start + length
                self._event(wd, mask, os.fsdecode(name))

    def _event(self, wd: int, mask: int, name: str) -> None:
        if mask & IN_Q_OVERFLOW:
            log(f"inotify queue overflow while watching {self.root}: events were lost")
            return
        if mask & IN_IGNORED:
            self._dirs.pop(wd, None)
            return
        directory = self._dirs.get(wd)
        if directory is None:
            return
        if not name and directory != self.root:
            return  # a subdirectory's own delete/move; its parent's watch reports it
        full = os.path.join(directory, name) if name else directory
        ops = []
        if mask & (IN_CREATE | IN_MOVED_TO):
            ops.append(CREATE)
        if mask & (IN_MOVED_FROM | IN_MOVE_SELF):
            ops.append(RENAME)
        if mask & IN_ATTRIB:
            ops.append(CHMOD)
        if mask & IN_MODIFY:
            ops.append(WRITE)
        if mask & (IN_DELETE | IN_DELETE_SELF):
            ops.append(REMOVE)
        self._emit(full, ops)
        if self.recursive and mask & IN_ISDIR and name:
            if mask & (IN_CREATE | IN_MOVED_TO):
                self._add(full)
                self._add_children(full, report=bool(mask & IN_CREATE))
            elif mask & IN_MOVED_FROM:
                self._forget(full)

    def _forget(self, path: str) -> None:
        """Drop the watches of a subtree that moved away (its paths are stale now)."""
        libc, _ = _lib()
        prefix = path + "/"
        for wd, directory in list(self._dirs.items()):
            if directory == path or directory.startswith(prefix):
                libc.inotify_rm_watch(self._fd, wd)
                del self._dirs[wd]

    def _emit(self, full: str, ops: list[str]) -> None:
        if not ops:
            return
        name = os.path.relpath(full, self.root)
        for op in ops:
            self._callback(name, op, full)


_NETWORK_FS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "fuse", "fuseblk")


def is_network_mount(path: str) -> bool:
    """Whether `path` is on NFS, CIFS/SMB or FUSE (watching those is opt-in)."""
    try:
        real = os.path.realpath(path)
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return False
    best, fstype = "", ""
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields = left.split(" ")
        if not sep or len(fields) < 5:
            continue
        mount_point = fields[4].replace("\\040", " ")
        if (real == mount_point or real.startswith(mount_point.rstrip("/") + "/")) and len(mount_point) >= len(best):
            best, fstype = mount_point, right.split(" ", 1)[0]
    return fstype in _NETWORK_FS or fstype.startswith("fuse.")
