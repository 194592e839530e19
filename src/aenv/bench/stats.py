"""Summaries of latency samples, and the host memory reading memory benchmarks use."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Summary:
    name: str
    n: int
    p50_ms: float
    p99_ms: float
    max_ms: float

    def line(self) -> str:
        return (f"{self.name:<52} n={self.n:<4} p50={self.p50_ms:8.2f} ms  "
                f"p99={self.p99_ms:8.2f} ms  max={self.max_ms:8.2f} ms")


def mem_available() -> int:
    """The host's MemAvailable, bytes: what memory benchmarks measure drops of."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summarize(name: str, seconds: list[float]) -> Summary:
    ms = [s * 1000 for s in seconds]
    return Summary(name, len(ms), statistics.median(ms), percentile(ms, 0.99), max(ms))
