"""Fixtures of the cluster suite: a real etcd (started here, on loopback ports, data in a temp
dir) and a real `aenv cluster up` (etcd, schedulers, a gateway and nodes in their own network
namespaces), driven through the official E2B SDK pointed at the gateway.

`cluster` is module-scoped: a module that uses it gets one cluster, torn down (and checked to
leave no process, mount or namespace behind) after its last test.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from aenv.devserver import free_port

LAST_LOGS = Path(tempfile.gettempdir()) / "aenv-cluster-last-logs"
CLUSTER_NODES = int(os.environ.get("AENV_TEST_CLUSTER_NODES", "3"))
# Light nodes: 3 on 2 cores, each with a small pool of prepared sandboxes.
NODE_ENV = {"AENV_RUNTIME_READY_POOL": "2", "AENV_RUNTIME_WARM_POOL": "4",
            "AENV_RUNTIME_WARM_PROCESSES": "4", "AENV_SANDBOX_CODE_INTERPRETER_PREBUILD": "0",
            # small, so that a fork outgrows its parent's node (test_cluster.py)
            "AENV_SANDBOX_MAX_SANDBOXES": "8"}


@dataclass
class EtcdServer:
    url: str
    proc: subprocess.Popen[bytes]
    data: Path


def start_etcd(data: Path) -> EtcdServer:
    if shutil.which("etcd") is None:
        pytest.skip("etcd is not installed (make install: apt etcd-server)")
    port, peer = free_port(), free_port()
    log = open(data.parent / "etcd.log", "ab")  # noqa: SIM115 - lives as long as etcd
    proc = subprocess.Popen(
        ["etcd", "--name", "t", "--data-dir", str(data),
         "--listen-client-urls", f"http://127.0.0.1:{port}",
         "--advertise-client-urls", f"http://127.0.0.1:{port}",
         "--listen-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-cluster", f"t=http://127.0.0.1:{peer}"],
        stdout=log, stderr=log, start_new_session=True)
    log.close()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).json().get("health") == "true":
                return EtcdServer(url, proc, data)
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("etcd did not start")


@pytest.fixture(scope="session")
def etcd() -> Iterator[EtcdServer]:
    tmp = Path(tempfile.mkdtemp(prefix="aenv-etcd-"))
    server = start_etcd(tmp / "data")
    yield server
    server.proc.terminate()
    server.proc.wait(10)
    shutil.rmtree(tmp, ignore_errors=True)


class Cluster:
    """A running `aenv cluster up`, as its cluster.json describes it."""

    def __init__(self, home: Path, proc: subprocess.Popen[bytes]) -> None:
        self.home = home
        self.proc = proc
        self.state: dict[str, Any] = json.loads((home / "cluster.json").read_text())
        self.url: str = self.state["gateway_url"]
        self.api_key: str = self.state["api_key"]
        self.http = httpx.Client(base_url=self.url, headers={"X-API-Key": self.api_key},
                                 timeout=120, trust_env=False)

    def component(self, comp_id: str) -> dict[str, Any]:
        return next(c for c in self.state["components"] if c["id"] == comp_id)

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [c for c in self.state["components"] if c["kind"] == kind]

    def node_of(self, sandbox_id: str) -> str:
        resp = self.http.get(f"/sandboxes/{sandbox_id}")
        resp.raise_for_status()
        return str(resp.json()["nodeID"])

    def etcd_get(self, key: str) -> Any:
        resp = httpx.post(self.state["etcd_url"] + "/v3/kv/range",
                          json={"key": base64.b64encode(key.encode()).decode()}, timeout=5)
        kvs = resp.json().get("kvs") or []
        return json.loads(base64.b64decode(kvs[0]["value"])) if kvs else None

    def sdk_env(self) -> dict[str, str]:
        return {"E2B_API_URL": self.url, "E2B_SANDBOX_URL": self.url,
                "E2B_API_KEY": self.api_key, "NO_PROXY": "127.0.0.1,localhost"}


def leftovers(state: dict[str, Any]) -> list[str]:
    """What a stopped cluster left behind: processes, mounts under its home, namespaces."""
    out = []
    for comp in state["components"]:
        pid = comp.get("pid") or 0
        if pid and Path(f"/proc/{pid}").exists() and \
                not Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].startswith("Z"):
            out.append(f"process {comp['id']} ({pid})")
        if comp.get("netns") and Path(f"/run/netns/{comp['netns']}").exists():
            out.append(f"netns {comp['netns']}")
        if comp.get("host_veth") and Path(f"/sys/class/net/{comp['host_veth']}").exists():
            out.append(f"veth {comp['host_veth']}")
        if comp["kind"] == "node" and Path(f"/sys/fs/cgroup/pids/aenv-{comp['id']}").exists():
            out.append(f"cgroup aenv-{comp['id']}")
    home = state["home"]
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if home in cmdline:
                out.append(f"process {proc.name}: {cmdline[:120]}")
    out += [f"mount {line.split()[4]}" for line in Path("/proc/self/mountinfo").read_text()
            .splitlines() if line.split()[4].startswith(home)]
    return out


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    if os.geteuid() != 0:
        pytest.skip("aenv cluster up needs root")
    home = Path(tempfile.mkdtemp(prefix="aenv-cluster-"))
    listen = f"127.0.0.1:{free_port()}"
    out = open(home / "up.log", "ab")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "aenv.cli.main", "cluster", "up", "--nodes", str(CLUSTER_NODES),
         "--home", str(home), "--listen", listen],
        env={**os.environ, **NODE_ENV}, stdout=out, stderr=out, start_new_session=True)
    started = time.monotonic()
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"cluster up exited with {proc.returncode}: "
                                   f"{(home / 'up.log').read_text()[-3000:]}")
            state_file = home / "cluster.json"
            if state_file.exists():
                try:
                    if json.loads(state_file.read_text()).get("ready"):
                        break
                except ValueError:
                    pass  # being written
            if time.monotonic() - started > 600:
                raise RuntimeError("cluster up: not ready after 600 s")
            time.sleep(0.2)
        c = Cluster(home, proc)
        c.state["up_seconds"] = time.monotonic() - started
        print(f"cluster of {CLUSTER_NODES} nodes up in {c.state['up_seconds']:.1f} s")
        saved = dict(os.environ)
        os.environ.update(c.sdk_env())
        try:
            yield c
        finally:
            os.environ.clear()
            os.environ.update(saved)
            c.http.close()
            state = c.state
    finally:
        # `aenv cluster down` from another process: it stops the supervisor, which cleans up
        down = subprocess.run([sys.executable, "-m", "aenv.cli.main", "cluster", "down",
                               "--home", str(home)], capture_output=True, text=True,
                              timeout=400, check=False)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            proc.wait(300)
        out.close()
    assert down.returncode == 0, down.stderr
    left = leftovers(state)
    # The nodes remove their own sandboxes; what the clean-up had to kill, they missed.
    left += [line for line in (home / "up.log").read_text().splitlines() if "left behind" in line]
    # The components' logs of the last run stay readable (a failed test's story).
    shutil.rmtree(LAST_LOGS, ignore_errors=True)
    shutil.copytree(home / "logs", LAST_LOGS, dirs_exist_ok=True)
    if not left:
        shutil.rmtree(home, ignore_errors=True)
    assert not left, f"cluster down left (see {home}): {left}"
