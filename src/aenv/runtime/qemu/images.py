"""Disks of qemu sandboxes.

Owns: the shared read-only root images under <cache>/vm-disks/ (one raw ext4 image per layer
stack, built once and never modified: every VM's overlay uses it as its backing file) and the
per-VM qcow2 overlays (`disk.qcow2` in a sandbox's workspace, or in a snapshot image).
Must not touch: the template layers it reads (they are mounted read-only, in a private mount
namespace of a child process), other files in the cache.

Why ext4 in a raw file: `mkfs.ext4 -d DIR` builds it without mounting anything and keeps
ownership, modes, xattrs and hard links; the Debian cloud kernel has ext4 built in (erofs is a
module: it would need one more module in the initramfs and a writable layer on top in the
guest). The image is sized `disk_size_mb` (sparse on the host): that is the guest's disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
import struct
import tempfile
from pathlib import Path

from aenv.errors import AenvError, ErrorCode
from aenv.runtime import process
from aenv.runtime.qemu.artefacts import GUEST_TOOLS, ROOT_LABEL

FORMAT = 1  # bump when what goes into a root image changes


async def run(*argv: str, timeout: float = 600.0) -> str:
    """Run a command; its output (stdout and stderr); AenvError(INTERNAL) with the output's
    tail if it fails."""
    try:
        done = await process.run(argv, timeout=timeout)
    except FileNotFoundError:
        raise AenvError(ErrorCode.UNAVAILABLE,
                        f"{argv[0]} not installed: run `make install`") from None
    except TimeoutError:
        raise AenvError(ErrorCode.TIMEOUT, f"`{' '.join(argv[:3])} ...` timed out") from None
    out = done.output.decode(errors="replace")
    if done.returncode != 0:
        raise AenvError(ErrorCode.INTERNAL, f"`{' '.join(argv[:4])} ...` failed: {out[-500:]}")
    return out


class RootImages:
    """Shared root images, one per layer stack, built on first use."""

    def __init__(self, cache_dir: Path, size_mb: int) -> None:
        self.dir = cache_dir / "vm-disks"
        self.size_mb = size_mb
        self._locks: dict[str, asyncio.Lock] = {}

    def key(self, layers: tuple[Path, ...]) -> str:
        # Layers are immutable once made and named by id; resolving follows test homes'
        # symlinks so that the same layer is the same key.
        text = "\n".join(str(p.resolve()) for p in layers)
        return hashlib.sha256(f"{FORMAT}:{self.size_mb}:{text}".encode()).hexdigest()[:24]

    async def get(self, layers: tuple[Path, ...]) -> Path:
        """The root image of `layers` (TOP FIRST), built if missing (seconds, once)."""
        key = self.key(layers)
        image = self.dir / f"{key}.img"
        if image.exists():
            return image
        async with self._locks.setdefault(key, asyncio.Lock()):
            if image.exists():
                return image
            self.dir.mkdir(parents=True, exist_ok=True)
            await self._build(layers, image)
        return image

    async def _build(self, layers: tuple[Path, ...], image: Path) -> None:
        work = Path(tempfile.mkdtemp(prefix=f".{image.stem}-", dir=self.dir))
        try:
            # Our own top layer: mount points the guest needs exist in the image, so no VM
            # writes them into its overlay at boot.
            top = work / "top"
            for rel in (GUEST_TOOLS.lstrip("/"), "run/aenv", "dev", "proc", "sys"):
                (top / rel).mkdir(parents=True, exist_ok=True)
            merged = work / "merged"
            merged.mkdir()
            tmp_image = work / "root.img"
            tmp_image.touch()
            await asyncio.to_thread(os.truncate, tmp_image, self.size_mb * 2**20)
            lower = ":".join(str(p) for p in (top, *layers))
            if any(c in lower for c in ",\n'"):
                raise AenvError(ErrorCode.INVALID_ARGUMENT, f"unusable layer path in {lower!r}")
            # overlayfs merges the layers (whiteouts included) read-only, in a private mount
            # namespace that disappears with the shell: the host's mount table never changes.
            script = (f"mount -t overlay -o ro,lowerdir='{lower}' overlay '{merged}' && "
                      f"exec mkfs.ext4 -q -F -L {ROOT_LABEL} -d '{merged}' -b 4096 -m 0 "
                      "-E lazy_itable_init=0,lazy_journal_init=0 -J size=32 "
                      f"'{tmp_image}'")
            await run("unshare", "--mount", "--propagation", "private", "sh", "-c", script)
            tmp_image.chmod(0o444)
            os.rename(tmp_image, image)
        finally:
            await asyncio.to_thread(shutil.rmtree, work, True)


async def create_overlay(base: Path, overlay: Path, backing_format: str = "raw") -> None:
    """A copy-on-write qcow2 on `base` (no data copied)."""
    overlay.parent.mkdir(parents=True, exist_ok=True)
    await run("qemu-img", "create", "-q", "-f", "qcow2", "-o", "cluster_size=65536",
              "-b", str(base), "-F", backing_format, str(overlay))


QCOW2_MAGIC = b"QFI\xfb"
QCOW2_EXT_BACKING_FORMAT = 0xE2792ACA


def qcow2_backing(path: Path) -> tuple[str | None, str | None]:
    """(backing file, backing format) named in a qcow2 header, None where absent. Read here
    rather than with `qemu-img info`: one fork child asks it and a process start costs more
    than the answer. ValueError if `path` is not a qcow2 image."""
    with open(path, "rb") as f:
        head = f.read(4096)
        if len(head) < 72 or head[:4] != QCOW2_MAGIC:
            raise ValueError(f"{path} is not a qcow2 image")
        version, offset, size = struct.unpack_from(">IQI", head, 4)
        name = None
        if offset:
            f.seek(offset)
            name = f.read(size).decode(errors="replace")
    fmt = None
    # Header extensions follow the header (72 bytes in version 2, header_length in 3):
    # type, length, data padded to 8 bytes; type 0 ends them.
    pos = 72 if version == 2 else struct.unpack_from(">I", head, 100)[0]
    while pos + 8 <= len(head):
        kind, length = struct.unpack_from(">II", head, pos)
        if kind == 0:
            break
        if kind == QCOW2_EXT_BACKING_FORMAT:
            fmt = head[pos + 8:pos + 8 + length].decode(errors="replace")
        pos += 8 + (length + 7) // 8 * 8
    return name, fmt


async def point_overlay_at(overlay: Path, base: Path, backing_format: str = "raw") -> None:
    """Make `overlay` name `base` as its backing file (a header change, no data copied),
    unless it already does: a snapshot taken on this node already names this node's base."""
    if await asyncio.to_thread(qcow2_backing, overlay) == (str(base), backing_format):
        return
    await run("qemu-img", "rebase", "-u", "-f", "qcow2", "-b", str(base),
              "-F", backing_format, str(overlay))


async def copy_sparse(src: Path, dst: Path) -> None:
    """Copy a file keeping its holes (guest RAM and qcow2 files are mostly holes)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    await run("cp", "--sparse=always", "--reflink=auto", str(src), str(dst))


def remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
