"""Disk and memory files of microVMs: cheap copies and diff-snapshot merges. Blocking
functions: call them through `asyncio.to_thread`.

Owns: only the destination files it is asked to write.
Must not touch: its sources (a memory file a microVM maps must never change: Firecracker maps
it MAP_PRIVATE and reads pages from it lazily).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

FICLONE = 0x40049409  # _IOW(0x94, 9, int)
_CHUNK = 64 << 20


def _data_ranges(fd: int, size: int) -> list[tuple[int, int]]:
    """The (offset, length) of each data region of a sparse file (holes skipped)."""
    ranges: list[tuple[int, int]] = []
    offset = 0
    while offset < size:
        try:
            start = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # only a hole is left
                break
            raise
        end = os.lseek(fd, start, os.SEEK_HOLE)
        ranges.append((start, end - start))
        offset = end
    return ranges


def _copy_range(src: int, dst: int, offset: int, length: int) -> None:
    while length > 0:
        try:
            n = os.copy_file_range(src, dst, min(length, _CHUNK), offset, offset)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                raise
            n = 0
        if n == 0:  # no copy_file_range here: read and write
            data = os.pread(src, min(length, _CHUNK), offset)
            if not data:
                raise OSError(errno.EIO, "short read while copying")
            n = os.pwrite(dst, data, offset)
        offset += n
        length -= n


@contextlib.contextmanager
def _copying(src: Path, dst: Path, dst_flags: int) -> Iterator[tuple[int, int]]:
    """(source fd, destination fd) for a copy from `src` into `dst` (opened write-only with
    `dst_flags`, mode 0600 if created); `dst` is removed if the copy fails."""
    sfd = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
    try:
        dfd = os.open(dst, os.O_WRONLY | os.O_CLOEXEC | dst_flags, 0o600)
        try:
            yield sfd, dfd
        finally:
            os.close(dfd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(dst)
        raise
    finally:
        os.close(sfd)


def _copy_data(sfd: int, dfd: int) -> int:
    """Copy each data region of `sfd` to the same offset in `dfd` (holes stay holes); returns
    the source's size."""
    size = os.fstat(sfd).st_size
    for offset, length in _data_ranges(sfd, size):
        _copy_range(sfd, dfd, offset, length)
    return size


def clone_file(src: Path, dst: Path) -> bool:
    """Copy `src` to `dst` (created, mode 0600): a reflink (FICLONE) when the filesystem can
    share extents, else a copy of its data regions that keeps holes as holes. True if it was
    a reflink."""
    with _copying(src, dst, os.O_CREAT | os.O_TRUNC) as (sfd, dfd):
        try:
            fcntl.ioctl(dfd, FICLONE, sfd)
            return True
        except OSError:
            pass
        os.ftruncate(dfd, _copy_data(sfd, dfd))
        return False


def merge_diff(base: Path, diff: Path, dst: Path) -> None:
    """A full memory file `dst` from the memory file a microVM was loaded from (`base`) and a
    Diff snapshot taken since (`diff`: a sparse file holding only the dirtied pages at their
    offsets), as Firecracker's documentation prescribes: the diff's data copied over the base."""
    clone_file(base, dst)
    with _copying(diff, dst, 0) as (sfd, dfd):
        size = _copy_data(sfd, dfd)
        if os.fstat(dfd).st_size < size:
            os.ftruncate(dfd, size)


def link_or_clone(src: Path, dst: Path) -> None:
    """`dst` names the same immutable contents as `src`: a hard link (same filesystem) or a
    clone. Used for memory files that several microVMs map read-only-privately."""
    try:
        os.link(src, dst)
    except OSError:
        clone_file(src, dst)
