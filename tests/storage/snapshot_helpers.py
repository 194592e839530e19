"""Helpers to build snapshot-like directory trees and compare them exactly."""

from __future__ import annotations

import hashlib
import os
import random
import stat
from pathlib import Path
from typing import Any


def write_random(path: Path, size: int, seed: int) -> None:
    path.write_bytes(random.Random(seed).randbytes(size))


def tree_signature(root: Path, *, times: bool = True) -> dict[str, tuple[Any, ...]]:
    """Everything a restore must reproduce: type, mode, owner, content hash, link targets,
    device numbers, xattrs, and (optionally) mtimes of files."""
    sig: dict[str, tuple[Any, ...]] = {}
    inodes: dict[tuple[int, int], str] = {}
    st_root = os.lstat(root)
    sig["."] = ("dir", stat.S_IMODE(st_root.st_mode), st_root.st_uid)
    for dirpath, dirs, files in os.walk(root):
        for name in sorted(dirs + files):
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            st = os.lstat(p)
            fmt = stat.S_IFMT(st.st_mode)
            common = (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid)
            try:
                xattrs = tuple(sorted((n, os.getxattr(p, n, follow_symlinks=False))
                                      for n in os.listxattr(p, follow_symlinks=False)))
            except OSError:
                xattrs = ()
            if fmt == stat.S_IFREG:
                link = inodes.setdefault((st.st_dev, st.st_ino), rel) if st.st_nlink > 1 else rel
                digest = hashlib.sha256(p.read_bytes()).hexdigest()
                sig[rel] = ("file", *common, st.st_size, digest, link,
                            st.st_mtime_ns if times else 0, xattrs)
            elif fmt == stat.S_IFDIR:
                sig[rel] = ("dir", *common, xattrs)
            elif fmt == stat.S_IFLNK:
                sig[rel] = ("symlink", os.readlink(p), st.st_uid)
            else:
                sig[rel] = ("special", fmt, *common, st.st_rdev)
    return sig
