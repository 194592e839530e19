"""What a server killed in the middle of an operation leaves behind in the container runtime,
found and settled at the next start (and, for orphans, periodically).

A `kill -9` of the server does not stop the programs it started: a criu dump goes on (or
dies of the closed pipe) with the sandbox's cgroup frozen by our pre-dump hook, a restore
leaves a half-made tree and a mounted root, a create leaves a sandbox with no record. The
driver's `settle`/`abort_resume`/`interrupted_pause`/`sweep` (runtime/base.py,
`RecoverableDriver`) are built from the pieces here; the orchestrator decides, from its
records, which one each sandbox needs (orchestrator/recovery.py).

Owns: finding helper processes (criu) working on a sandbox, judging whether a pause's image
is complete, listing stale checkpoint images and orphan workspaces. Must not touch: records,
or anything of a sandbox the caller did not name (other servers share the host's cgroups).
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Iterable
from pathlib import Path

from aenv.runtime.container import checkpoint

PAUSE_IMAGE_PREFIX = "pause-"
# Written by criu as the last step of a successful dump, after the tree is killed (pause)
# and every image file is closed: its presence says the image is whole.
DUMP_COMPLETE = "stats-dump"


def _cmdline(pid: str) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return []
    return [arg.decode(errors="replace") for arg in raw.split(b"\0") if arg]


def criu_processes() -> list[tuple[int, list[str]]]:
    """Every criu process on the host with its arguments: one scan of /proc, shared by all
    the sandboxes a start-up settles."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and (argv := _cmdline(pid)) and Path(argv[0]).name == "criu":
            found.append((int(pid), argv))
    return found


def helpers_of(init_pid: int | None, paths: Iterable[Path],
               criu: list[tuple[int, list[str]]]) -> list[int]:
    """Pids among `criu` (criu_processes) working on a sandbox: a dump of its init
    (`-t <pid>`) or a criu run naming a path under one of `paths` (its workspace)."""
    prefixes = [str(p).rstrip("/") + "/" for p in paths]
    found = []
    for pid, argv in criu:
        dumps_init = init_pid is not None and any(
            a == "-t" and b == str(init_pid) for a, b in itertools.pairwise(argv))
        if dumps_init or any(arg.startswith(p) or arg + "/" in prefixes
                             for arg in argv for p in prefixes):
            found.append(pid)
    return found


def pause_images(workspace: Path) -> list[Path]:
    """The pause images in a workspace, newest first."""
    root = workspace / "checkpoints"
    if not root.is_dir():
        return []
    images = [p for p in root.iterdir() if p.name.startswith(PAUSE_IMAGE_PREFIX)
              and p.name[len(PAUSE_IMAGE_PREFIX):].isdigit()]
    return sorted(images, key=lambda p: int(p.name[len(PAUSE_IMAGE_PREFIX):]), reverse=True)


def complete_pause_image(workspace: Path) -> Path | None:
    """The newest pause image that criu finished writing, if any."""
    for images in pause_images(workspace):
        if (images / DUMP_COMPLETE).exists() and (images / "inventory.img").exists():
            return images
    return None


def stale_images(workspace: Path, keep: Path | None) -> list[Path]:
    """Pause images a sandbox no longer needs: all but `keep` (its current paused image),
    and images dropped locally (orchestrator/paused.py) whose deletion a crash cut short."""
    dropped = [p for p in (workspace / "checkpoints").glob(PAUSE_IMAGE_PREFIX + "*.dropped")]
    return [p for p in pause_images(workspace) if keep is None or p != keep] + dropped


def frozen(freezer: Path) -> bool:
    try:
        return (freezer / "freezer.state").read_text().strip() != "THAWED"
    except OSError:
        return False


def thaw(freezer: Path) -> None:
    with contextlib.suppress(OSError):
        checkpoint.thaw(freezer)


def orphan_workspaces(workspaces: Path, known: set[str]) -> list[Path]:
    """Workspaces of sandboxes nobody has a record of (a create cut short)."""
    if not workspaces.is_dir():
        return []
    return [p for p in workspaces.iterdir() if p.name not in known and p.is_dir()
            and not p.name.startswith(".")]
