"""The node's Prometheus metrics (`GET /metrics`, no API key), with `prometheus_client`.

Owns: this server's own registry (never the library's global one) and the metric names
`docs/grafana-dashboard.json` charts:
- `aenv_sandboxes{state}`: sandboxes by state (creating, running, pausing, paused, ...);
- `aenv_operation_seconds{operation}` (histogram): create, restore (a create from a snapshot),
  pause, resume, snapshot, fork; from the lifecycle events the manager records
  (`orchestrator/events.py`), so that TTL pauses count too;
  `aenv_operation_failures_total{operation}`;
- `aenv_api_errors_total{code, status}`: every error answer of the control plane, by aenv code;
- `aenv_repository_bytes{kind}`: what this node's snapshots hold (`logical`) and added to the
  snapshot repository (`stored`, after deduplication); `aenv_snapshot_cache_*`: the local cache
  of snapshot images in front of it;
- `aenv_cache_hits_total{cache}`, `aenv_cache_misses_total{cache}` and
  `aenv_cache_hit_ratio{cache}` for `layers` (image layers found local at create) and
  `snapshots` (snapshot images found in the local cache);
- `aenv_layer_cache_*`: the image layer cache (bytes, limit, layers, evictions).
Gauges and cache counters are read at scrape time from their owners; nothing here is a copy.
Must not touch: the state it reads (manager, caches, store), HTTP routing.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from aenv.errors import ErrorCode
from aenv.images.cache import LayerCache
from aenv.orchestrator.events import LogEntry, SandboxEvents
from aenv.orchestrator.manager import SandboxManager

OPERATIONS = ("create", "restore", "pause", "resume", "snapshot", "fork")
# Seconds: a pooled create is ~5 ms, a restore ~50-200 ms, a pause of a large sandbox seconds.
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _NodeState(Collector):
    """Gauges and counters read from their owners at each scrape."""

    def __init__(self, manager: SandboxManager, layers: LayerCache) -> None:
        self.manager = manager
        self.layers = layers

    def collect(self) -> Iterable[Metric]:
        states = GaugeMetricFamily("aenv_sandboxes", "sandboxes on this node by state",
                                   labels=["state"])
        for state, count in self.manager.state_counts().items():
            states.add_metric([state], count)
        yield states

        logical = stored = 0
        for tpl in self.manager.store.iter_templates():
            logical += tpl.size_bytes or 0
            stored += tpl.stored_bytes or 0
        repo = GaugeMetricFamily("aenv_repository_bytes", "bytes of this node's snapshots in "
                                 "the repository: logical, and stored after deduplication",
                                 labels=["kind"])
        repo.add_metric(["logical"], logical)
        repo.add_metric(["stored"], stored)
        yield repo

        lst = self.layers.stats()
        hits = {"layers": lst.hits}
        misses = {"layers": lst.misses}
        snapshots = self.manager.snapshots
        if snapshots is not None:
            sst = snapshots.stats()
            hits["snapshots"], misses["snapshots"] = sst.hits, sst.misses
            yield GaugeMetricFamily("aenv_snapshot_cache_bytes",
                                    "bytes of snapshot images in the local cache", sst.bytes)
            yield GaugeMetricFamily("aenv_snapshot_cache_max_bytes",
                                    "the local snapshot cache's limit", sst.max_bytes)
            yield GaugeMetricFamily("aenv_snapshot_cache_entries",
                                    "snapshot images in the local cache", sst.entries)
            yield CounterMetricFamily("aenv_snapshot_cache_evictions",
                                      "snapshot images evicted from the local cache",
                                      sst.evictions)
        hit = CounterMetricFamily("aenv_cache_hits", "lookups found local", labels=["cache"])
        miss = CounterMetricFamily("aenv_cache_misses", "lookups fetched from elsewhere",
                                   labels=["cache"])
        ratio = GaugeMetricFamily("aenv_cache_hit_ratio", "hits / (hits + misses) since start",
                                  labels=["cache"])
        for cache, found in hits.items():
            hit.add_metric([cache], found)
            miss.add_metric([cache], misses[cache])
            total = found + misses[cache]
            ratio.add_metric([cache], found / total if total else 1.0)
        yield from (hit, miss, ratio)

        for name, help_, value in (
                ("bytes", "bytes of unpacked image layers on disk", lst.bytes),
                ("max_bytes", "configured limit (0: unbounded)", lst.max_bytes),
                ("layers", "image layers on disk", lst.layers),
                ("held_layers", "layers in use", lst.held)):
            yield GaugeMetricFamily(f"aenv_layer_cache_{name}", help_, value)
        for name, help_, value in (
                ("hits", "layers found local at create", lst.hits),
                ("misses", "layers fetched again at create", lst.misses),
                ("evictions", "layers evicted", lst.evictions),
                ("evicted_bytes", "bytes evicted", lst.evicted_bytes)):
            yield CounterMetricFamily(f"aenv_layer_cache_{name}", help_, value)


class NodeMetrics:
    """One server's metrics registry."""

    def __init__(self, manager: SandboxManager, layers: LayerCache,
                 events: SandboxEvents) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.latency = Histogram("aenv_operation_seconds", "duration of sandbox operations",
                                 ["operation"], buckets=BUCKETS, registry=self.registry)
        self.failures = Counter("aenv_operation_failures", "sandbox operations that failed",
                                ["operation"], registry=self.registry)
        self.errors = Counter("aenv_api_errors", "error answers of the control plane",
                              ["code", "status"], registry=self.registry)
        for op in OPERATIONS:  # every series exists from the start (rate() needs a zero)
            self.latency.labels(op)
            self.failures.labels(op)
        self.registry.register(_NodeState(manager, layers))
        events.on_event(self._on_event)

    def _on_event(self, _sandbox_id: str, entry: LogEntry) -> None:
        op = entry.fields.get("op")
        if op not in OPERATIONS:
            return
        if entry.level == "error":
            self.failures.labels(op).inc()
        elif "seconds" in entry.fields:
            self.latency.labels(op).observe(float(entry.fields["seconds"]))

    def count_error(self, code: ErrorCode, status: int) -> None:
        self.errors.labels(code.value, str(status)).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
