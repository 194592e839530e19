"""`aenv cluster up --nodes 3` (real etcd, schedulers, a gateway, nodes in their own network
namespaces) driven through the official E2B SDK at the gateway. The gateway's own routes
(`nodeID` of a sandbox, `/nodes`, drain) are read with httpx at the same URL.

Order matters: the tests that kill components (the scheduler leader, then a node) come last;
the module's cluster is torn down after them, and the fixture checks it left nothing behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import CLUSTER_NODES, NODE_ENV, Cluster
from e2b import FilesystemEventType, PtySize, Sandbox, SandboxQuery, SandboxState
from e2b.exceptions import NotFoundException
from websockets.asyncio.client import connect as ws_connect

from aenv.devserver import free_port

pytestmark = pytest.mark.slow
ECHO = Path(__file__).resolve().parent.parent / "data" / "echo_server.py"
WS_PORT = 8765
DOMAIN = "sbx.cluster.test"


def wait_until(check: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.fixture
def tag() -> str:
    return uuid.uuid4().hex[:10]


@pytest.fixture
def sandboxes(cluster: Cluster) -> Iterator[list[Sandbox]]:
    """Sandboxes a test made, killed after it."""
    made: list[Sandbox] = []
    yield made
    for sbx in made:
        with contextlib.suppress(Exception):  # one the test killed, or lost with its node
            sbx.kill()


def test_nodes_registered(cluster: Cluster) -> None:
    nodes = cluster.http.get("/nodes").json()
    assert [n["nodeID"] for n in nodes] == [f"n{i}" for i in range(CLUSTER_NODES)]
    for view in nodes:
        assert view["status"] == "ready"
        assert view["capacity"]["cpus"] >= 1 and view["capacity"]["memoryMB"] > 0
        assert "base" in view["templates"]
        assert view["url"].startswith("http://10.99.")
    one = cluster.http.get("/nodes/n0").json()
    assert one["nodeID"] == "n0" and one["url"] == nodes[0]["url"]
    assert cluster.http.get("/nodes/nope").status_code == 404
    assert httpx.get(cluster.url + "/nodes", timeout=10).status_code == 401  # no key
    assert httpx.get(cluster.url + "/health", timeout=10).status_code == 200
    # Each node is in a network namespace of its own, as cluster.json says.
    netns = {c["netns"] for c in cluster.of("node")}
    assert len(netns) == CLUSTER_NODES and all(os.path.exists(f"/run/netns/{n}") for n in netns)


def test_creates_spread_and_traffic_goes_through(cluster: Cluster, sandboxes: list[Sandbox],
                                                 tag: str) -> None:
    for _ in range(2 * CLUSTER_NODES):
        sandboxes.append(Sandbox.create(timeout=300, metadata={"run": tag}))
    placed = {s.sandbox_id: cluster.node_of(s.sandbox_id) for s in sandboxes}
    assert set(placed.values()) == {f"n{i}" for i in range(CLUSTER_NODES)}, placed
    for sbx in sandboxes:
        # commands (Connect streaming), files (upload and download) through the gateway
        result = sbx.commands.run(f"echo hello-{sbx.sandbox_id} && hostname")
        assert result.stdout.split() == [f"hello-{sbx.sandbox_id}", sbx.sandbox_id]
        sbx.files.write("/home/user/a.txt", f"on {placed[sbx.sandbox_id]}")
        assert sbx.files.read("/home/user/a.txt") == f"on {placed[sbx.sandbox_id]}"
    # a background command and its output stream, on one of them
    handle = sandboxes[0].commands.run("for i in 1 2 3; do echo $i; sleep 0.2; done",
                                       background=True)
    assert handle.wait().stdout.split() == ["1", "2", "3"]
    # the binding in etcd names the node that serves the sandbox
    some = sandboxes[1].sandbox_id
    wait_until(lambda: (cluster.etcd_get(f"/aenv/sandboxes/{some}") or {}).get("sandbox"), 10,
               "the node's roster in etcd")
    assert cluster.etcd_get(f"/aenv/sandboxes/{some}")["node"] == placed[some]


def test_list_merges_every_node_with_filters_and_pages(cluster: Cluster,
                                                       sandboxes: list[Sandbox],
                                                       tag: str) -> None:
    for _ in range(5):
        sandboxes.append(Sandbox.create(timeout=300, metadata={"run": tag}))
    nodes = {cluster.node_of(s.sandbox_id) for s in sandboxes}
    assert len(nodes) > 1
    sandboxes[0].pause()
    ids = {s.sandbox_id for s in sandboxes}
    query = SandboxQuery(metadata={"run": tag})
    listed = Sandbox.list(query=query).next_items()
    assert {s.sandbox_id for s in listed} == ids
    assert {s.sandbox_id: s.state for s in listed}[sandboxes[0].sandbox_id] == SandboxState.PAUSED
    # pages of 2 over every node: each sandbox exactly once, newest first
    paginator = Sandbox.list(query=query, limit=2)
    seen: list[str] = []
    pages = 0
    while paginator.has_next:
        page = paginator.next_items()
        assert len(page) <= 2
        seen += [s.sandbox_id for s in page]
        pages += 1
    assert sorted(seen) == sorted(ids) and pages == 3
    running = Sandbox.list(query=SandboxQuery(metadata={"run": tag},
                                              state=[SandboxState.RUNNING])).next_items()
    assert {s.sandbox_id for s in running} == ids - {sandboxes[0].sandbox_id}
    v1 = cluster.http.get("/sandboxes").json()  # v1: running only, every node
    assert ids - {sandboxes[0].sandbox_id} <= {s["sandboxID"] for s in v1}
    resp = cluster.http.get("/v2/sandboxes", params={"limit": 0})
    assert resp.status_code == 400


def test_drained_node_gets_no_creates_and_its_paused_sandboxes_move(
        cluster: Cluster, sandboxes: list[Sandbox]) -> None:
    paused = None
    for _ in range(12):  # a paused sandbox on n0
        sbx = Sandbox.create(timeout=300)
        sandboxes.append(sbx)
        if cluster.node_of(sbx.sandbox_id) == "n0":
            paused = sbx
            break
    assert paused is not None
    paused.files.write("/home/user/d.txt", "drained")
    paused.pause()
    wait_until(lambda: (cluster.etcd_get(f"/aenv/paused/{paused.sandbox_id}") or {}).get(
        "inRepository"), 60, "the paused state in the repository")
    made = len(sandboxes)
    assert cluster.http.post("/nodes/n0/drain").status_code == 204
    try:
        wait_until(lambda: cluster.http.get("/nodes/n0").json()["status"] == "draining", 10,
                   "n0 draining")
        for _ in range(4):
            sandboxes.append(Sandbox.create(timeout=120))
        assert "n0" not in {cluster.node_of(s.sandbox_id) for s in sandboxes[made:]}
        # a paused sandbox of a draining node resumes elsewhere
        back = Sandbox.connect(paused.sandbox_id)
        assert cluster.node_of(paused.sandbox_id) != "n0"
        assert back.files.read("/home/user/d.txt") == "drained"
        n0 = httpx.Client(base_url=cluster.component("n0")["url"], timeout=30,
                          headers={"X-API-Key": cluster.api_key}, trust_env=False)
        wait_until(lambda: n0.get(f"/sandboxes/{paused.sandbox_id}").status_code == 404, 10,
                   "n0 dropping its copy")
        n0.close()
        assert back.commands.run("cat /home/user/d.txt").stdout == "drained"
    finally:
        assert cluster.http.delete("/nodes/n0/drain").status_code == 204
    wait_until(lambda: cluster.http.get("/nodes/n0").json()["status"] == "ready", 10,
               "n0 ready again")


def test_fork_children_on_parent_node(cluster: Cluster, sandboxes: list[Sandbox]) -> None:
    parent = Sandbox.create(timeout=300)
    sandboxes.append(parent)
    parent.files.write("/home/user/p.txt", "from the parent")
    resp = cluster.http.post(f"/sandboxes/{parent.sandbox_id}/fork", json={"count": 3})
    assert resp.status_code == 201, resp.text
    children = [r["sandbox"] for r in resp.json()]
    assert len(children) == 3
    home = cluster.node_of(parent.sandbox_id)
    for child in children:
        assert child["nodeID"] == home
        sbx = Sandbox.connect(child["sandboxID"])
        sandboxes.append(sbx)
        assert sbx.files.read("/home/user/p.txt") == "from the parent"
        assert cluster.node_of(child["sandboxID"]) == home


def test_snapshot_on_one_node_creates_on_another(cluster: Cluster,
                                                 sandboxes: list[Sandbox]) -> None:
    source = Sandbox.create(timeout=300)
    sandboxes.append(source)
    origin = cluster.node_of(source.sandbox_id)
    source.files.write("/home/user/s.txt", "snapshotted")
    snap = source.create_snapshot()
    wait_until(lambda: cluster.http.get(f"/snapshots/{snap.snapshot_id}").json().get(
        "inRepository"), 120, "the snapshot in the repository")
    wait_until(lambda: cluster.etcd_get(f"/aenv/templates/{snap.snapshot_id}"), 10,
               "the snapshot in the catalog")
    assert cluster.http.post(f"/nodes/{origin}/drain").status_code == 204
    try:
        wait_until(lambda: cluster.http.get(f"/nodes/{origin}").json()["status"] == "draining",
                   10, "origin draining")
        copy = Sandbox.create(snap.snapshot_id, timeout=120)
        sandboxes.append(copy)
        assert cluster.node_of(copy.sandbox_id) != origin
        assert copy.files.read("/home/user/s.txt") == "snapshotted"
    finally:
        cluster.http.delete(f"/nodes/{origin}/drain")


def test_pty_watch_and_signed_urls_through_the_gateway(cluster: Cluster,
                                                       sandboxes: list[Sandbox]) -> None:
    sbx = Sandbox.create(timeout=300)
    sandboxes.append(sbx)
    # PTY: input in, output back (a Connect server stream through gateway and node)
    out = bytearray()
    handle = sbx.pty.create(PtySize(rows=24, cols=80), timeout=60)
    reader = threading.Thread(target=lambda: [out.extend(p) for _, _, p in handle if p],
                              daemon=True)
    reader.start()
    sbx.pty.send_stdin(handle.pid, b"stty size | sed 's/^/SZ:/'; exit\n")
    reader.join(20)
    assert "SZ:24 80" in out.decode(errors="replace")
    # watch: events of a directory, streamed
    sbx.files.make_dir("/home/user/w")
    watch = sbx.files.watch_dir("/home/user/w")
    try:
        sbx.files.write("/home/user/w/new.txt", "x")
        events: list[Any] = []
        wait_until(lambda: events.extend(watch.get_new_events()) or
                   any(e.name == "new.txt" and e.type == FilesystemEventType.CREATE
                       for e in events), 15, "a create event")
    finally:
        watch.stop()
    # signed URLs carry no sandbox header: the gateway finds the sandbox by the signature
    sbx.files.write("/home/user/signed.txt", "via a signed url")
    with httpx.Client(timeout=30, trust_env=False) as http:
        resp = http.get(sbx.download_url("/home/user/signed.txt"))
        assert resp.status_code == 200 and resp.content == b"via a signed url"
        resp = http.post(sbx.upload_url("/home/user/up.txt"), files={"file": ("u", b"up")})
        assert resp.status_code == 200, resp.text
        forged = sbx.download_url("/home/user/signed.txt").replace("signed.txt", "other.txt")
        assert http.get(forged).status_code in (401, 403, 404, 502)
    assert sbx.files.read("/home/user/up.txt") == "up"


async def _echo(ws_args: dict[str, Any], message: bytes) -> bytes:
    async with ws_connect(**ws_args) as ws:
        await ws.send(message)
        reply = await ws.recv()
        return reply if isinstance(reply, bytes) else reply.encode()


def test_websocket_and_a_second_gateway(cluster: Cluster, sandboxes: list[Sandbox]) -> None:
    """WebSocket tunnels through the gateway (headers; host on a second replica started
    with a domain), and a second gateway serves what the first created: no state of its own."""
    sbx = Sandbox.create(timeout=300)
    sandboxes.append(sbx)
    sbx.files.write("/home/user/echo_server.py", ECHO.read_text())
    sbx.commands.run(f"python3 /home/user/echo_server.py {WS_PORT}", background=True)
    stats = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": str(WS_PORT)}
    wait_until(lambda: httpx.get(cluster.url + "/stats", headers=stats, timeout=5,
                                 trust_env=False).status_code == 200, 20, "the echo server")
    by_headers = {"uri": cluster.url.replace("http", "ws") + "/echo",
                  "additional_headers": stats}
    assert asyncio.run(_echo(by_headers, b"x" * 100_000)) == b"x" * 100_000

    port = free_port()
    second = subprocess.Popen(
        [sys.executable, "-m", "aenv.cli.main", "gateway", "--etcd", cluster.state["etcd_url"],
         "--listen", f"127.0.0.1:{port}", "--domain", DOMAIN],
        env={**os.environ, "AENV_API_KEY": cluster.api_key}, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _status(url + "/health") == 200, 30, "the second gateway")
        detail = httpx.get(f"{url}/sandboxes/{sbx.sandbox_id}", timeout=10, trust_env=False,
                           headers={"X-API-Key": cluster.api_key}).json()
        assert detail["nodeID"] == cluster.node_of(sbx.sandbox_id)
        sock = socket.create_connection(("127.0.0.1", port))
        by_host = {"uri": f"ws://{WS_PORT}-{sbx.sandbox_id}.{DOMAIN}/echo", "sock": sock}
        assert asyncio.run(_echo(by_host, b"by host")) == b"by host"
        os.environ["E2B_API_URL"] = os.environ["E2B_SANDBOX_URL"] = url
        try:
            again = Sandbox.connect(sbx.sandbox_id)
            assert again.commands.run("echo via-second").stdout.strip() == "via-second"
        finally:
            os.environ.update(cluster.sdk_env())
    finally:
        second.kill()
        second.wait()
    # the first one never noticed
    assert sbx.commands.run("echo still").stdout.strip() == "still"


def _status(url: str) -> int:
    try:
        return httpx.get(url, timeout=2, trust_env=False).status_code
    except httpx.HTTPError:
        return 0


def test_fork_beyond_the_parents_node_spreads(cluster: Cluster,
                                             sandboxes: list[Sandbox]) -> None:
    """A fork bigger than the room on the parent's node still gives every child: the rest
    start on other nodes from a snapshot of the parent."""
    limit = int(NODE_ENV["AENV_SANDBOX_MAX_SANDBOXES"])
    parent = Sandbox.create(timeout=300)
    sandboxes.append(parent)
    home = cluster.node_of(parent.sandbox_id)
    parent.files.write("/home/user/p.txt", "inherited")
    count = limit + 2  # the parent takes one place: 3 children at least must go elsewhere
    resp = cluster.http.post(f"/sandboxes/{parent.sandbox_id}/fork", json={"count": count})
    assert resp.status_code == 201, resp.text
    results = resp.json()
    assert all("sandbox" in r for r in results), results
    children = [r["sandbox"] for r in results]
    for child in children:
        sandboxes.append(Sandbox.connect(child["sandboxID"]))
    where = [c["nodeID"] for c in children]
    assert where.count(home) <= limit - 1 and len(set(where)) >= 2, where
    for sbx in sandboxes[1:]:
        assert sbx.files.read("/home/user/p.txt") == "inherited"
    # the snapshot that carried them is gone again, from every node (the copies of it that
    # other nodes imported go at their next heartbeats)
    wait_until(lambda: not [s for s in cluster.http.get("/snapshots").json()
                            if s.get("sandboxID") == parent.sandbox_id], 15,
               "the fork's snapshot deleted everywhere")


def test_cli_node_ls(cluster: Cluster) -> None:
    out = subprocess.run([sys.executable, "-m", "aenv.cli.main", "--url", cluster.url,
                          "--api-key", cluster.api_key, "node", "ls", "-o", "json"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert [n["nodeID"] for n in json.loads(out)] == [f"n{i}" for i in range(CLUSTER_NODES)]


def test_etcd_outage_then_recovery(cluster: Cluster, sandboxes: list[Sandbox]) -> None:
    """etcd stopped for longer than a node's lease: known sandboxes serve on meanwhile; once
    it is back every node registers again and nothing was lost."""
    sbx = Sandbox.create(timeout=300)
    sandboxes.append(sbx)
    sbx.files.write("/home/user/x.txt", "before")
    etcd_pid = cluster.component("etcd")["pid"]
    os.kill(etcd_pid, signal.SIGSTOP)
    try:
        time.sleep(1.5)  # past the gateway's cache
        # Known sandboxes keep serving through the outage (the gateway's last answers).
        t_read = time.monotonic()
        assert sbx.files.read("/home/user/x.txt") == "before"
        assert sbx.commands.run("echo during").stdout.strip() == "during"
        assert time.monotonic() - t_read < 5
        time.sleep(6.5)  # longer than a node's lease
    finally:
        os.kill(etcd_pid, signal.SIGCONT)
    t0 = time.monotonic()

    def recovered() -> bool:
        # Leases that ran out while etcd was stopped are revoked once it runs again: a
        # node key seen at once may be about to go; the node then registers again.
        if _ready_nodes(cluster) != CLUSTER_NODES:
            return False
        resp = cluster.http.get("/v2/sandboxes")
        return resp.status_code == 200 and sbx.sandbox_id in {s["sandboxID"]
                                                              for s in resp.json()}

    wait_until(recovered, 30, "every node back, the sandbox listed")
    time.sleep(1)
    wait_until(recovered, 30, "every node back, the sandbox listed")  # and it stays so
    print(f"etcd back: every node registered and serving after {time.monotonic() - t0:.1f} s")
    assert sbx.files.read("/home/user/x.txt") == "before"
    assert sbx.sandbox_id in {s.sandbox_id for s in Sandbox.list().next_items()}
    sandboxes.append(Sandbox.create(timeout=120))


def _ready_nodes(cluster: Cluster) -> int:
    try:
        return sum(n["status"] == "ready" for n in cluster.http.get("/nodes").json())
    except (httpx.HTTPError, ValueError):
        return 0


def test_scheduler_leader_killed(cluster: Cluster, sandboxes: list[Sandbox]) -> None:
    schedulers = cluster.of("scheduler")
    if len(schedulers) < 2:
        pytest.skip("one scheduler replica")
    health = {c["id"]: httpx.get(c["url"] + "/health", timeout=5).json() for c in schedulers}
    leaders = [cid for cid, h in health.items() if h["leader"]]
    assert len(leaders) == 1, health
    leader = cluster.component(leaders[0])
    os.kill(leader["pid"], signal.SIGKILL)
    t0 = time.monotonic()
    for _ in range(3):  # placements go on at once: a follower answers while the lease runs out
        sandboxes.append(Sandbox.create(timeout=120))
    created_s = time.monotonic() - t0
    survivor = next(c for c in schedulers if c["id"] != leader["id"])
    wait_until(lambda: httpx.get(survivor["url"] + "/health", timeout=5).json()["leader"], 15,
               "a new scheduler leader")
    took = time.monotonic() - t0
    print(f"scheduler leader killed: 3 creates in {created_s:.2f} s, new leader after "
          f"{took:.1f} s")
    assert took < 10
    sandboxes.append(Sandbox.create(timeout=120))
    assert sandboxes[-1].commands.run("true").exit_code == 0


def test_node_killed_paused_sandbox_resumes_elsewhere(cluster: Cluster,
                                                      sandboxes: list[Sandbox]) -> None:
    paused = Sandbox.create(timeout=600)
    sandboxes.append(paused)
    victim = cluster.node_of(paused.sandbox_id)
    running = None
    for _ in range(12):  # a running sandbox on the same node
        sbx = Sandbox.create(timeout=600)
        sandboxes.append(sbx)
        if cluster.node_of(sbx.sandbox_id) == victim:
            running = sbx
            break
    assert running is not None
    paused.files.write("/home/user/keep.txt", "survives its node")
    paused.commands.run("sleep 100000", background=True)
    paused.pause()
    t_pause = time.monotonic()
    wait_until(lambda: (cluster.etcd_get(f"/aenv/paused/{paused.sandbox_id}") or {}).get(
        "inRepository"), 60, "the paused state in the repository")
    print(f"paused state in the repository {time.monotonic() - t_pause:.1f} s after the pause")

    os.kill(cluster.component(victim)["pid"], signal.SIGKILL)
    t_kill = time.monotonic()
    wait_until(lambda: cluster.http.get(f"/nodes/{victim}").json()["status"] == "unhealthy",
               20, "the dead node")
    detect_s = time.monotonic() - t_kill
    print(f"dead node detected after {detect_s:.1f} s")
    assert detect_s < 10

    # The running sandbox of the dead node is lost, not running.
    with pytest.raises(NotFoundException):
        Sandbox.get_info(running.sandbox_id)
    body = cluster.http.get(f"/sandboxes/{running.sandbox_id}").json()
    assert body["state"] == "lost" and body["nodeID"] == victim
    resp = cluster.http.get("/v2/sandboxes")
    listed = {s["sandboxID"]: s for s in resp.json()}
    assert running.sandbox_id not in listed
    assert running.sandbox_id in resp.headers["X-Aenv-Lost-Sandboxes"].split(",")
    # Deleting a lost sandbox forgets it here; its node removes it if it comes back.
    assert running.kill() is True
    assert cluster.etcd_get(f"/aenv/sandboxes/{running.sandbox_id}") is None
    assert cluster.etcd_get(f"/aenv/evict/{victim}/{running.sandbox_id}") == {}
    # The paused one is still listed, as paused, on its dead node...
    assert listed[paused.sandbox_id]["state"] == "paused"
    assert listed[paused.sandbox_id]["nodeID"] == victim
    # ...and resumes on another node from the repository, with its files and processes.
    t_resume = time.monotonic()
    back = Sandbox.connect(paused.sandbox_id, timeout=300)
    print(f"cross-node resume in {time.monotonic() - t_resume:.2f} s")
    sandboxes.append(back)
    assert cluster.node_of(paused.sandbox_id) != victim
    assert back.files.read("/home/user/keep.txt") == "survives its node"
    assert "sleep 100000" in back.commands.run("ps -eo args").stdout
    wait_until(lambda: (cluster.etcd_get(f"/aenv/sandboxes/{paused.sandbox_id}") or {}).get(
        "state") == "running", 10, "the binding of the resumed sandbox")
    # Other nodes keep serving.
    fresh = Sandbox.create(timeout=120)
    sandboxes.append(fresh)
    assert cluster.node_of(fresh.sandbox_id) != victim
    print(json.dumps({"detect_dead_node_s": round(detect_s, 1)}))

    # The dead node comes back (same home and namespaces): it drops its stale copy of the
    # sandbox that moved, without touching the moved one, and removes the lost sandbox
    # that was deleted meanwhile.
    comp = cluster.component(victim)
    with open(comp["log"], "ab") as log:
        again = subprocess.Popen(comp["argv"], env={**os.environ, **comp["env"]}, stdout=log,
                                 stderr=log, start_new_session=True)
    try:
        wait_until(lambda: cluster.http.get(f"/nodes/{victim}").json()["status"] == "ready",
                   60, "the node back")
        node_api = httpx.Client(base_url=comp["url"], headers={"X-API-Key": cluster.api_key},
                                timeout=30, trust_env=False)
        wait_until(lambda: node_api.get(f"/sandboxes/{paused.sandbox_id}").status_code == 404
                   and node_api.get(f"/sandboxes/{running.sandbox_id}").status_code == 404,
                   20, "the stale copies removed")
        node_api.close()
        assert cluster.node_of(paused.sandbox_id) != victim
        assert back.files.read("/home/user/keep.txt") == "survives its node"
        assert "sleep 100000" in back.commands.run("ps -eo args").stdout
    finally:
        again.send_signal(signal.SIGTERM)
        again.wait(60)
