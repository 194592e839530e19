"""`GET /metrics`: resource usage of the sandbox, in Go envd's JSON shape.

Owns: `ts`, `cpu_count`, `cpu_used_pct`, `mem_total`, `mem_used`, `mem_cache`,
`mem_total_mib`, `mem_used_mib`, `disk_used`, `disk_total`.

Inside a container /proc/meminfo and /proc/stat describe the host, so the sandbox's own
cgroup (v2) is preferred when it has limits: `memory.max`/`memory.current`/`memory.stat`
and `cpu.max`/`cpu.stat`. CPU usage is the average since the previous call (the first call
measures from envd's start), like gopsutil's `cpu.Percent(0)`.
"""

from __future__ import annotations

import math
import os
import time

CGROUP = "/sys/fs/cgroup"


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _keyed(text: str | None) -> dict[str, int]:
    values: dict[str, int] = {}
    for line in (text or "").splitlines():
        parts = line.replace(":", " ").split()
        if len(parts) >= 2:
            try:
                values[parts[0]] = int(parts[1])
            except ValueError:
                pass
    return values


class Metrics:
    def __init__(self) -> None:
        self._last: tuple[float, float] | None = None  # (wall seconds, cpu seconds)
        self._last = (time.monotonic(), self._cpu_seconds())

    def cpu_count(self) -> int:
        quota = (_read(f"{CGROUP}/cpu.max") or "").split()
        if len(quota) == 2 and quota[0] != "max":
            try:
                return max(1, math.ceil(int(quota[0]) / int(quota[1])))
            except (ValueError, ZeroDivisionError):
                pass
        try:
            return len(os.sched_getaffinity(0))
        except OSError:
            return os.cpu_count() or 1

    def _cpu_seconds(self) -> float:
        """CPU time used: the cgroup's, else the whole machine's busy time."""
        usage = _keyed(_read(f"{CGROUP}/cpu.stat")).get("usage_usec")
        if usage is not None:
            return usage / 1e6
        for line in (_read("/proc/stat") or "").splitlines():
            if line.startswith("cpu "):
                fields = [int(v) for v in line.split()[1:]]
                idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
                return (sum(fields[:8]) - idle) / (os.sysconf("SC_CLK_TCK") or 100)
        return 0.0

    def memory(self) -> tuple[int, int, int]:
        """(total, used, cache) in bytes."""
        limit = (_read(f"{CGROUP}/memory.max") or "").strip()
        current = (_read(f"{CGROUP}/memory.current") or "").strip()
        if limit.isdigit() and current.isdigit():
            cache = _keyed(_read(f"{CGROUP}/memory.stat")).get("file", 0)
            return int(limit), int(current), cache
        info = _keyed(_read("/proc/meminfo"))
        total = info.get("MemTotal", 0) * 1024
        available = info.get("MemAvailable", info.get("MemFree", 0)) * 1024
        return total, total - available, info.get("Cached", 0) * 1024

    def snapshot(self) -> dict[str, float | int]:
        now, cpu = time.monotonic(), self._cpu_seconds()
        count = self.cpu_count()
        percent = 0.0
        if self._last is not None and now > self._last[0]:
            percent = max(0.0, (cpu - self._last[1]) / (now - self._last[0]) / count * 100)
        self._last = (now, cpu)
        total, used, cache = self.memory()
        try:
            fs = os.statvfs("/")
            disk_total = fs.f_blocks * fs.f_frsize
            disk_used = disk_total - fs.f_bavail * fs.f_frsize
        except OSError:
            disk_total = disk_used = 0
        return {
            "ts": int(time.time()),
            "cpu_count": count,
            "cpu_used_pct": round(min(percent, 100.0), 2),
            "mem_total_mib": total // (1 << 20),
            "mem_used_mib": used // (1 << 20),
            "mem_total": total,
            "mem_used": used,
            "mem_cache": cache,
            "disk_used": disk_used,
            "disk_total": disk_total,
        }
