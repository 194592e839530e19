"""kill -9 at every named step of every operation (aenv.faults.CRASH_POINTS), restart, and
the invariants: no file lost, nothing frozen, nothing orphaned, every listed snapshot usable.

Each test arms one crash point (`AENV_CRASH_AT`), drives the operation through the API, checks
that the server died exactly there (its log), starts a clean server on the same home and
port, and checks what the recovery made of it (orchestrator/recovery.py)."""

from __future__ import annotations

import os
import time

import httpx
import pytest
from e2b import Sandbox
from e2e_helpers import container_only, wait_until
from faults_helpers import Node, assert_converged, assert_intact, listed, set_up_sandbox, snapshots

from aenv import faults

pytestmark = [container_only, pytest.mark.slow]


def _crash_during(node: Node, point: str, method: str, path: str,
                  json: dict[str, object] | None = None) -> None:
    """Send the request that reaches `point`; the server dies before it answers."""
    with node.api() as api, pytest.raises(httpx.TransportError):
        api.request(method, path, json=json)
    node.wait_crashed(point)


@pytest.mark.parametrize("point", ["create:intent", "create:made"])
def test_create_cut_short_leaves_nothing(node: Node, baseline: set[str], point: str) -> None:
    node.start(point)
    _crash_during(node, point, "POST", "/sandboxes", {"templateID": "base", "timeout": 300})
    node.start()
    assert assert_converged(node, baseline) == {}
    assert node.server is not None
    assert "create was cut short" in (node.home / "server.log").read_text()


@pytest.mark.parametrize("point", ["pause:intent", "pause:criu"])
def test_pause_cut_short_runs_again(node: Node, baseline: set[str], point: str) -> None:
    node.start(point)
    sbx, sums = set_up_sandbox(node)
    _crash_during(node, point, "POST", f"/sandboxes/{sbx.sandbox_id}/pause")
    node.start()
    state = assert_converged(node, baseline)
    # Cut short before the image was whole: running again, with its processes. With the
    # server gone while criu ran, criu may have finished the image first: then paused.
    expected = {"running"} if point == "pause:intent" else {"running", "paused"}
    assert set(state) == {sbx.sandbox_id} and state[sbx.sandbox_id] in expected, state
    assert_intact(node, sbx.sandbox_id, sums)
    # And it still pauses and resumes.
    with node.api() as api:
        assert api.post(f"/sandboxes/{sbx.sandbox_id}/pause").status_code == 204
    assert_intact(node, sbx.sandbox_id, sums)
    assert_converged(node, baseline)


def test_pause_with_a_complete_image_is_paused(node: Node, baseline: set[str]) -> None:
    point = "pause:dumped"
    node.start(point)
    sbx, sums = set_up_sandbox(node)
    _crash_during(node, point, "POST", f"/sandboxes/{sbx.sandbox_id}/pause")
    node.start()
    assert assert_converged(node, baseline) == {sbx.sandbox_id: "paused"}
    assert_intact(node, sbx.sandbox_id, sums)  # resumed by connect: processes included
    assert assert_converged(node, baseline) == {sbx.sandbox_id: "running"}


def test_filesystem_pause_cut_short_after_the_kill_is_paused(node: Node,
                                                             baseline: set[str]) -> None:
    """A pause without memory that died after its kill: its files are what it keeps, so it
    is rolled forward to paused (filesystem), never destroyed."""
    point = "pause:dumped"
    node.start(point)
    sbx, sums = set_up_sandbox(node)
    _crash_during(node, point, "POST", f"/sandboxes/{sbx.sandbox_id}/pause", {"memory": False})
    node.start()
    assert assert_converged(node, baseline) == {sbx.sandbox_id: "paused"}
    with node.api() as api:
        assert api.get(f"/sandboxes/{sbx.sandbox_id}").json().get("pauseMode") == "filesystem"
    assert_intact(node, sbx.sandbox_id, sums, processes=False)  # booted afresh on its files
    assert_converged(node, baseline)


@pytest.mark.parametrize("point", ["resume:intent", "resume:criu", "resume:restored"])
def test_resume_cut_short_is_paused_again(node: Node, baseline: set[str], point: str) -> None:
    node.start(point)
    sbx, sums = set_up_sandbox(node)
    with node.api() as api:
        assert api.post(f"/sandboxes/{sbx.sandbox_id}/pause").status_code == 204
    _crash_during(node, point, "POST", f"/sandboxes/{sbx.sandbox_id}/connect", {"timeout": 300})
    node.start()
    assert assert_converged(node, baseline) == {sbx.sandbox_id: "paused"}
    assert_intact(node, sbx.sandbox_id, sums)
    assert_converged(node, baseline)


@pytest.mark.parametrize("point", ["snapshot:criu", "snapshot:dumped"])
def test_snapshot_cut_short_thaws_the_source(node: Node, baseline: set[str],
                                             point: str) -> None:
    node.start(point)
    sbx, sums = set_up_sandbox(node)
    _crash_during(node, point, "POST", f"/sandboxes/{sbx.sandbox_id}/snapshots", {})
    node.start()
    assert assert_converged(node, baseline) == {sbx.sandbox_id: "running"}
    assert snapshots(node) == []  # never committed: not listed, its partial image gone
    leftover = list((node.home / "snapshots").iterdir())
    assert leftover == [], leftover
    assert_intact(node, sbx.sandbox_id, sums)


@pytest.mark.parametrize("point", ["snapshot:recorded", "push:layers", "repository:chunks"])
def test_recorded_snapshot_is_usable_and_reaches_the_repository(
        node: Node, baseline: set[str], point: str) -> None:
    node.start(point)
    sbx, sums = set_up_sandbox(node)
    if point == "snapshot:recorded":
        _crash_during(node, point, "POST", f"/sandboxes/{sbx.sandbox_id}/snapshots", {})
    else:  # the push runs in the background, after the snapshot call answered
        with node.api() as api:
            resp = api.post(f"/sandboxes/{sbx.sandbox_id}/snapshots", json={})
            assert resp.status_code in (200, 201), resp.text
        node.wait_crashed(point)
    node.start()
    assert assert_converged(node, baseline) == {sbx.sandbox_id: "running"}
    (snap,) = snapshots(node)
    # The push cut short is redone at start.
    def pushed() -> bool:
        with node.api() as api:
            detail = api.get(f"/snapshots/{snap['snapshotID']}").json()
        return bool(detail.get("inRepository"))
    wait_until(pushed, 120, what="the snapshot's push")
    child = Sandbox.create(snap["snapshotID"], timeout=300, **node.opts)
    assert child.commands.run("cd /home/user/data && sha256sum f* | sha256sum").stdout.strip() \
        == sums
    assert_intact(node, sbx.sandbox_id, sums)
    child.kill()
    assert_converged(node, baseline)


@pytest.mark.parametrize("point", ["fork:captured", "fork:children"])
def test_fork_cut_short_leaves_no_child_and_no_image(node: Node, baseline: set[str],
                                                     point: str) -> None:
    node.start(point)
    sbx, sums = set_up_sandbox(node)
    _crash_during(node, point, "POST", f"/sandboxes/{sbx.sandbox_id}/fork", {"count": 3})
    node.start()
    # The parent runs on; children whose fork never returned are gone, as is its image.
    assert assert_converged(node, baseline) == {sbx.sandbox_id: "running"}
    assert snapshots(node) == []
    assert list((node.home / "snapshots").iterdir()) == []
    assert_intact(node, sbx.sandbox_id, sums)
    # And the parent still forks.
    with node.api() as api:
        resp = api.post(f"/sandboxes/{sbx.sandbox_id}/fork", json={"count": 2})
        assert resp.status_code in (200, 201), resp.text
    assert len(listed(node)) == 3


def test_every_crash_point_is_tested() -> None:
    """A point added to aenv.faults without a test here fails this."""
    tested = {"create:intent", "create:made", "pause:intent", "pause:criu", "pause:dumped",
              "resume:intent", "resume:criu", "resume:restored", "snapshot:criu",
              "snapshot:dumped", "snapshot:recorded", "push:layers", "repository:chunks",
              "fork:captured", "fork:children"}
    assert set(faults.CRASH_POINTS) == tested


def test_a_frozen_source_left_by_a_dead_criu_is_thawed(node: Node, baseline: set[str]) -> None:
    """The finding of issue 12, without a crash point: a sandbox frozen by hand (as a
    snapshot's pre-dump hook leaves it when the server dies) and a server kill -9 ed: the
    next start thaws it."""
    node.start()
    sbx, sums = set_up_sandbox(node)
    state = f"/sys/fs/cgroup/freezer/aenv/{sbx.sandbox_id}/freezer.state"
    with open(state, "w") as f:
        f.write("FROZEN")
    assert node.server is not None
    node.server.stop(9)
    node.start()
    assert_converged(node, baseline)
    t0 = time.monotonic()
    assert_intact(node, sbx.sandbox_id, sums)
    assert time.monotonic() - t0 < 10


def test_a_build_cut_short_leaves_no_build_sandbox(node: Node, baseline: set[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A template build's state is in memory: after a kill -9 in the middle of a build, its
    build sandbox is destroyed at start (it used to run on until its timeout)."""
    from e2b import Template

    node.start()
    for key, value in {"E2B_API_KEY": node.api_key, "E2B_API_URL": node.opts["api_url"],
                       "E2B_SANDBOX_URL": node.opts["sandbox_url"]}.items():
        monkeypatch.setenv(key, value)
    template = Template().from_template("base").run_cmd("sleep 60")
    info = Template.build_in_background(template, f"cut-{os.getpid()}")
    assert info.template_id
    wait_until(lambda: any(s.startswith("running") for s in listed(node).values()), 60,
               what="the build sandbox")
    assert node.server is not None
    node.server.stop(9)
    node.start()
    assert assert_converged(node, baseline) == {}
    assert "a template build that a restart ended" in (node.home / "server.log").read_text()
