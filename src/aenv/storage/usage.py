"""How much a directory tree takes: the one walk every part of the node uses to size a
workspace's writable layer, a checkpoint image or a cache entry. Blocking: call from a thread.

Owns: the two measures. Must not touch: the trees it measures (it only stats them).
"""

from __future__ import annotations

import os
from pathlib import Path


def allocated_bytes(root: Path) -> int:
    """Bytes allocated on disk under `root`, directories included, hard links counted once
    (what a quota or a full disk sees)."""
    total = 0
    seen: set[tuple[int, int]] = set()
    stack = [str(root)]
    while stack:
        path = stack.pop()
        try:
            entries = list(os.scandir(path))
        except OSError:
            continue
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if st.st_nlink > 1:
                key = (st.st_dev, st.st_ino)
                if key in seen:
                    continue
                seen.add(key)
            total += st.st_blocks * 512
            if entry.is_dir(follow_symlinks=False):
                stack.append(entry.path)
    return total


def apparent_bytes(root: Path) -> int:
    """The sum of the sizes of the files under `root` (what a copy of it transfers)."""
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                continue
    return total
