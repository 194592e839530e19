"""Snapshot manifests: what a snapshot contains, as JSON, with a self-checksum.

Owns: the manifest format (version 1), scanning a directory into entries, and validating a
manifest read back. Must not touch: blob storage or the local disk beyond `lstat`/`readlink`/
xattrs during a scan.

A manifest lists every entry of the snapshot directory: directories, regular files (mode,
size, mtime, owner, and their chunks as [sha256, length]), symlinks, hardlinks (later paths
of an inode point to its first path), and device nodes/FIFOs (overlayfs whiteouts are 0:0
character devices, so a sealed upper layer needs them). Extended attributes are kept because
overlayfs marks opaque directories with `trusted.overlay.opaque`. Sockets are skipped: they
cannot be restored from a file anyway (CRIU recreates the ones it owns).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aenv.errors import invalid
from aenv.storage.repository.errors import BlobCorrupted

FORMAT = 1
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_snapshot_id(snapshot_id: str) -> str:
    if not _ID_RE.match(snapshot_id) or ".." in snapshot_id:
        raise invalid(f"bad snapshot id {snapshot_id!r}: use 1-128 of [A-Za-z0-9._-]")
    return snapshot_id


def manifest_name(snapshot_id: str) -> str:
    return f"manifests/{check_snapshot_id(snapshot_id)}.json"


@dataclass
class Entry:
    path: str  # relative, "/"-separated, no ".."; "." only for the root directory
    type: str  # dir | file | symlink | hardlink | chardev | blockdev | fifo
    mode: int = 0  # permission bits incl. suid/sgid/sticky (S_IMODE)
    uid: int = 0
    gid: int = 0
    mtime_ns: int = 0
    size: int = 0
    chunks: list[tuple[str, int]] = field(default_factory=list)  # file: [(sha256, length)]
    target: str = ""  # symlink: link text; hardlink: path of the first link
    rdev: int = 0  # device nodes
    xattrs: dict[str, str] = field(default_factory=dict)  # name -> base64 value

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"path": self.path, "type": self.type}
        if self.type != "hardlink":
            out.update(mode=self.mode, uid=self.uid, gid=self.gid, mtime_ns=self.mtime_ns)
        if self.type == "file":
            out.update(size=self.size, chunks=[[d, n] for d, n in self.chunks])
        if self.type in ("symlink", "hardlink"):
            out["target"] = self.target
        if self.type in ("chardev", "blockdev"):
            out["rdev"] = self.rdev
        if self.xattrs:
            out["xattrs"] = self.xattrs
        return out

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Entry:
        e = cls(path=str(raw["path"]), type=str(raw["type"]), mode=int(raw.get("mode", 0)),
                uid=int(raw.get("uid", 0)), gid=int(raw.get("gid", 0)),
                mtime_ns=int(raw.get("mtime_ns", 0)), size=int(raw.get("size", 0)),
                chunks=[(str(d), int(n)) for d, n in raw.get("chunks", [])],
                target=str(raw.get("target", "")), rdev=int(raw.get("rdev", 0)),
                xattrs={str(k): str(v) for k, v in raw.get("xattrs", {}).items()})
        if not (e.path == "." and e.type == "dir"):  # "." is the snapshot root itself
            _check_rel(e.path)
        if e.type == "hardlink":
            _check_rel(e.target)
        if e.type == "file" and sum(n for _, n in e.chunks) != e.size:
            raise ValueError(f"{e.path}: chunk lengths do not add up to size {e.size}")
        return e


def _check_rel(path: str) -> None:
    # A manifest from a shared repository is input: it must not write outside the target dir.
    parts = path.split("/")
    if not path or path.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"unsafe path in manifest: {path!r}")


@dataclass
class Manifest:
    snapshot_id: str
    entries: list[Entry]
    parent_id: str | None = None
    created_at: float = field(default_factory=time.time)
    chunking: dict[str, int] = field(default_factory=dict)

    @property
    def bytes_total(self) -> int:
        return sum(e.size for e in self.entries if e.type == "file")

    def digests(self) -> set[str]:
        return {d for e in self.entries for d, _ in e.chunks}

    def to_bytes(self) -> bytes:
        body = {"format": FORMAT, "snapshot_id": self.snapshot_id, "parent_id": self.parent_id,
                "created_at": self.created_at, "chunking": self.chunking,
                "bytes_total": self.bytes_total, "entries": [e.to_json() for e in self.entries]}
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
        return json.dumps({"sha256": hashlib.sha256(canonical.encode()).hexdigest(),
                           "manifest": body}, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes, repository: str, snapshot_id: str) -> Manifest:
        what = f"manifest of snapshot {snapshot_id}"
        try:
            outer = json.loads(data)
            body = outer["manifest"]
            canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
            actual = hashlib.sha256(canonical.encode()).hexdigest()
            if actual != outer["sha256"]:
                raise BlobCorrupted(repository, what, f"checksum mismatch, content hashes to {actual}")
            if body["format"] != FORMAT:
                raise invalid(f"{what} has format {body['format']}, this aenv reads {FORMAT}")
            if body["snapshot_id"] != snapshot_id:
                raise BlobCorrupted(repository, what, f"it names snapshot {body['snapshot_id']!r}")
            return cls(snapshot_id=body["snapshot_id"], parent_id=body.get("parent_id"),
                       created_at=float(body["created_at"]), chunking=dict(body.get("chunking", {})),
                       entries=[Entry.from_json(e) for e in body["entries"]])
        except (ValueError, KeyError, TypeError) as exc:
            raise BlobCorrupted(repository, what, f"unreadable: {exc}") from None


def _xattrs(path: Path) -> dict[str, str]:
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:  # filesystem without xattr support
        return {}
    out = {}
    for name in sorted(names):
        try:
            out[name] = base64.b64encode(os.getxattr(path, name, follow_symlinks=False)).decode()
        except OSError:
            continue
    return out


def scan(root: Path) -> Iterator[tuple[Entry, Path]]:
    """Walk `root` (not following symlinks) in a stable order: parents before children.

    File entries come back without chunks; the caller chunks them while uploading.
    """
    seen_inodes: dict[tuple[int, int], str] = {}

    def walk(directory: Path, rel: str) -> Iterator[tuple[Entry, Path]]:
        with os.scandir(directory) as it:
            items = sorted(it, key=lambda d: d.name)
        for item in items:
            path = Path(item.path)
            relpath = f"{rel}{item.name}"
            st = os.lstat(path)
            common: dict[str, Any] = {"mode": stat.S_IMODE(st.st_mode), "uid": st.st_uid,
                                      "gid": st.st_gid, "mtime_ns": st.st_mtime_ns}
            fmt = stat.S_IFMT(st.st_mode)
            if fmt == stat.S_IFDIR:
                yield Entry(relpath, "dir", xattrs=_xattrs(path), **common), path
                yield from walk(path, relpath + "/")
            elif fmt == stat.S_IFREG:
                key = (st.st_dev, st.st_ino)
                if st.st_nlink > 1 and key in seen_inodes:
                    yield Entry(relpath, "hardlink", target=seen_inodes[key]), path
                    continue
                if st.st_nlink > 1:
                    seen_inodes[key] = relpath
                yield Entry(relpath, "file", size=st.st_size, xattrs=_xattrs(path), **common), path
            elif fmt == stat.S_IFLNK:
                yield Entry(relpath, "symlink", target=os.readlink(path), **common), path
            elif fmt in (stat.S_IFCHR, stat.S_IFBLK):
                kind = "chardev" if fmt == stat.S_IFCHR else "blockdev"
                yield Entry(relpath, kind, rdev=st.st_rdev, xattrs=_xattrs(path), **common), path
            elif fmt == stat.S_IFIFO:
                yield Entry(relpath, "fifo", xattrs=_xattrs(path), **common), path
            # sockets (S_IFSOCK) are skipped on purpose, see the module docstring

    st = os.lstat(root)
    yield Entry(".", "dir", mode=stat.S_IMODE(st.st_mode), uid=st.st_uid, gid=st.st_gid,
                mtime_ns=st.st_mtime_ns, xattrs=_xattrs(root)), root
    yield from walk(root, "")
