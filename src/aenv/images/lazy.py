"""On-demand image layers, server side: converting unpacked layers into the snapshot
repository, and attaching converted layers lazily through the node's FUSE mount.

Registry layers are gzip/zstd tar streams: nothing in them can be read without decompressing
everything before it, so true range reads need a converted format. Ours is the snapshot
repository's (`storage/repository`): a manifest of the tree (metadata, xattrs, whiteouts) plus
sha256-addressed, content-defined chunks on posix_fs or S3. A node that unpacked a layer
pushes it as `lazy-<layer id>` (`images.convert_layers`); a node with `images.on_demand`
pulling an image whose layer is converted fetches only the manifest, and the layer is served
by `lazyfs.py` (FUSE), file contents fetched on first read. erofs + fscache on-demand mode
would do this in the kernel, but this kernel has no /dev/cachefiles
(CONFIG_CACHEFILES_ONDEMAND); FUSE is available (/dev/fuse, libfuse2 through fusepy).

Owns: `AENV_HOME/lazy` (the mountpoint), `cache/lazy/<layer id>/` (manifest, fetched chunks,
stats) and the FUSE process. Must not touch: unpacked layers (`layers/oci-*` directories),
records, the rest of the repository (it only adds `lazy-*` entries).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from aenv.errors import AenvError, ErrorCode
from aenv.storage.layout import Layout
from aenv.storage.repository import Repository

log = logging.getLogger("aenv.images")

MNT_DETACH = 2
MOUNT_TIMEOUT_S = 20.0


def repository_key(layer: str) -> str:
    return "lazy-" + layer


def _umount_lazy(path: Path) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.umount2(str(path).encode(), MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (22, 2):  # EINVAL: not a mountpoint; ENOENT
            raise OSError(err, os.strerror(err), str(path))


def _mount_alive(path: Path) -> bool:
    try:
        return os.path.ismount(path) and os.stat(path) is not None
    except OSError:
        return False


class LazyLayers:
    """The node's on-demand layers: one FUSE process serving `AENV_HOME/lazy`."""

    def __init__(self, layout: Layout, repository: Repository,
                 prefetch_after_s: float | None) -> None:
        self.layout = layout
        self.repository = repository
        self.prefetch_after_s = prefetch_after_s
        self.state = layout.cache_dir / "lazy"
        self.mountpoint = layout.home / "lazy"
        self._proc: subprocess.Popen[bytes] | None = None

    # ---------------------------------------------------------------- the mount
    def start(self) -> None:
        """Blocking, at server start and before the runtime forks sandbox processes (they
        must see the mount): reuse a live mount of an earlier server, else mount."""
        self.state.mkdir(parents=True, exist_ok=True)
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        if _mount_alive(self.mountpoint):
            return
        with contextlib.suppress(OSError):
            _umount_lazy(self.mountpoint)  # a dead FUSE process leaves ENOTCONN behind
        cmd = [sys.executable, "-m", "aenv.images.lazyfs", str(self.state), str(self.mountpoint)]
        if self.prefetch_after_s is not None:
            cmd += ["--prefetch-after", str(self.prefetch_after_s)]
        with open(self.state / "lazyfs.log", "ab") as logf:
            # Its own session: it outlives a server restart, like the sandboxes reading it.
            self._proc = subprocess.Popen(cmd, stdout=logf, stderr=logf, stdin=subprocess.DEVNULL,
                                          start_new_session=True)
        deadline = time.monotonic() + MOUNT_TIMEOUT_S
        while not _mount_alive(self.mountpoint):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise AenvError(ErrorCode.UNAVAILABLE, "the on-demand layer filesystem did not "
                                f"mount; see {self.state / 'lazyfs.log'}")
            time.sleep(0.02)
        log.info("on-demand layers: FUSE mounted at %s", self.mountpoint)

    def stop(self) -> None:
        """Blocking: unmount (lazily: the kernel lets current users finish). Only when no
        sandbox uses a lazy layer, else they would lose their root filesystem."""
        with contextlib.suppress(OSError):
            _umount_lazy(self.mountpoint)
        if self._proc is not None:
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None

    # ---------------------------------------------------------------- layers
    async def available(self, layer: str) -> bool:
        return await self.repository.exists(repository_key(layer))

    async def attach(self, layer: str, link: Path) -> int:
        """Make `link` (layers/<layer>) the lazy layer: its manifest is fetched (a few
        hundred KiB for a Debian root), no contents. Returns the layer's file bytes."""
        manifest = await self.repository.manifest(repository_key(layer))
        state = self.state / layer

        def write() -> None:
            (state / "chunks").mkdir(parents=True, exist_ok=True)
            tmp = state / f".manifest.{secrets.token_hex(4)}"
            tmp.write_bytes(manifest.to_bytes())
            os.replace(tmp, state / "manifest.json")
            tmp_link = link.with_name(f".{link.name}.{secrets.token_hex(4)}")
            tmp_link.symlink_to(self.mountpoint / layer)
            os.replace(tmp_link, link)

        await asyncio.to_thread(write)
        return manifest.bytes_total

    async def convert(self, layer: str, path: Path) -> None:
        """Push an unpacked layer as `lazy-<layer>` (once: the key names its content)."""
        key = repository_key(layer)
        if await self.repository.exists(key):
            return
        started = time.monotonic()
        try:
            stats = await self.repository.push(key, path)
        except AenvError as exc:
            if exc.code is not ErrorCode.CONFLICT:  # pushed meanwhile by another node
                raise
            return
        log.info("layer %s converted for on-demand pulls: %d bytes, %d new, %.1fs", layer,
                 stats.bytes_total, stats.bytes_new, time.monotonic() - started)

    def is_lazy(self, layer: str) -> bool:
        return (self.layout.layers_dir / layer).is_symlink() and \
            (self.state / layer / "manifest.json").exists()

    def local_bytes(self, layer: str) -> int:
        chunks = self.state / layer / "chunks"
        total = 0
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(chunks):
                with contextlib.suppress(FileNotFoundError):
                    total += entry.stat(follow_symlinks=False).st_blocks * 512
        return total

    def stats(self, layer: str) -> dict[str, Any]:
        """What the FUSE process fetched of a layer (empty before the first read)."""
        try:
            value = json.loads((self.state / layer / "stats.json").read_text())
        except (FileNotFoundError, ValueError):
            return {}
        return value if isinstance(value, dict) else {}

    def detach(self, layer: str) -> Path | None:
        """Forget a lazy layer's local state (eviction: the caller made sure no sandbox
        uses it); returns the renamed directory to delete, off the loop."""
        state = self.state / layer
        gone = self.state / f".evicting-{layer}-{secrets.token_hex(4)}"
        try:
            os.rename(state, gone)
        except FileNotFoundError:
            return None
        return gone


def remove_tree(path: Path) -> None:
    """Delete what an eviction renamed away: a directory, or a lazy layer's symlink."""
    if path.is_symlink():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)
