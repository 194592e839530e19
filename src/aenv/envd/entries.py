"""Paths and filesystem entries as envd reports them.

Owns: resolving a client path for a user (`~`, relative paths, the default workdir),
creating parent directories owned by that user, building `EntryInfo` messages, and file
metadata (`X-Metadata-*` on upload, `EntryInfo.metadata` on read).

Semantics follow the Go envd: relative paths and `~` resolve against the user's home, an
empty path means the default workdir (else home); `..` is allowed — the whole filesystem is
the sandbox. For a symlink, `type` is the type of its target (SYMLINK when it dangles),
`isSymlink` is true and `symlinkTarget` is the fully resolved target. `permissions` is Go's `FileMode.String()`
(`-rw-r--r--`, `drwxr-xr-x`, `Lrwxrwxrwx`, `dtrwxrwxrwt`), and `mode` holds the permission
bits only (the target's, for a symlink).

Metadata lives in `user.e2b.<key>` extended attributes, like real envd, so it survives
renames and is visible to `getfattr`. Where the filesystem has no user xattrs (some tmpfs
and overlay setups) it falls back to a sidecar JSON file per inode under
`EnvdSettings.metadata_dir`; inode keys also survive renames, but a recycled inode can
show a deleted file's metadata until the next upload to it rewrites the set.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
from collections.abc import Callable

from aenv.envd.errors import RpcError, internal, invalid, not_found
from aenv.envd.log import log
from aenv.envd.proto import Msg, timestamp
from aenv.envd.users import User, UserDb

FILE_TYPE_FILE = "FILE_TYPE_FILE"
FILE_TYPE_DIRECTORY = "FILE_TYPE_DIRECTORY"
FILE_TYPE_SYMLINK = "FILE_TYPE_SYMLINK"

XATTR_PREFIX = "user.e2b."
MAX_METADATA_KEY = 255 - len(XATTR_PREFIX)
MAX_METADATA_TOTAL = 4096
_NO_XATTR = (errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM)


def go_base(path: str) -> str:
    """`filepath.Base`: the last element, "/" for the root."""
    stripped = path.rstrip("/")
    if not stripped:
        return "/" if path else "."
    return stripped.rsplit("/", 1)[-1]


def resolve_path(path: str, user: User, default_workdir: str | None) -> str:
    # What no file name can hold (a NUL; a lone surrogate from JSON, which has no bytes) is the
    # client's error here, before an os call would raise ValueError/UnicodeEncodeError on it.
    if "\x00" in path:
        raise invalid(f"invalid path {path!r}: file names cannot contain NUL bytes")
    try:
        os.fsencode(path)
    except UnicodeEncodeError:
        raise invalid(f"invalid path {path!r}: not representable as a file name") from None
    if path == "" and default_workdir:
        path = default_workdir
    if path.startswith("~"):
        if len(path) > 1 and path[1] != "/":
            raise invalid(
                f"failed to expand path '{path}' for user '{user.name}': "
                "cannot expand user-specific home dir"
            )
        path = user.home.rstrip("/") + "/" + path[1:].lstrip("/")
    if not path.startswith("/"):
        path = user.home.rstrip("/") + "/" + path
    path = os.path.normpath(path)
    # POSIX normpath keeps a leading "//"; Go's filepath.Clean does not.
    return "/" + path.lstrip("/")


def ensure_dirs(path: str, uid: int, gid: int) -> None:
    """Create `path` and missing parents, each new directory owned by uid:gid."""
    missing = []
    current = path
    while True:
        try:
            st = os.stat(current)
        except FileNotFoundError:
            missing.append(current)
            parent = os.path.dirname(current)
            if parent == current:
                break
            current = parent
            continue
        except OSError as e:
            raise os_error(e, "failed to create directory: stat", current) from None
        if not stat.S_ISDIR(st.st_mode):
            raise RpcError("failed_precondition", f"failed to create directory: path is a file: {current}")
        break
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o755)
        except FileExistsError:
            pass
        except OSError as e:
            raise os_error(e, "failed to create directory", directory) from None
        chown(directory, uid, gid)


def chown(path_or_fd: str | int, uid: int, gid: int) -> None:
    """Give a new file or directory to the requesting user.

    Only root can do that; an unprivileged envd (tests, `--not-init` runs) creates
    everything as itself, which is then already the only user it can serve.
    """
    try:
        os.chown(path_or_fd, uid, gid)
    except PermissionError:
        if os.geteuid() == 0:
            raise


def mode_string(mode: int) -> str:
    """Go's `os.FileMode.String()` for a stat mode (type letters in Go's order)."""
    kind = stat.S_IFMT(mode)
    prefix = ""
    if kind == stat.S_IFDIR:
        prefix += "d"
    if kind == stat.S_IFLNK:
        prefix += "L"
    if kind in (stat.S_IFBLK, stat.S_IFCHR):
        prefix += "D"
    if kind == stat.S_IFIFO:
        prefix += "p"
    if kind == stat.S_IFSOCK:
        prefix += "S"
    if mode & stat.S_ISUID:
        prefix += "u"
    if mode & stat.S_ISGID:
        prefix += "g"
    if kind == stat.S_IFCHR:
        prefix += "c"
    if mode & stat.S_ISVTX:
        prefix += "t"
    bits = "".join(c if mode & (1 << (8 - i)) else "-" for i, c in enumerate("rwxrwxrwx"))
    return (prefix or "-") + bits


def file_type(mode: int) -> str | None:
    if stat.S_ISREG(mode):
        return FILE_TYPE_FILE
    if stat.S_ISDIR(mode):
        return FILE_TYPE_DIRECTORY
    return None  # FILE_TYPE_UNSPECIFIED, omitted like every proto3 default


def validate_metadata(metadata: dict[str, str]) -> None:
    total = 0
    for key, value in metadata.items():
        if not key:
            raise invalid("invalid metadata: metadata key must not be empty")
        if len(key) > MAX_METADATA_KEY:
            raise invalid(f"invalid metadata: metadata key {key!r} exceeds {MAX_METADATA_KEY} bytes")
        for label, text in (("key", key), (f"value for key {key!r}", value)):
            for offset, char in enumerate(text):
                if not " " <= char <= "~":
                    raise invalid(
                        f"invalid metadata: metadata {label} contains non-printable-ASCII "
                        f"byte at offset {offset}"
                    )
        total += len(XATTR_PREFIX) + len(key) + len(value)
    if total > MAX_METADATA_TOTAL:
        raise invalid(f"invalid metadata: total metadata size {total} exceeds {MAX_METADATA_TOTAL} bytes")


class MetadataStore:
    def __init__(
        self,
        sidecar_dir: str | None,
        privileged: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
    ) -> None:
        self._sidecar_dir = sidecar_dir
        self._sidecar_ready = False
        # The sidecar directory is envd's own (0700): reached with envd's credentials even
        # while a user's file operation runs (`FsCredentials.as_envd`).
        self._privileged = privileged

    def read(self, path: str | int) -> dict[str, str]:
        """The metadata of a path (followed if a symlink) or of an open file descriptor."""
        """Best effort, like real envd: a failure to read metadata never fails a stat."""
        try:
            names = os.listxattr(path)
        except OSError as e:
            if e.errno in _NO_XATTR:
                return self._sidecar_read(path)
            return {}
        metadata: dict[str, str] = {}
        for name in names:
            if not name.startswith(XATTR_PREFIX):
                continue
            try:
                value = os.getxattr(path, name).decode("utf-8")
            except (OSError, UnicodeDecodeError):
                continue  # set out of band with bytes that a JSON string cannot carry
            metadata[name[len(XATTR_PREFIX) :]] = value
        return metadata

    def replace(self, fd: int, metadata: dict[str, str]) -> None:
        """Make `metadata` the file's whole set: keys from an earlier upload are dropped
        (O_TRUNC keeps xattrs, so an overwrite would otherwise leak stale keys)."""
        try:
            existing = os.listxattr(fd)
            for name in existing:
                if name.startswith(XATTR_PREFIX) and name[len(XATTR_PREFIX) :] not in metadata:
                    try:
                        os.removexattr(fd, name)
                    except OSError as e:
                        if e.errno != errno.ENODATA:
                            raise
            for key, value in metadata.items():
                os.setxattr(fd, XATTR_PREFIX + key, value.encode())
        except OSError as e:
            if e.errno not in _NO_XATTR:
                raise
            self._sidecar_write(os.fstat(fd), metadata)

    # -- sidecar fallback -----------------------------------------------------------------

    def _sidecar_path(self, st: os.stat_result) -> str | None:
        if not self._sidecar_dir:
            return None
        return os.path.join(self._sidecar_dir, f"{st.st_dev:x}-{st.st_ino:x}.json")

    def _sidecar_read(self, path: str | int) -> dict[str, str]:
        try:
            target = self._sidecar_path(os.stat(path))
            if target is None:
                return {}
            with self._privileged(), open(target, encoding="utf-8") as f:
                value = json.load(f)
        except (OSError, ValueError):
            return {}
        if not isinstance(value, dict):
            return {}
        return {str(k): str(v) for k, v in value.items()}

    def _sidecar_write(self, st: os.stat_result, metadata: dict[str, str]) -> None:
        target = self._sidecar_path(st)
        if target is None:
            if metadata:
                log("filesystem does not support xattrs and no metadata_dir is set; metadata not persisted")
            return
        with self._privileged():
            self._sidecar_store(target, metadata)

    def _sidecar_store(self, target: str, metadata: dict[str, str]) -> None:
        if not metadata:
            try:
                os.unlink(target)
            except FileNotFoundError:
                pass
            return
        if not self._sidecar_ready:
            os.makedirs(os.path.dirname(target), mode=0o700, exist_ok=True)
            self._sidecar_ready = True
        temporary = target + ".tmp"
        with open(temporary, "w", encoding="utf-8") as f:
            json.dump(metadata, f)
        os.replace(temporary, target)


class Entries:
    """Builds `EntryInfo` messages (owner names and metadata included)."""

    def __init__(self, users: UserDb, metadata: MetadataStore) -> None:
        self.users = users
        self.metadata = metadata

    def info(self, path: str) -> Msg:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            raise not_found(f"file not found: lstat {path}: no such file or directory") from None
        except NotADirectoryError:
            raise not_found(f"file not found: lstat {path}: not a directory") from None
        except OSError as e:
            raise os_error(e, "error getting file info: lstat", path) from None
        return self.from_stat(path, st)

    def from_stat(self, path: str, st: os.stat_result) -> Msg:
        entry: Msg = {"name": go_base(path)}
        mode = st.st_mode
        kind: str | None
        if stat.S_ISLNK(mode):
            try:
                target = os.path.realpath(path, strict=True)
            except (OSError, RuntimeError):
                target = path
            try:
                target_mode = os.stat(target).st_mode
                kind, perm = file_type(target_mode), stat.S_IMODE(target_mode) & 0o777
            except OSError:
                # Dangling: Go envd says UNSPECIFIED, which makes `files.list` hide the
                # link; SYMLINK (what older envds sent for every link) keeps it visible.
                kind, perm = FILE_TYPE_SYMLINK, 0
            entry["symlinkTarget"] = target
            entry["isSymlink"] = True
        else:
            kind, perm = file_type(mode), mode & 0o777
        if kind is not None:
            entry["type"] = kind
        entry["path"] = path
        if st.st_size:
            entry["size"] = str(st.st_size)
        if perm:
            entry["mode"] = perm
        entry["permissions"] = mode_string(mode)
        entry["owner"] = self.users.user_name(st.st_uid)
        entry["group"] = self.users.group_name(st.st_gid)
        if st.st_mtime_ns:
            entry["modifiedTime"] = timestamp(st.st_mtime_ns)
        metadata = self.metadata.read(path)
        if metadata:
            entry["metadata"] = metadata
        return entry


# Errors of the path a client asked about (a name longer than NAME_MAX, a symlink loop, a
# file where a directory should be, ...): its mistake, a 400, never "internal".
_INVALID_PATH = frozenset({errno.ENAMETOOLONG, errno.ELOOP, errno.EINVAL})
_PRECONDITION = frozenset({errno.ENOTDIR, errno.EISDIR, errno.ENOTEMPTY, errno.EXDEV, errno.EROFS,
                           errno.EBUSY, errno.EMLINK, errno.ETXTBSY})


def os_error(error: OSError, action: str, path: str) -> RpcError:
    """Map an OSError to the Connect code a client can act on."""
    message = f"{action} {path}: {error.strerror or error}"
    if isinstance(error, FileNotFoundError):
        return not_found(message)
    if isinstance(error, PermissionError):
        return RpcError("permission_denied", message)
    if isinstance(error, FileExistsError):
        return RpcError("already_exists", message)
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return RpcError("resource_exhausted", message)
    if error.errno in _INVALID_PATH:
        return invalid(message)
    if error.errno in _PRECONDITION:
        return RpcError("failed_precondition", message)
    return internal(message)


def client_status(error: OSError) -> int | None:
    """The 4xx a plain-HTTP endpoint answers for `error`, or None when it is envd's own."""
    if isinstance(error, PermissionError):
        return 403
    if error.errno in _INVALID_PATH or error.errno in _PRECONDITION:
        return 400
    return None
