"""The on-demand layer filesystem: one read-only FUSE mount per node serving every *lazy*
image layer, file contents fetched from the snapshot repository on first read.

Run as its own process (`python -m aenv.images.lazyfs STATE_DIR MOUNTPOINT`, started by
`aenv.images.lazy.LazyLayers`), so that it outlives server restarts like the sandboxes that
read through it, and libfuse's signal handling stays out of the server.

Layout: `MOUNTPOINT/<layer id>/...` is the layer's tree as converted into the repository
(`lazy.py`: a layer directory pushed as the repository entry `lazy-<layer id>`: metadata in
one manifest, contents as sha256-addressed chunks of 64 KiB-1 MiB). A layer appears once
`STATE_DIR/<layer id>/manifest.json` exists (written by the server); it is answered from
memory (entries, modes, owners, xattrs incl. `trusted.overlay.opaque`, whiteouts as 0:0
character devices), so an overlay mount and every lookup cost no fetch. A read fetches the
chunks it covers (verified against their sha256 by the blob store) into
`STATE_DIR/<layer id>/chunks/`, and never again; `stats.json` there counts what was fetched.
With `--prefetch-after S` a background thread fetches the rest of each layer S seconds after
it was first used, so a node ends up with the whole layer without waiting for it.

Why one mount for all layers: sandbox processes are prepared ahead of time in mount
namespaces of their own with private propagation (runtime/container/zygote.py); a mount made
after they were forked would be invisible to them, a directory appearing inside an existing
mount is not. `layers/<layer id>` is a symlink to `MOUNTPOINT/<layer id>`.

Owns: the FUSE protocol side and the chunk files under STATE_DIR. Must not touch: the rest
of AENV_HOME, the record store; the repository is only read.
"""

from __future__ import annotations

import argparse
import base64
import bisect
import errno
import json
import logging
import os
import re
import secrets
import stat
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fuse import FUSE, FuseOSError, Operations  # type: ignore[import-untyped]

from aenv.config import load_config
from aenv.storage.repository.blobstore import BlobStore
from aenv.storage.repository.config import open_blob_store
from aenv.storage.repository.manifest import Entry, Manifest

log = logging.getLogger("aenv.lazyfs")

_DIGEST = re.compile(r"^[0-9a-f]{64}$")
_TYPES = {"dir": stat.S_IFDIR, "file": stat.S_IFREG, "symlink": stat.S_IFLNK,
          "chardev": stat.S_IFCHR, "blockdev": stat.S_IFBLK, "fifo": stat.S_IFIFO}


@dataclass
class _Tree:
    """One layer: its manifest indexed by path, and what was fetched of it."""

    layer: str
    state: Path
    nodes: dict[str, Entry]
    children: dict[str, list[str]]
    nlink: dict[str, int]
    total_bytes: int
    offsets: dict[str, list[int]] = field(default_factory=dict)
    fetched_bytes: int = 0
    fetched_chunks: int = 0
    local_bytes: int = 0
    first_read: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def load(cls, layer: str, state: Path) -> _Tree:
        manifest = Manifest.from_bytes((state / "manifest.json").read_bytes(), "lazy",
                                       "lazy-" + layer)
        nodes: dict[str, Entry] = {}
        children: dict[str, list[str]] = {"": []}
        nlink: dict[str, int] = {}
        for e in manifest.entries:
            if any(not _DIGEST.match(d) for d, _ in e.chunks):
                raise ValueError(f"{e.path}: a chunk name is not a sha256")  # names chunk files
            rel = "" if e.path == "." else e.path
            nodes[rel] = e
            if e.type == "dir":
                children.setdefault(rel, [])
            if rel:
                parent, _, name = rel.rpartition("/")
                children.setdefault(parent, []).append(name)
        for rel, e in list(nodes.items()):
            if e.type == "hardlink":
                target = nodes.get(e.target)
                if target is None or target.type != "file":
                    continue
                nodes[rel] = target
                nlink[e.target] = nlink.get(e.target, 1) + 1
        for rel in nlink:
            nlink.setdefault(rel, 1)
        for rel, names in children.items():
            nlink[rel] = 2 + sum(1 for n in names
                                 if nodes.get(f"{rel}/{n}" if rel else n, Entry("", "")).type
                                 == "dir")
        tree = cls(layer, state, nodes, children, nlink, manifest.bytes_total)
        chunks = state / "chunks"
        chunks.mkdir(exist_ok=True)
        tree.local_bytes = sum(p.stat().st_size for p in chunks.iterdir()
                               if not p.name.startswith("."))
        return tree

    def offsets_of(self, rel: str, e: Entry) -> list[int]:
        found = self.offsets.get(rel)
        if found is None:
            found, pos = [], 0
            for _, n in e.chunks:
                found.append(pos)
                pos += n
            self.offsets[rel] = found
        return found

    def write_stats(self) -> None:
        body = {"layer": self.layer, "total_bytes": self.total_bytes,
                "fetched_bytes": self.fetched_bytes, "fetched_chunks": self.fetched_chunks,
                "local_bytes": self.local_bytes, "at": time.time()}
        tmp = self.state / f".stats.{secrets.token_hex(4)}"
        tmp.write_text(json.dumps(body))
        os.replace(tmp, self.state / "stats.json")


class LazyFS(Operations):  # type: ignore[misc]
    use_ns = True

    def __init__(self, state: Path, store: BlobStore, prefetch_after: float | None) -> None:
        self.state = state
        self.store = store
        self.prefetch_after = prefetch_after
        self._trees: dict[str, _Tree] = {}
        self._lock = threading.Lock()
        self._chunk_locks: dict[str, threading.Lock] = {}
        self._started = time.time_ns()

    # ---------------------------------------------------------------- lookup
    def _tree(self, layer: str) -> _Tree:
        tree = self._trees.get(layer)
        if tree is not None:
            return tree
        with self._lock:
            tree = self._trees.get(layer)
            if tree is None:
                state = self.state / layer
                if "/" in layer or layer.startswith(".") or not (state / "manifest.json").exists():
                    raise FuseOSError(errno.ENOENT)
                try:
                    tree = _Tree.load(layer, state)
                except Exception as exc:  # noqa: BLE001 - a broken manifest: the layer is unreadable
                    log.error("layer %s: %s", layer, exc)
                    raise FuseOSError(errno.EIO) from None
                self._trees[layer] = tree
        return tree

    def _find(self, path: str) -> tuple[_Tree, str, Entry]:
        layer, _, rel = path.lstrip("/").partition("/")
        tree = self._tree(layer)
        if not rel and not (tree.state / "manifest.json").exists():
            with self._lock:  # evicted by the server: forget it
                self._trees.pop(layer, None)
            raise FuseOSError(errno.ENOENT)
        entry = tree.nodes.get(rel)
        if entry is None:
            raise FuseOSError(errno.ENOENT)
        return tree, rel, entry

    # ---------------------------------------------------------------- metadata
    def getattr(self, path: str, fh: Any = None) -> dict[str, Any]:
        if path == "/":
            return {"st_mode": stat.S_IFDIR | 0o755, "st_nlink": 2, "st_uid": 0, "st_gid": 0,
                    "st_mtime": self._started, "st_atime": self._started,
                    "st_ctime": self._started}
        tree, rel, e = self._find(path)
        size = e.size if e.type == "file" else len(e.target.encode()) if e.type == "symlink" \
            else 0
        return {"st_mode": _TYPES.get(e.type, stat.S_IFREG) | e.mode,
                "st_nlink": tree.nlink.get(rel, 1), "st_uid": e.uid, "st_gid": e.gid,
                "st_size": size, "st_blocks": (size + 511) // 512, "st_rdev": e.rdev,
                "st_mtime": e.mtime_ns, "st_atime": e.mtime_ns, "st_ctime": e.mtime_ns}

    def readdir(self, path: str, fh: Any) -> list[str | tuple[str, dict[str, int], int]]:
        if path == "/":
            names = [p.name for p in self.state.iterdir() if (p / "manifest.json").exists()]
            return [".", "..", *names]
        tree, rel, e = self._find(path)
        if e.type != "dir":
            raise FuseOSError(errno.ENOTDIR)
        # With each entry's type (d_type): overlayfs recognises whiteouts in a directory
        # listing by DT_CHR, and lists DT_UNKNOWN entries as they are.
        prefix = f"{rel}/" if rel else ""
        out: list[str | tuple[str, dict[str, int], int]] = [".", ".."]
        for name in tree.children.get(rel, []):
            child = tree.nodes.get(prefix + name)
            out.append((name, {"st_mode": _TYPES.get(child.type if child else "file",
                                                     stat.S_IFREG)}, 0))
        return out

    def readlink(self, path: str) -> str:
        _, _, e = self._find(path)
        if e.type != "symlink":
            raise FuseOSError(errno.EINVAL)
        return e.target

    def getxattr(self, path: str, name: str, position: int = 0) -> bytes:
        if path == "/":
            raise FuseOSError(errno.ENODATA)
        _, _, e = self._find(path)
        value = e.xattrs.get(name)
        if value is None:
            raise FuseOSError(errno.ENODATA)
        return base64.b64decode(value)

    def listxattr(self, path: str) -> list[str]:
        if path == "/":
            return []
        return list(self._find(path)[2].xattrs)

    def statfs(self, path: str) -> dict[str, int]:
        return {"f_bsize": 4096, "f_frsize": 4096, "f_blocks": 0, "f_bfree": 0,
                "f_bavail": 0, "f_files": 0, "f_ffree": 0, "f_namemax": 255}

    def access(self, path: str, amode: int) -> int:
        if amode & os.W_OK:
            raise FuseOSError(errno.EROFS)
        return 0

    # ---------------------------------------------------------------- contents
    def open(self, path: str, flags: int) -> int:
        if flags & os.O_ACCMODE != os.O_RDONLY:
            raise FuseOSError(errno.EROFS)
        _, _, e = self._find(path)
        if e.type != "file":
            raise FuseOSError(errno.EINVAL)
        return 0

    def read(self, path: str, size: int, offset: int, fh: Any) -> bytes:
        tree, rel, e = self._find(path)
        if e.type != "file" or offset >= e.size:
            return b""
        if not tree.first_read:
            tree.first_read = time.time()
            if self.prefetch_after is not None:
                threading.Thread(target=self._prefetch, args=(tree,), daemon=True,
                                 name=f"prefetch-{tree.layer[:20]}").start()
        end = min(e.size, offset + size)
        starts = tree.offsets_of(rel, e)
        i = bisect.bisect_right(starts, offset) - 1
        out = []
        while i < len(e.chunks) and starts[i] < end:
            digest, length = e.chunks[i]
            data = self._chunk(tree, digest)
            lo = max(offset, starts[i]) - starts[i]
            hi = min(end, starts[i] + length) - starts[i]
            out.append(data[lo:hi])
            i += 1
        return b"".join(out)

    def _chunk(self, tree: _Tree, digest: str) -> bytes:
        path = tree.state / "chunks" / digest
        try:
            return path.read_bytes()
        except FileNotFoundError:
            pass
        with self._lock:
            lock = self._chunk_locks.setdefault(digest, threading.Lock())
        with lock:
            try:
                return path.read_bytes()
            except FileNotFoundError:
                pass
            try:
                data = self.store.get(digest)  # verified against its sha256
            except Exception as exc:  # noqa: BLE001 - any store failure is EIO to the reader
                log.error("layer %s: chunk %s: %s", tree.layer, digest, exc)
                raise FuseOSError(errno.EIO) from None
            try:
                tmp = path.with_name(f".{digest}.{secrets.token_hex(4)}")
                tmp.write_bytes(data)
                os.replace(tmp, path)
            except OSError as exc:  # evicted meanwhile, or a full disk: serve, do not keep
                log.warning("layer %s: chunk %s not kept: %s", tree.layer, digest, exc)
                return data
            with tree.lock:
                tree.fetched_bytes += len(data)
                tree.fetched_chunks += 1
                tree.local_bytes += len(data)
                tree.write_stats()
            return data

    def _prefetch(self, tree: _Tree) -> None:
        """The rest of the layer, in the background, after the first burst of reads."""
        assert self.prefetch_after is not None
        time.sleep(self.prefetch_after)
        seen: set[str] = set()
        for e in list(tree.nodes.values()):
            for digest, _ in e.chunks:
                if digest in seen:
                    continue
                seen.add(digest)
                if not (tree.state / "manifest.json").exists():
                    return  # evicted meanwhile
                try:
                    self._chunk(tree, digest)
                except FuseOSError:
                    return
        log.info("layer %s: prefetch complete (%d bytes fetched)", tree.layer,
                 tree.fetched_bytes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aenv.images.lazyfs")
    parser.add_argument("state", type=Path)
    parser.add_argument("mountpoint", type=Path)
    parser.add_argument("--prefetch-after", type=float, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cfg = load_config()
    store = open_blob_store(cfg.snapshot, cfg.home)
    args.state.mkdir(parents=True, exist_ok=True)
    FUSE(LazyFS(args.state, store, args.prefetch_after), str(args.mountpoint), foreground=True,
         nothreads=False, ro=True, allow_other=True, default_permissions=True,
         kernel_cache=True, attr_timeout=86400, entry_timeout=86400, negative_timeout=0,
         fsname="aenv-lazy", subtype="aenv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
