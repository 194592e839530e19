"""Sandbox logs, metrics over time and the node's Prometheus metrics, through the official
SDK (its generated API client where the `Sandbox` class has no call for it) against a real
server.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import signal
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from e2b import ConnectionConfig, Sandbox
from e2b.api.client.api.sandboxes import (
    get_sandboxes_metrics,
    get_sandboxes_sandbox_id_logs,
    get_v_2_sandboxes_sandbox_id_logs,
)
from e2b.api.client.models import LogLevel, LogsDirection, SandboxLogEntry
from e2b.api.client.types import UNSET
from e2b.api.client_sync import get_api_client
from e2e_helpers import assert_json_error, container_only, wait_until
from prometheus_client.parser import text_string_to_metric_families

from aenv.devserver import ServerProcess

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json"


@pytest.fixture(scope="module")
def client() -> Iterator[object]:
    yield get_api_client(ConnectionConfig())


def _logs(client: object, sandbox_id: str, **params: object) -> list[SandboxLogEntry]:
    res = get_v_2_sandboxes_sandbox_id_logs.sync_detailed(
        sandbox_id, client=client, **params)  # type: ignore[arg-type]
    assert res.status_code == 200, res.content
    assert res.parsed is not None and hasattr(res.parsed, "logs"), res.content
    return list(res.parsed.logs)


def _field(entry: SandboxLogEntry, name: str) -> str | None:
    return entry.fields.additional_properties.get(name)


def _events(entries: list[SandboxLogEntry]) -> list[str]:
    return [e.fields["event"] for e in entries if "event" in e.fields.additional_properties]


def test_logs_lifecycle_cursors_and_filters(client: object, api: httpx.Client) -> None:
    sbx = Sandbox.create(timeout=120)
    sid = sbx.sandbox_id
    try:
        sbx.commands.run("echo marker-from-a-command")
        sbx.pause()
        sbx = Sandbox.connect(sid, timeout=120)
        sbx.kill()
    except BaseException:
        Sandbox.kill(sid)
        raise
    # All of it is kept after the sandbox is gone (and its envd log was copied in).
    entries = _logs(client, sid)
    assert _events(entries)[:4] == ["created", "paused", "resumed", "killed"], entries
    stamps = [e.timestamp for e in entries]
    assert stamps == sorted(stamps)
    assert all(isinstance(e.level, LogLevel) for e in entries)
    envd = [e for e in entries if _field(e, "source") == "envd"]
    assert any("marker-from-a-command" in e.message for e in envd), envd
    paused = next(e for e in entries if _field(e, "event") == "paused")
    assert paused.fields["mode"] == "full" and float(paused.fields["seconds"]) > 0

    # Forward pages of 2, each from the last one's time + 1 ms: every entry once, in order.
    paged: list[SandboxLogEntry] = []
    cursor: int | object = UNSET
    while True:
        page = _logs(client, sid, limit=2, cursor=cursor, direction=LogsDirection.FORWARD)
        assert len(page) <= 2
        if not page:
            break
        paged += page
        cursor = int(page[-1].timestamp.timestamp() * 1000) + 1
    lifecycle = [e.message for e in entries if _field(e, "source") == "lifecycle"]
    assert [e.message for e in paged if _field(e, "source") == "lifecycle"] == lifecycle

    backward = _logs(client, sid, direction=LogsDirection.BACKWARD, limit=3)
    assert [e.message for e in backward] == [e.message for e in entries[::-1][:3]]
    assert _logs(client, sid, level=LogLevel.ERROR) == []  # nothing went wrong
    found = _logs(client, sid, search="MARKER-FROM")  # case-insensitive
    assert found and all("marker-from" in e.message for e in found)

    # v1: the same entries, and each as a JSON line
    v1 = get_sandboxes_sandbox_id_logs.sync_detailed(sid, client=client)  # type: ignore[arg-type]
    assert v1.status_code == 200 and v1.parsed is not None
    assert len(v1.parsed.log_entries) == len(entries)
    assert '"event": "created"' in v1.parsed.logs[0].line

    # Bad input is a 400 with a message; an id nobody knows a 404.
    assert_json_error(api.get(f"/v2/sandboxes/{sid}/logs", params={"direction": "up"}), 400)
    assert_json_error(api.get(f"/v2/sandboxes/{sid}/logs", params={"limit": "0"}), 400)
    assert_json_error(api.get(f"/v2/sandboxes/{sid}/logs", params={"level": "loud"}), 400)
    assert_json_error(api.get("/v2/sandboxes/inofakesandbox00000000/logs"), 404)


@container_only
def test_logs_of_a_fork_and_a_death(client: object) -> None:
    parent = Sandbox.create(timeout=120)
    children = []
    try:
        children = [c for c in parent.fork(count=1) if isinstance(c, Sandbox)]
        assert len(children) == 1
        child = children[0]
        assert "forked" in _events(_logs(client, parent.sandbox_id))
        child_events = _events(_logs(client, child.sandbox_id))
        assert child_events[:2] == ["created", "forked_from"], child_events
        # Its processes killed from the host (envd, its init, with them): the sandbox dies,
        # and its log says why.
        from aenv.runtime.container import cgroups
        procs = cgroups.CGROUP_ROOT / "pids" / "aenv" / child.sandbox_id / "cgroup.procs"
        for pid in procs.read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        died = wait_until(lambda: [e for e in _logs(client, child.sandbox_id)
                                   if _field(e, "event") == "died"], 30, what="died event")
        assert died[0].level == LogLevel.ERROR and "envd" in died[0].fields["reason"]
    finally:
        for sbx in (parent, *children):
            Sandbox.kill(sbx.sandbox_id)


def test_metrics_over_time_and_batch(client: object, api: httpx.Client) -> None:
    sbx = Sandbox.create(timeout=120)
    try:
        start = datetime.now(UTC) - timedelta(seconds=2)
        # Sampled every 5 s (sandbox.metrics_interval_s): two kept samples (and a current
        # one) within ~10 s.
        series = wait_until(lambda: (m := sbx.get_metrics(start=start)) and len(m) >= 3 and m,
                            20, interval=1, what="two kept samples")
        stamps = [m.timestamp for m in series]
        assert stamps == sorted(stamps)
        assert all(m.mem_total == sbx.get_info().memory_mb * 2**20 for m in series)
        # between kept samples (the last one is the current sample, taken at the request)
        gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(stamps[:-1])]
        assert all(3 <= g <= 8 for g in gaps), gaps  # a fixed interval
        # A range in the past holds no current sample, only the kept ones within it.
        first = stamps[0]
        only = sbx.get_metrics(start=first, end=first + timedelta(seconds=1))
        assert [m.timestamp for m in only] == [first]
        assert sbx.get_metrics(start=first - timedelta(hours=2),
                               end=first - timedelta(hours=1)) == []
        assert_json_error(api.get(f"/sandboxes/{sbx.sandbox_id}/metrics",
                                  params={"start": "10", "end": "5"}), 400)
        assert_json_error(api.get(f"/sandboxes/{sbx.sandbox_id}/metrics",
                                  params={"start": "soon"}), 400)

        res = get_sandboxes_metrics.sync_detailed(
            client=client, sandbox_ids=[sbx.sandbox_id, "inofakesandbox00000000"])  # type: ignore[arg-type]
        assert res.status_code == 200, res.content
        assert res.parsed is not None and hasattr(res.parsed, "sandboxes")
        batch = res.parsed.sandboxes
        assert set(batch) == {sbx.sandbox_id}, batch
        assert batch[sbx.sandbox_id]["memTotal"] == series[0].mem_total
        assert_json_error(api.get("/sandboxes/metrics"), 400)

        sbx.pause()  # a paused sandbox keeps its series
        assert len(Sandbox.get_metrics(sbx.sandbox_id, start=start)) >= 2
    finally:
        Sandbox.kill(sbx.sandbox_id)


def _scrape(server: ServerProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(server.url + "/metrics").text  # no API key, like /health
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_prometheus_metrics(server: ServerProcess, api: httpx.Client) -> None:
    before = _scrape(server)
    sbx = Sandbox.create(timeout=120)
    try:
        now = _scrape(server)
        running = now[("aenv_sandboxes", (("state", "running"),))]
        assert running >= 1
        sbx.pause()
        after = _scrape(server)
        assert after[("aenv_sandboxes", (("state", "paused"),))] >= 1
        assert after[("aenv_sandboxes", (("state", "running"),))] == running - 1

        def count(m: dict[tuple[str, tuple[tuple[str, str], ...]], float], op: str) -> float:
            return m.get(("aenv_operation_seconds_count", (("operation", op),)), 0.0)

        assert count(after, "create") + count(after, "restore") > \
            count(before, "create") + count(before, "restore")
        assert count(after, "pause") == count(before, "pause") + 1
        assert ("aenv_operation_seconds_bucket", (("le", "+Inf"), ("operation", "pause"))) in after
        # an error answer is counted by its code
        key = ("aenv_api_errors_total", (("code", "not_found"), ("status", "404")))
        assert_json_error(api.get("/sandboxes/inofakesandbox00000000"), 404)
        assert _scrape(server)[key] == after.get(key, 0.0) + 1
        # Every metric the Grafana dashboard charts is exposed.
        dashboard = json.loads(DASHBOARD.read_text())
        charted = {m for p in dashboard["panels"] for t in p["targets"]
                   for m in re.findall(r"\baenv_[a-z_]+", t["expr"])}
        assert len(charted) >= 10, charted
        assert charted - {k[0] for k in after} == set()
    finally:
        Sandbox.kill(sbx.sandbox_id)
