"""A btrfs filesystem in a sparse file, loop-mounted: a home for sandbox workspaces and sealed
layers on hosts whose own filesystem cannot seal a writable layer in O(1) (ext4).

On btrfs every sandbox's writable layer is a subvolume, and a snapshot seals it with a
read-only btrfs snapshot: no data or metadata is copied, whatever its size. Operators put
AENV_HOME on btrfs (best) or xfs (reflinks: a copy of metadata only); tests and benchmarks
use this module to get a btrfs home on any host.

Owns: the loop mount it makes. Must not touch: anything inside the mounted filesystem.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from aenv.errors import AenvError, ErrorCode

DEFAULT_SIZE = 64 * 2**30  # sparse: only what is written takes host disk


def btrfs_available() -> bool:
    return shutil.which("mkfs.btrfs") is not None and Path("/dev/loop-control").exists()


def mount_btrfs_volume(mountpoint: Path, size_bytes: int = DEFAULT_SIZE) -> None:
    """Make a fresh btrfs filesystem in a sparse file and mount it on `mountpoint` (an
    existing, empty directory). The file is unlinked once mounted, so unmounting frees it."""
    fd, image = tempfile.mkstemp(prefix="aenv-volume-", suffix=".img", dir="/var/tmp")
    try:
        os.ftruncate(fd, size_bytes)
        os.close(fd)
        for cmd in (["mkfs.btrfs", "-q", "-f", image],
                    ["mount", "-o", "loop,noatime", image, str(mountpoint)]):
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise AenvError(ErrorCode.UNAVAILABLE,
                                f"{' '.join(cmd[:2])}: {proc.stderr.strip() or proc.stdout}")
    finally:
        with contextlib.suppress(OSError):
            os.unlink(image)


def unmount_volume(mountpoint: Path) -> None:
    """Lazily unmount `mountpoint` if something is mounted there (the loop device and its
    deleted file go away with the last user)."""
    if os.path.ismount(mountpoint):
        subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True, check=False)
