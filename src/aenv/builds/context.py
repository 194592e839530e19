"""COPY/ADD: turn an uploaded build-context archive into the archive a build sandbox extracts.

Owns: Docker's COPY placement rules on the archive the E2B SDK uploads (members named
relative to the build context): the members matching the step's source glob, placed under
the destination (a directory source copies its contents; a file goes to `dest` or, when
`dest` is a directory, into it), owned by the step's user, with the step's mode; ADD also
unpacks a tar archive (any compression) into the destination. The result is an uncompressed
tar of absolute destination paths that `tar -xpf X -C /` extracts as root.
Blocking (tarfile); call it in a thread. Must not touch: sandboxes, the network.
"""

from __future__ import annotations

import fnmatch
import posixpath
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from aenv.errors import invalid


@dataclass(frozen=True)
class Owner:
    uid: int
    gid: int
    uname: str
    gname: str


def _clean(name: str) -> str:
    name = posixpath.normpath(name.lstrip("/")) if name not in ("", ".", "./") else "."
    if name == "." or name.startswith("../") or name == "..":
        return "" if name == "." else "/.."
    return name


def _root_of(name: str, pattern: str) -> str | None:
    """The shortest path prefix of `name` (itself included) that the source glob matches."""
    if pattern == "":
        return ""
    parts = name.split("/")
    for i in range(1, len(parts) + 1):
        prefix = "/".join(parts[:i])
        if prefix == pattern or fnmatch.fnmatchcase(prefix, pattern):
            return prefix
    return None


def _is_archive(fileobj: IO[bytes]) -> bool:
    try:
        with tarfile.open(fileobj=fileobj, mode="r:*"):
            return True
    except (tarfile.TarError, OSError, EOFError):
        return False
    finally:
        fileobj.seek(0)


def place(archive: Path, out: Path, src: str, dest: str, dest_is_dir: bool, owner: Owner,
          mode: int | None = None, unpack_archives: bool = False) -> int:
    """Write to `out` the entries of `archive` that `src` selects, placed at `dest` (an
    absolute path in the sandbox). Returns the number of entries written."""
    pattern = _clean(src)
    if pattern == "/..":
        raise invalid(f"COPY source {src!r} is outside the build context")
    if not dest.startswith("/"):
        raise invalid(f"COPY destination {dest!r} must be an absolute path")
    dest_is_dir = dest_is_dir or dest.endswith("/")
    dest = posixpath.normpath(dest)
    try:
        source = tarfile.open(archive, mode="r:*")  # noqa: SIM115 - closed by the `with` below
    except (tarfile.TarError, OSError) as exc:
        raise invalid(f"the uploaded build files are not a tar archive: {exc}") from None
    with source, tarfile.open(out, mode="w", format=tarfile.PAX_FORMAT) as sink:
        members = []
        for member in source.getmembers():
            name = _clean(member.name)
            if name == "/..":
                raise invalid(f"archive entry {member.name!r} is outside the build context")
            if name:
                members.append((name, member))
        roots: dict[str, bool] = {}  # root -> is a directory
        for name, member in members:
            root = _root_of(name, pattern)
            if root is None:
                continue
            if root != name or member.isdir():
                roots[root] = True
            else:
                roots.setdefault(root, False)
        if pattern == "":
            roots = {"": True}
        if not roots:
            raise invalid(f"no files in the build context match {src!r}")
        if len(roots) > 1:
            dest_is_dir = True
        placed: dict[str, str] = {}  # source name -> target (for hard links)
        count = 0

        def put(info: tarfile.TarInfo, target: str, data: IO[bytes] | None) -> None:
            nonlocal count
            info.name = target.lstrip("/") or "."
            info.uid, info.gid, info.uname, info.gname = (owner.uid, owner.gid, owner.uname,
                                                         owner.gname)
            if mode is not None and not info.issym():
                info.mode = mode
            sink.addfile(info, data)
            count += 1

        for name, member in sorted(members, key=lambda m: m[0]):
            root = _root_of(name, pattern)
            if root is None:
                continue
            if roots[root]:
                rel = name[len(root) + 1:] if root else name
                target = posixpath.join(dest, rel) if rel else dest
            else:
                target = posixpath.join(dest, posixpath.basename(root)) if dest_is_dir else dest
            data = source.extractfile(member) if member.isfile() else None
            if unpack_archives and data is not None and not roots[root] and _is_archive(data):
                with tarfile.open(fileobj=data, mode="r:*") as inner:
                    for entry in inner.getmembers():
                        inner_name = _clean(entry.name)
                        if inner_name == "/..":
                            raise invalid(f"{name}: entry {entry.name!r} escapes the destination")
                        if not inner_name or entry.ischr() or entry.isblk() or entry.isfifo():
                            continue
                        inner_data = inner.extractfile(entry) if entry.isfile() else None
                        if entry.islnk():
                            entry.linkname = posixpath.join(dest, _clean(entry.linkname)).lstrip("/")
                        put(entry, posixpath.join(dest, inner_name), inner_data)
                continue
            if member.islnk():
                linked = placed.get(_clean(member.linkname))
                if linked is None:
                    raise invalid(f"hard link {name} points outside what {src!r} copies")
                member.linkname = linked.lstrip("/")
            elif member.ischr() or member.isblk() or member.isfifo():
                continue
            placed[name] = target
            put(member, target, data)
    return count
