"""cgroup v1 layout, limits and accounting for container sandboxes.

Owns: the directories `<root>/<controller>/<parent>/<sandbox_id>` for the controllers below
(created, limited and joined by the sandbox's own setup process in the fork-server; read and
removed here by the driver).
Must not touch: any other cgroup, including the one the server itself runs in.

This host mounts cgroup v1 controllers separately (cpu and cpuacct are distinct hierarchies);
cgroup2 has no controllers, so v1 is the only way to get limits.
"""

from __future__ import annotations

import errno
import os
import time
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
CONTROLLERS = ("memory", "cpu", "cpuacct", "pids", "freezer", "devices")
CPU_PERIOD_US = 100_000
CPU_SHARES = 1024  # the kernel's default weight: every running sandbox the same
# The weight of a sandbox while it is being restored (criu, then its own tasks until envd
# has answered /init): restores in flight run ahead of the work of running sandboxes, so a
# fork's 16 children are not held up by their already-running, busy siblings.
CPU_SHARES_RESTORING = 16 * CPU_SHARES
# Device nodes a sandbox may use: the ones its /dev has, plus pseudo-terminals. mknod of any
# node is allowed ('m'); opening anything else fails with EPERM even for root inside.
DEVICE_ALLOW = (
    "c *:* m", "b *:* m",
    "c 1:3 rwm", "c 1:5 rwm", "c 1:7 rwm", "c 1:8 rwm", "c 1:9 rwm",  # null zero full (u)random
    "c 5:0 rwm", "c 5:1 rwm", "c 5:2 rwm", "c 136:* rwm",  # tty console ptmx pts/*
)


@dataclass(frozen=True)
class CgroupLayout:
    root: Path = CGROUP_ROOT
    parent: str = "aenv"

    def path(self, controller: str, sandbox_id: str) -> Path:
        return self.root / controller / self.parent / sandbox_id

    def ensure_parents(self) -> None:
        for ctrl in CONTROLLERS:
            base = self.root / ctrl
            if not base.is_dir():
                raise OSError(errno.ENOENT, f"cgroup v1 controller {ctrl} not mounted at {base}")
            (base / self.parent).mkdir(exist_ok=True)

    def zygote_config(self) -> dict[str, object]:
        """What the fork-server needs to make cgroup sets for its warm children: where, and
        the writes common to every sandbox (device rules), as (file, value, required)."""
        static = {"devices": [("devices.deny", "a", True)]
                  + [("devices.allow", rule, True) for rule in DEVICE_ALLOW]}
        return {"root": str(self.root), "parent": self.parent,
                "controllers": list(CONTROLLERS), "static": static}

    @staticmethod
    def limits(memory_mb: int, cpu_count: int, pids_max: int
               ) -> dict[str, list[tuple[str, str, bool]]]:
        """Per-sandbox limit writes, in order. memory.limit before memsw: the kernel wants
        memsw >= limit at every step; memsw is absent without swap accounting."""
        mem = str(memory_mb * 2**20)
        return {
            "memory": [("memory.limit_in_bytes", mem, True),
                       ("memory.memsw.limit_in_bytes", mem, False)],
            "cpu": [("cpu.cfs_period_us", str(CPU_PERIOD_US), True),
                    ("cpu.cfs_quota_us", str(cpu_count * CPU_PERIOD_US), True)],
            "pids": [("pids.max", str(pids_max), True)],
        }

    def set_cpu_shares(self, sandbox_id: str, shares: int) -> None:
        (self.path("cpu", sandbox_id) / "cpu.shares").write_text(str(shares))

    def read(self, controller: str, sandbox_id: str, name: str) -> str:
        return (self.path(controller, sandbox_id) / name).read_text()

    def pids(self, sandbox_id: str) -> list[int]:
        """Processes in the sandbox's pids cgroup (the one every sandbox process joins)."""
        try:
            text = self.read("pids", sandbox_id, "cgroup.procs")
        except FileNotFoundError:
            return []
        return [int(x) for x in text.split()]

    def exists(self, sandbox_id: str) -> bool:
        return self.path("memory", sandbox_id).is_dir()

    def sweep_warm(self, zygote_pid: int | None = None) -> None:
        """Remove cgroup sets of warm (never used) fork-server children: those of
        `zygote_pid`, or of any fork-server that is no longer running. Blocking."""
        base = self.root / "pids" / self.parent
        if not base.is_dir():
            return
        for entry in base.iterdir():
            parts = entry.name.split("-")
            if len(parts) != 3 or parts[0] != "warm" or not parts[1].isdigit():
                continue
            owner = int(parts[1])
            if zygote_pid is not None and owner != zygote_pid:
                continue
            if zygote_pid is None and Path(f"/proc/{owner}").exists():
                continue  # a live fork-server's pool (another driver instance)
            for pid in self.pids(entry.name):
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
            try:
                self.remove(entry.name)
            except OSError:
                pass  # retried at the next sweep

    def remove(self, sandbox_id: str, timeout: float = 5.0) -> None:
        """rmdir every controller directory. Blocking: call it in a thread. Retries EBUSY while
        the last tasks of a killed sandbox finish exiting."""
        deadline = time.monotonic() + timeout
        for ctrl in CONTROLLERS:
            path = self.path(ctrl, sandbox_id)
            delay = 0.002
            while True:
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:
                    if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                        raise
                    time.sleep(delay)
                    delay = min(delay * 2, 0.1)


@dataclass(frozen=True)
class CgroupSample:
    cpu_ns: int
    mem_used: int
    mem_limit: int
    mem_cache: int


def sample(layout: CgroupLayout, sandbox_id: str) -> CgroupSample:
    cpu_ns = int(layout.read("cpuacct", sandbox_id, "cpuacct.usage"))
    used = int(layout.read("memory", sandbox_id, "memory.usage_in_bytes"))
    limit = int(layout.read("memory", sandbox_id, "memory.limit_in_bytes"))
    cache = 0
    for line in layout.read("memory", sandbox_id, "memory.stat").splitlines():
        key, _, value = line.partition(" ")
        if key == "total_cache":
            cache = int(value)
            break
    return CgroupSample(cpu_ns, used, limit, cache)
