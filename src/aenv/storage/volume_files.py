"""File operations of the volume content API on a volume's directory, safe against what
sandboxes leave there.

A volume is written by hostile sandboxes: its tree may hold symlinks to anywhere (`/etc`,
`/proc/1/root`) and change while we walk it. The server runs as root, so every path is
resolved with `openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV)` against the
volume's root directory fd: `..` and absolute symlinks stay inside the volume, /proc magic
links and other mounts are refused. Operations on a final component (create, mkdir, remove,
chown) act on its parent directory's fd with the last name, never following it.

Paths are the API's: absolute inside the volume (`/a/b.txt`), `/` its root.
Owns nothing; blocking calls (the API runs them in threads).
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from aenv.errors import AenvError, ErrorCode, invalid, not_found

_SYS_OPENAT2 = 437
RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_IN_ROOT = 0x10
_RESOLVE = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV
_libc = ctypes.CDLL(None, use_errno=True)
MAX_DEPTH = 16
MAX_ENTRIES = 100_000  # one listing answer
DEFAULT_UID = DEFAULT_GID = 1000  # the sandbox's default user, as the volume root


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]


def openat2(dirfd: int, path: str, flags: int, mode: int = 0, resolve: int = _RESOLVE) -> int:
    how = _OpenHow(flags | os.O_CLOEXEC, mode, resolve)
    while True:
        fd = _libc.syscall(_SYS_OPENAT2, ctypes.c_int(dirfd), os.fsencode(path),
                           ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)))
        if fd >= 0:
            return int(fd)
        err = ctypes.get_errno()
        if err != errno.EAGAIN:  # EAGAIN: a rename raced the resolution; try again
            raise OSError(err, os.strerror(err), path)


def normalize(path: str) -> str:
    """`path` as `/a/b` (no empty, `.` or `..` components); INVALID_ARGUMENT otherwise."""
    if "\0" in path or len(path) > 4096:
        raise invalid("path: not a usable path")
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if any(p == ".." for p in parts):
        raise invalid(f"path {path!r}: '..' is not allowed")
    return "/" + "/".join(parts)


def _errno_error(exc: OSError, path: str) -> AenvError:
    if exc.errno in (errno.ENOENT, errno.ENOTDIR):
        return not_found(f"path {path} not found")
    if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
        return AenvError(ErrorCode.CONFLICT, f"path {path}: {exc.strerror}")
    if exc.errno in (errno.EDQUOT, errno.ENOSPC):
        return AenvError(ErrorCode.RESOURCE_EXHAUSTED, f"path {path}: the volume is full")
    if exc.errno in (errno.EXDEV, errno.ELOOP, errno.EISDIR, errno.EINVAL, errno.ENAMETOOLONG):
        return invalid(f"path {path}: {exc.strerror}")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return AenvError(ErrorCode.CONFLICT, f"path {path}: {exc.strerror}")
    return AenvError(ErrorCode.INTERNAL, f"path {path}: {exc}")


def _ts(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat().replace("+00:00", "Z")


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "unknown"


@dataclass(frozen=True)
class Entry:
    name: str
    path: str
    st: os.stat_result
    target: str | None = None

    def to_json(self) -> dict[str, Any]:
        st = self.st
        body: dict[str, Any] = {
            "name": self.name, "type": _kind(st.st_mode), "path": self.path,
            "size": st.st_size, "mode": stat.S_IMODE(st.st_mode), "uid": st.st_uid,
            "gid": st.st_gid, "atime": _ts(st.st_atime), "mtime": _ts(st.st_mtime),
            "ctime": _ts(st.st_ctime)}
        if self.target is not None:
            body["target"] = self.target
        return body


class VolumeFiles:
    """The files of one volume, rooted at `root` (its data directory)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _root_fd(self) -> int:
        return os.open(self.root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)

    def _parent(self, root: int, path: str, create: bool = False,
                uid: int | None = None, gid: int | None = None) -> tuple[int, str]:
        """An fd of `path`'s parent directory (made, with its parents, if `create`) and the
        last name; the caller closes the fd."""
        parts = path.strip("/").split("/")
        if parts == [""]:
            raise invalid("path: the volume's root has no parent")
        if len(parts) == 1:
            return os.dup(root), parts[0]
        try:
            # Resolved from the volume's root as a whole: a symlink in it means what it
            # would mean inside a sandbox that mounts the volume at /.
            return openat2(root, "/".join(parts[:-1]), os.O_PATH | os.O_DIRECTORY), parts[-1]
        except FileNotFoundError:
            if not create:
                raise
        fd = os.dup(root)
        try:
            for i, part in enumerate(parts[:-1]):
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                    os.chown(part, DEFAULT_UID if uid is None else uid,
                             DEFAULT_GID if gid is None else gid, dir_fd=fd,
                             follow_symlinks=False)
                except FileExistsError:
                    pass
                nxt = openat2(root, "/".join(parts[:i + 1]), os.O_PATH | os.O_DIRECTORY)
                os.close(fd)
                fd = nxt
        except BaseException:
            os.close(fd)
            raise
        return fd, parts[-1]

    def _entry(self, dir_fd: int, name: str, path: str) -> Entry:
        with _dir_fd(dir_fd) as real:
            st = os.stat(name, dir_fd=real, follow_symlinks=False)
            target = os.readlink(name, dir_fd=real) if stat.S_ISLNK(st.st_mode) else None
        return Entry(name, path, st, target)

    # -- operations ----------------------------------------------------------------------
    def stat(self, path: str) -> Entry:
        path = normalize(path)
        root = self._root_fd()
        try:
            if path == "/":
                return Entry("", "/", os.stat(root))
            parent, name = self._parent(root, path)
            try:
                return self._entry(parent, name, path)
            finally:
                os.close(parent)
        except OSError as exc:
            raise _errno_error(exc, path) from None
        finally:
            os.close(root)

    def list_dir(self, path: str, depth: int = 1) -> list[Entry]:
        if not 1 <= depth <= MAX_DEPTH:
            raise invalid(f"depth must be between 1 and {MAX_DEPTH}")
        path = normalize(path)
        root = self._root_fd()
        try:
            start = root if path == "/" else openat2(root, path.lstrip("/"),
                                                     os.O_RDONLY | os.O_DIRECTORY)
            out: list[Entry] = []
            try:
                self._walk(start, path, depth, out)
            finally:
                if start != root:
                    os.close(start)
            return out
        except OSError as exc:
            raise _errno_error(exc, path) from None
        finally:
            os.close(root)

    def _walk(self, fd: int, path: str, depth: int, out: list[Entry]) -> None:
        with _dir_fd(fd) as real:
            names = sorted(os.listdir(real))
        for name in names:
            child = ("" if path == "/" else path) + "/" + name
            try:
                entry = self._entry(fd, name, child)
            except FileNotFoundError:
                continue  # removed meanwhile
            out.append(entry)
            if len(out) > MAX_ENTRIES:
                raise AenvError(ErrorCode.RESOURCE_EXHAUSTED,
                                f"listing {path}: more than {MAX_ENTRIES} entries")
            if depth > 1 and stat.S_ISDIR(entry.st.st_mode):
                try:
                    sub = openat2(fd, name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
                except OSError:
                    continue
                try:
                    self._walk(sub, child, depth - 1, out)
                finally:
                    os.close(sub)

    def mkdir(self, path: str, uid: int | None, gid: int | None, mode: int | None,
              parents: bool) -> Entry:
        path = normalize(path)
        root = self._root_fd()
        try:
            parent, name = self._parent(root, path, create=parents, uid=uid, gid=gid)
            try:
                with _dir_fd(parent) as real:
                    try:
                        os.mkdir(name, 0o755 if mode is None else mode & 0o7777, dir_fd=real)
                    except FileExistsError:
                        if not parents:
                            raise
                        st = os.stat(name, dir_fd=real, follow_symlinks=False)
                        if not stat.S_ISDIR(st.st_mode):
                            raise
                        return self._entry(parent, name, path)
                    os.chown(name, DEFAULT_UID if uid is None else uid,
                             DEFAULT_GID if gid is None else gid, dir_fd=real,
                             follow_symlinks=False)
                    if mode is not None:
                        os.chmod(name, mode & 0o7777, dir_fd=real)  # past the umask
                return self._entry(parent, name, path)
            finally:
                os.close(parent)
        except OSError as exc:
            raise _errno_error(exc, path) from None
        finally:
            os.close(root)

    def open_write(self, path: str, uid: int | None, gid: int | None, mode: int | None,
                   parents: bool) -> tuple[int, str]:
        """A new (or truncated) regular file, opened for writing: (fd, normalised path).
        Writing and closing are the caller's (`finish_write`)."""
        path = normalize(path)
        root = self._root_fd()
        try:
            parent, name = self._parent(root, path, create=parents, uid=uid, gid=gid)
            try:
                fd = openat2(parent, name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW,
                             0o644 if mode is None else mode & 0o7777)
            finally:
                os.close(parent)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise OSError(errno.EINVAL, "not a regular file")
                os.fchown(fd, DEFAULT_UID if uid is None else uid,
                          DEFAULT_GID if gid is None else gid)
                if mode is not None:
                    os.fchmod(fd, mode & 0o7777)
            except BaseException:
                os.close(fd)
                raise
            return fd, path
        except OSError as exc:
            raise _errno_error(exc, path) from None
        finally:
            os.close(root)

    @staticmethod
    def write_chunk(fd: int, data: bytes, path: str) -> None:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except OSError as exc:
            raise _errno_error(exc, path) from None

    def finish_write(self, fd: int, path: str) -> Entry:
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        return Entry(path.rsplit("/", 1)[-1], path, st)

    def open_read(self, path: str) -> tuple[int, int]:
        """A regular file opened for reading: (fd, size)."""
        path = normalize(path)
        root = self._root_fd()
        try:
            # A final symlink is followed too: resolved inside the volume like the rest.
            fd = openat2(root, path.lstrip("/"), os.O_RDONLY)
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                os.close(fd)
                raise OSError(errno.EISDIR if stat.S_ISDIR(st.st_mode) else errno.EINVAL,
                              "not a regular file")
            return fd, st.st_size
        except OSError as exc:
            raise _errno_error(exc, path) from None
        finally:
            os.close(root)

    def remove(self, path: str) -> None:
        path = normalize(path)
        if path == "/":
            raise invalid("path: the volume's root cannot be removed")
        root = self._root_fd()
        try:
            parent, name = self._parent(root, path)
            try:
                with _dir_fd(parent) as real:
                    st = os.stat(name, dir_fd=real, follow_symlinks=False)
                    if stat.S_ISDIR(st.st_mode):
                        # fd-based: symlinks inside are removed, never followed.
                        shutil.rmtree(name, dir_fd=real)
                    else:
                        os.unlink(name, dir_fd=real)
            finally:
                os.close(parent)
        except OSError as exc:
            raise _errno_error(exc, path) from None
        finally:
            os.close(root)

    def set_metadata(self, path: str, uid: int | None, gid: int | None,
                     mode: int | None) -> Entry:
        path = normalize(path)
        root = self._root_fd()
        try:
            if path == "/":
                parent, name = os.dup(root), "."
            else:
                parent, name = self._parent(root, path)
            try:
                with _dir_fd(parent) as real:
                    st = os.stat(name, dir_fd=real, follow_symlinks=False)
                    if uid is not None or gid is not None:
                        os.chown(name, -1 if uid is None else uid, -1 if gid is None else gid,
                                 dir_fd=real, follow_symlinks=False)
                    if mode is not None:
                        if stat.S_ISLNK(st.st_mode):
                            raise OSError(errno.EINVAL, "a symlink has no mode of its own")
                        os.chmod(name, mode & 0o7777, dir_fd=real)
                entry = self._entry(parent, name, path)
                return Entry(path.rsplit("/", 1)[-1], path, entry.st, entry.target)
            finally:
                os.close(parent)
        except OSError as exc:
            raise _errno_error(exc, path) from None
        finally:
            os.close(root)


class _dir_fd:  # a context manager used like a function
    """A readable directory fd for an O_PATH one (os.listdir and *at calls need one)."""

    def __init__(self, path_fd: int) -> None:
        self.path_fd = path_fd
        self.fd = -1

    def __enter__(self) -> int:
        self.fd = os.open(f"/proc/self/fd/{self.path_fd}", os.O_RDONLY | os.O_DIRECTORY
                          | os.O_CLOEXEC)
        return self.fd

    def __exit__(self, *_exc: object) -> None:
        os.close(self.fd)


def read_chunks(fd: int, size: int = 256 * 1024) -> Iterator[bytes]:
    """A file's bytes in pieces; closes `fd` at the end."""
    try:
        while chunk := os.read(fd, size):
            yield chunk
    finally:
        os.close(fd)
