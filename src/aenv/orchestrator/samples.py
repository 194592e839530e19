"""Resource samples over time: every running sandbox's CPU, memory and disk use, taken at a
fixed interval and kept per sandbox, bounded (E2B's `GET /sandboxes/{id}/metrics?start&end`).

Owns: the sampling loop (one `SandboxManager.metrics` call per running sandbox per interval,
at most `SAMPLES_AT_ONCE` at a time) and the series it keeps: the last `keep` samples of each
sandbox the manager knows (a paused sandbox keeps its series; a sandbox gone from the manager
loses it at the next round). Must not touch: sandbox records, the driver (only through the
manager's public `metrics`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import dataclass
from datetime import datetime

from aenv.errors import AenvError
from aenv.orchestrator.manager import SandboxManager
from aenv.runtime.base import ResourceUsage

log = logging.getLogger("aenv.orchestrator")

SAMPLES_AT_ONCE = 8


@dataclass(frozen=True)
class Sample:
    at: datetime
    cpu_count: int
    usage: ResourceUsage


class MetricSamples:
    def __init__(self, manager: SandboxManager, interval_s: float, keep: int) -> None:
        self.manager = manager
        self.interval_s = interval_s
        self.keep = max(1, keep)
        self._series: dict[str, collections.deque[Sample]] = {}

    async def run(self) -> None:
        """Sample forever (cancel to stop)."""
        if self.interval_s <= 0:
            return
        limit = asyncio.Semaphore(SAMPLES_AT_ONCE)
        while True:
            await self.sample_all(limit)
            await asyncio.sleep(self.interval_s)

    async def sample_all(self, limit: asyncio.Semaphore | None = None) -> None:
        limit = limit or asyncio.Semaphore(SAMPLES_AT_ONCE)
        for gone in [sid for sid in self._series if not self._known(sid)]:
            del self._series[gone]
        await asyncio.gather(*[self._sample(sid, limit) for sid in self.manager.running_ids()])

    def _known(self, sandbox_id: str) -> bool:
        try:
            self.manager.get(sandbox_id)
        except AenvError:
            return False
        return True

    async def _sample(self, sandbox_id: str, limit: asyncio.Semaphore) -> None:
        async with limit:
            sample = await self.take(sandbox_id)
        if sample is not None:
            self.add(sandbox_id, sample)

    async def take(self, sandbox_id: str) -> Sample | None:
        """A sample of a running sandbox now (None: it is not running, or just went)."""
        try:
            rec = self.manager.get(sandbox_id)
            at, usage = await self.manager.metrics(sandbox_id)
        except AenvError:
            return None
        except OSError as exc:
            log.warning("sampling sandbox %s failed: %s", sandbox_id, exc)
            return None
        return Sample(at, rec.cpu_count, usage)

    def add(self, sandbox_id: str, sample: Sample) -> None:
        series = self._series.get(sandbox_id)
        if series is None:
            series = self._series[sandbox_id] = collections.deque(maxlen=self.keep)
        series.append(sample)

    def series(self, sandbox_id: str, start: datetime | None = None,
               end: datetime | None = None) -> list[Sample]:
        return [s for s in self._series.get(sandbox_id, ())
                if (start is None or s.at >= start) and (end is None or s.at <= end)]

    def latest(self, sandbox_id: str) -> Sample | None:
        series = self._series.get(sandbox_id)
        return series[-1] if series else None
