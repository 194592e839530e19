"""Volume bind mounts put into a running sandbox's mount namespace from the host side.

A sandbox made by the fork-server (or claimed from the ready pool, or restored without the
volume in its image) gets its volumes after it started: each volume's directory is cloned as
a detached mount (`open_tree`, in the host's mount namespace, nosuid and nodev), then a thread
of its own enters the sandbox's mount namespace (after `unshare(CLONE_FS)`: a thread sharing
its filesystem context with the process may not), makes the mount point inside the sandbox's
root and attaches the tree there (`move_mount`). The mount is the sandbox's alone: the host's
mount table never sees it, and it goes with the sandbox's last process. A checkpoint leaves
it out of the image (`checkpoint.dump(volumes=...)`, CRIU `--external mnt[...]`), so a pause
copies none of a volume's data and a restore binds the same host directory again.

Owns: nothing that outlives a call. Must not touch: the host's own mount namespace.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Sequence

from aenv.errors import AenvError, ErrorCode, invalid
from aenv.runtime.base import VolumeMount
from aenv.runtime.container import linux

# Mount points CRIU's `--external mnt[<path>]:<key>` can carry and a sandbox can keep.
_PATH_RE = re.compile(r"^(/[A-Za-z0-9._@+-]+)+$")
_RESERVED = ("/proc", "/sys", "/dev", "/opt/aenv", "/run/aenv", "/etc")
MAX_PATH = 255


def check_mount_path(path: str) -> str:
    """A volume's mount point, or AenvError(INVALID_ARGUMENT) saying why it cannot be one."""
    if (len(path) > MAX_PATH or not _PATH_RE.match(path)
            or any(part in (".", "..") for part in path.split("/"))):
        raise invalid(f"volume mount path {path!r}: an absolute path of letters, digits and "
                      "._@+- components is required")
    for reserved in _RESERVED:
        if path == reserved or path.startswith(reserved + "/"):
            raise invalid(f"volume mount path {path!r}: {reserved} belongs to the sandbox's "
                          "system")
    return path


def _attach(pid: int, mounts: Sequence[VolumeMount]) -> None:
    """Blocking; on a thread that may change namespace (the caller's is discarded)."""
    trees: list[int] = []
    try:
        for mount in mounts:
            fd = linux.open_tree(str(mount.source),
                                 linux.OPEN_TREE_CLONE | linux.OPEN_TREE_CLOEXEC)
            trees.append(fd)
            linux.mount_setattr_fd(fd, linux.MOUNT_ATTR_NOSUID | linux.MOUNT_ATTR_NODEV,
                                   recursive=False)
        ns = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        try:
            linux.unshare(linux.CLONE_FS)
            linux.setns(ns, linux.CLONE_NEWNS)  # root and cwd: the sandbox's root
        finally:
            os.close(ns)
        for mount, fd in zip(mounts, trees, strict=True):
            os.makedirs(mount.path, mode=0o755, exist_ok=True)
            linux.move_mount_fd(fd, mount.path)
    finally:
        for fd in trees:
            os.close(fd)


def attach_volumes(pid: int, mounts: Sequence[VolumeMount]) -> None:
    """Mount `mounts` into the sandbox whose init is `pid` (checked alive by the caller).
    Blocking (about a millisecond); runs on a thread started for it."""
    if not mounts:
        return
    errors: list[BaseException] = []

    def work() -> None:
        try:
            _attach(pid, mounts)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            errors.append(exc)

    thread = threading.Thread(target=work, name="aenv-volume-mount")
    thread.start()
    thread.join()
    if errors:
        exc = errors[0]
        if isinstance(exc, AenvError):
            raise exc
        raise AenvError(ErrorCode.INTERNAL, f"mounting volumes into pid {pid}: {exc}") from exc
