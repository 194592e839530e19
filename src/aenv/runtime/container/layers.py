"""Sealed overlayfs layers: a sandbox's writable layer (upper) frozen into a read-only layer
that snapshots and fork children stack under their own, empty upper; and the compaction of a
stack of such layers into one.

A sealed layer keeps overlayfs's upper-layer format, which overlayfs reads correctly as a
lower layer: whiteouts are 0:0 character devices, opaque directories carry the
`trusted.overlay.opaque` xattr. (redirect_dir and metacopy are off on the hosts we run on,
so no other overlay xattr needs to be understood when merging.)

On btrfs a sealed layer is a read-only subvolume snapshot (O(1) to make, shares all data);
elsewhere it is a directory (made by copying, with reflinks where the filesystem has them).

Owns: the layer directories given to it. Must not touch: layers of templates (never merged or
removed here unless the caller says so), sandboxes' live uppers.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import subprocess
from collections.abc import Sequence
from pathlib import Path

from aenv.errors import AenvError, ErrorCode
from aenv.runtime.container import linux

OPAQUE_XATTR = "trusted.overlay.opaque"


def is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def is_opaque(path: Path) -> bool:
    try:
        return os.getxattr(path, OPAQUE_XATTR, follow_symlinks=False) == b"y"
    except OSError:
        return False


def stores_shifted_ids(path: Path, root_id: int) -> bool:
    """Whether the layer at `path` holds ids already shifted into a sandbox user namespace
    whose root is host uid `root_id`: a sealed upper of such a sandbox (its root directory,
    the sandbox's "/", belongs to the sandbox's root). Those are stacked as they are; other
    layers (templates' base and OCI layers, the driver's, sealed uppers of sandboxes without
    a user namespace) hold host ids and are idmapped into the sandbox's range."""
    return root_id != 0 and os.stat(path).st_uid == root_id


def remove_layer(path: Path) -> None:
    """Delete a layer directory, a read-only btrfs subvolume included, or a directory that
    holds one at any depth (a snapshot image with its sealed layer inside). Idempotent."""
    if not os.path.lexists(path):
        return
    if not path.is_symlink() and path.is_dir() and not linux.is_subvolume(str(path)):
        for top, dirs, _files in os.walk(path):
            for name in list(dirs):
                inner = Path(top) / name
                if not inner.is_symlink() and linux.is_subvolume(str(inner)):
                    remove_layer(inner)
                    dirs.remove(name)
        shutil.rmtree(path)
        return
    if linux.is_subvolume(str(path)):
        # A workspace holds a nested subvolume (`checkpoints`, the driver's): the kernel
        # refuses to delete a subvolume that still contains one.
        for nested in path.iterdir():
            if nested.is_dir() and not nested.is_symlink() and linux.is_subvolume(str(nested)):
                remove_layer(nested)
        linux.subvolume_delete(str(path))
    else:
        shutil.rmtree(path)


def _cp(sources: Sequence[Path], dest_dir: Path) -> None:
    """`cp -a --reflink=auto` (owners, modes, xattrs, whiteouts, hard links, sparse files;
    shared blocks where the filesystem can) of `sources` into the directory `dest_dir`."""
    if not sources:
        return
    proc = subprocess.run(["cp", "-a", "--reflink=auto", "--", *map(str, sources),
                           str(dest_dir) + "/"], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise AenvError(ErrorCode.INTERNAL, f"copying layer entries: {proc.stderr.strip()}")


def _remove_entry(path: Path) -> None:
    st = os.lstat(path)
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _apply(upper: Path, dest: Path) -> None:
    """Merge the overlay layer `upper` onto the layer `dest` directly below it, in place, so
    that `dest` alone shows what the two showed stacked. Whiteouts stay whiteouts (they
    still hide files of the layers under `dest`)."""
    to_copy: list[Path] = []
    with os.scandir(upper) as entries:
        for entry in entries:
            src, dst = Path(entry.path), dest / entry.name
            st = entry.stat(follow_symlinks=False)
            exists = os.path.lexists(dst)
            if stat.S_ISDIR(st.st_mode) and not is_opaque(src) and exists and dst.is_dir() \
                    and not dst.is_symlink():
                _apply(src, dst)  # a merged directory: merge what is inside
                shutil.copystat(src, dst, follow_symlinks=False)
                os.chown(dst, st.st_uid, st.st_gid, follow_symlinks=False)
                continue
            if exists:
                _remove_entry(dst)  # replaced (a file, a whiteout, an opaque directory)
            to_copy.append(src)
    _cp(to_copy, dest)


def merge_layers(layers: Sequence[Path], dest: Path) -> None:
    """Compact sealed layers (TOP FIRST) into one new layer at `dest` (must not exist).
    Built beside `dest` and renamed into place; on btrfs it starts from a writable snapshot
    of the bottom layer (no copy) and ends as a read-only subvolume."""
    if not layers:
        raise AenvError(ErrorCode.INVALID_ARGUMENT, "merge_layers: no layers")
    if os.path.lexists(dest):
        raise AenvError(ErrorCode.CONFLICT, f"layer {dest} exists")
    work = dest.with_name(f".merge-{dest.name}")
    remove_layer(work)
    bottom = layers[-1]
    btrfs = linux.is_subvolume(str(bottom)) and linux.on_btrfs(str(dest.parent))
    try:
        if btrfs:
            linux.subvolume_snapshot(str(bottom), str(work), readonly=False)
        else:
            work.mkdir()
            shutil.copystat(bottom, work)
            _cp(list(bottom.iterdir()), work)
        for upper in reversed(layers[:-1]):
            _apply(upper, work)
        if btrfs:
            linux.subvolume_snapshot(str(work), str(dest), readonly=True)
            remove_layer(work)
        else:
            os.rename(work, dest)
    except BaseException:
        with contextlib.suppress(OSError):
            remove_layer(work)
        raise


def take_sealed(sealed: Path, dest: Path) -> None:
    """Move a sealed layer out of a snapshot image to its place among the layers."""
    if linux.is_subvolume(str(sealed)) and linux.on_btrfs(str(dest.parent)):
        # A read-only subvolume cannot move to another directory (its ".." would change):
        # snapshot it there instead (O(1) as well) and drop the original.
        linux.subvolume_snapshot(str(sealed), str(dest), readonly=True)
        linux.subvolume_delete(str(sealed))
        return
    try:
        os.rename(sealed, dest)
    except OSError as exc:
        if exc.errno != errno.EXDEV:  # another filesystem: copy instead
            raise AenvError(ErrorCode.INTERNAL, f"sealing layer {dest}: {exc}") from None
        tmp = dest.with_name(f".copy-{dest.name}")
        remove_layer(tmp)
        proc = subprocess.run(["cp", "-a", "--reflink=auto", "--", str(sealed), str(tmp)],
                              capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise AenvError(ErrorCode.INTERNAL, f"sealing layer {dest}: {proc.stderr.strip()}"
                            ) from None
        os.rename(tmp, dest)
        remove_layer(sealed)
