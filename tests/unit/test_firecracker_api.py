"""The Firecracker driver's API requests, checked against Firecracker's published OpenAPI
description (tests/data/firecracker/firecracker.yaml, v1.16.1), without KVM.

- Every builder in `aenv.runtime.firecracker.api`, with every optional field set, produces a
  body the spec accepts, at a method + path the spec has.
- The driver's real lifecycle (create, pause, resume, snapshot, fork = N restores, stats,
  destroy) runs against `fake_firecracker.py` (a fake API server on a unix socket, spawned by
  the driver as its `firecracker` binary) and a fake envd; every recorded request is validated
  against the spec and their order checked.
- Schemas are made strict (`additionalProperties: false` on every object): Firecracker
  deserialises with `deny_unknown_fields`, so an unknown field is a 400 there.
- On this host (no Firecracker binary) `start()` refuses with a clear sentence.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import re
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from aenv.config import Config
from aenv.errors import AenvError, ErrorCode
from aenv.runtime.base import PausableDriver, RuntimeDriver, RuntimeHandle, SandboxSpec, SnapshotDriver
from aenv.runtime.firecracker import api, disk, probe
from aenv.runtime.firecracker.driver import FirecrackerDriver
from aenv.runtime.firecracker.network import VmNet
from aenv.runtime.registry import load_driver

SPEC_FILE = Path(__file__).parent.parent / "data" / "firecracker" / "firecracker.yaml"
FAKE = Path(__file__).parent / "fake_firecracker.py"


# ---------------------------------------------------------------------- the spec
def _strict(node: Any) -> Any:
    if isinstance(node, dict):
        out = {k: _strict(v) for k, v in node.items()}
        if out.get("type") == "object" and "properties" in out:
            out.setdefault("additionalProperties", False)
        return out
    if isinstance(node, list):
        return [_strict(v) for v in node]
    return node


class Spec:
    def __init__(self, path: Path) -> None:
        self.doc = yaml.safe_load(path.read_text())
        self.definitions = _strict(copy.deepcopy(self.doc["definitions"]))

    def operation(self, method: str, path: str) -> dict[str, Any]:
        for template, ops in self.doc["paths"].items():
            pattern = "^" + re.sub(r"\{[^/]+\}", "[^/]+", template) + "$"
            if re.match(pattern, path) and method.lower() in ops:
                op: dict[str, Any] = ops[method.lower()]
                return op
        raise AssertionError(f"{method} {path} is not in Firecracker's API description")

    def validate(self, method: str, path: str, body: Any) -> None:
        op = self.operation(method, path)
        params = [p for p in op.get("parameters", []) if p.get("in") == "body"]
        if not params:
            assert body is None, f"{method} {path} takes no body, got {body!r}"
            return
        if body is None:
            assert not params[0].get("required"), f"{method} {path} needs a body"
            return
        schema = {**_strict(params[0]["schema"]), "definitions": self.definitions}
        jsonschema.Draft4Validator(schema).validate(body)


@pytest.fixture(scope="module")
def spec() -> Spec:
    return Spec(SPEC_FILE)


def test_vendored_spec_is_the_v1_16_1_release(spec: Spec) -> None:
    assert spec.doc["swagger"] == "2.0"
    assert spec.doc["info"]["version"] == "1.16.1"
    header = SPEC_FILE.read_text().split("swagger:", 1)[0]
    assert "Apache" in header and "2038188f145fb81b8d098147a10e9d9f392fd22f" in header


def test_validator_is_strict(spec: Spec) -> None:
    spec.validate("PUT", "/boot-source", {"kernel_image_path": "vmlinux"})
    with pytest.raises(jsonschema.ValidationError):
        spec.validate("PUT", "/boot-source", {"kernel_image_path": "vmlinux", "nope": 1})
    with pytest.raises(jsonschema.ValidationError):
        spec.validate("PATCH", "/vm", {"state": "Stopped"})
    with pytest.raises(AssertionError):
        spec.operation("PUT", "/no-such-thing")


# ---------------------------------------------------------------------- every builder
def every_call() -> list[api.ApiCall]:
    """Each builder with all of its optional fields set (and with none)."""
    rl = api.NetworkOverride("eth0", "fc1")
    return [
        api.put_logger(api.Logger("/tmp/fc.log", level="Debug", show_level=True,
                                  show_log_origin=True)),
        api.put_logger(api.Logger("/tmp/fc.log", level=None, show_level=None)),
        api.put_metrics(api.Metrics("/tmp/metrics.json")),
        api.put_machine_config(api.MachineConfig(2, 512, smt=False, track_dirty_pages=True,
                                                 huge_pages="None")),
        api.put_machine_config(api.MachineConfig(1, 128)),
        api.patch_machine_config(api.MachineConfig(2, 512, track_dirty_pages=True)),
        api.put_boot_source(api.BootSource("vmlinux", "console=ttyS0", "initrd")),
        api.put_boot_source(api.BootSource("vmlinux")),
        api.put_drive(api.Drive("rootfs", "rootfs.ext4", True, False, "Writeback", "Async")),
        api.put_drive(api.Drive("tools", "/opt/tools.img", False, True)),
        api.put_network_interface(api.NetworkInterface("eth0", "fc0", "06:00:ac:10:00:02")),
        api.put_balloon(api.Balloon(64, True, stats_polling_interval_s=1,
                                    free_page_reporting=True)),
        api.put_balloon(api.Balloon(0, False)),
        api.put_vsock(api.Vsock(3, "/tmp/v.sock")),
        api.instance_start(),
        api.pause_vm(),
        api.resume_vm(),
        api.snapshot_create(api.SnapshotCreate("vmstate", "memory", "Full")),
        api.snapshot_create(api.SnapshotCreate("vmstate", "memory", "Diff")),
        api.snapshot_create(api.SnapshotCreate("vmstate", "memory")),
        api.snapshot_load(api.SnapshotLoad("vmstate", api.MemoryBackend("memory"),
                                           track_dirty_pages=True, resume_vm=True,
                                           network_overrides=(rl,), clock_realtime=True)),
        api.snapshot_load(api.SnapshotLoad("vmstate", api.MemoryBackend("memory"))),
        api.describe_instance(),
        api.get_version(),
        api.balloon_statistics(),
    ]


@pytest.mark.parametrize("call", every_call(), ids=lambda c: f"{c.method} {c.path}")
def test_every_builder_matches_the_spec(spec: Spec, call: api.ApiCall) -> None:
    spec.validate(call.method, call.path, call.body)


def test_bodies_omit_unset_fields() -> None:
    assert api.put_boot_source(api.BootSource("k")).body == {"kernel_image_path": "k"}
    load = api.snapshot_load(api.SnapshotLoad("s", api.MemoryBackend("m"), resume_vm=True))
    assert load.body == {"snapshot_path": "s", "resume_vm": True,
                         "mem_backend": {"backend_path": "m", "backend_type": "File"}}


def test_version_parsing() -> None:
    v = api.FirecrackerVersion.parse("Firecracker v1.16.1\n\nSupported snapshot ...")
    assert v == api.FirecrackerVersion(1, 16, 1) and v.supported and v.has_clock_realtime
    assert not api.FirecrackerVersion.parse("Firecracker v1.10.0").supported
    assert not api.FirecrackerVersion(1, 15, 0).has_clock_realtime
    with pytest.raises(AenvError):
        api.FirecrackerVersion.parse("no version here")


# ---------------------------------------------------------------------- fakes
@pytest.fixture
def fake_binary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    wrapper = tmp_path / "bin" / "firecracker"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("FAKE_FC_RECORD", str(tmp_path / "requests.jsonl"))
    return wrapper


def recorded(tmp_path: Path) -> list[dict[str, Any]]:
    path = tmp_path / "requests.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


class FakeEnvd:
    """envd's endpoints the driver uses: /health, /init, process Start (exit 0)."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, dict[str, str], bytes]] = []
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode().split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {k.strip().lower(): v.strip()
                       for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            self.requests.append((method, path, headers, body))
            if path == "/process.Process/Start":
                frames = b""
                for flag, msg in ((0, {"event": {"start": {"pid": 7}}}),
                                  (0, {"event": {"end": {"exitCode": 0, "exited": True}}}),
                                  (2, {})):
                    raw = json.dumps(msg).encode()
                    frames += bytes([flag]) + len(raw).to_bytes(4, "big") + raw
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/connect+json\r\n"
                             + f"Content-Length: {len(frames)}\r\n\r\n".encode() + frames)
            else:
                writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
            await writer.drain()
        finally:
            writer.close()


class FakeNetworks:
    """Stands in for TapNetworks: no namespaces; every guest port is the fake envd."""

    def __init__(self, envd: FakeEnvd) -> None:
        self.envd = envd
        self.acquired: list[str] = []
        self.released = 0

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def acquire(self, sandbox_id: str, internet: bool) -> VmNet:
        self.acquired.append(sandbox_id)
        return VmNet(None, None)

    def claim(self, net: VmNet) -> None:
        pass

    async def release(self, net: VmNet) -> None:
        self.released += 1

    async def connect(self, net: VmNet, port: int, timeout: float) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", self.envd.port))
        return sock


def make_config(tmp_path: Path, binary: Path) -> Config:
    cfg = Config()
    cfg.server.home = tmp_path / "home"
    (tmp_path / "vm").mkdir(exist_ok=True)
    for name in ("vmlinux", "initrd", "tools.img"):
        (tmp_path / "vm" / name).write_bytes(b"\0" * 4096)
    rootfs = tmp_path / "vm" / "rootfs.ext4"
    with open(rootfs, "wb") as f:
        f.truncate(64 << 20)
        f.write(b"ext4 image")
    rt = cfg.runtime
    rt.driver = "firecracker"
    rt.firecracker_binary = str(binary)
    rt.firecracker_kernel = str(tmp_path / "vm" / "vmlinux")
    rt.firecracker_initrd = str(tmp_path / "vm" / "initrd")
    rt.firecracker_rootfs = str(rootfs)
    rt.firecracker_tools = str(tmp_path / "vm" / "tools.img")
    rt.firecracker_boot_timeout_s = 10
    return cfg


def spec_for(tmp_path: Path, sid: str, **kw: Any) -> SandboxSpec:
    return SandboxSpec(sandbox_id=sid, lower_layers=(), workspace=tmp_path / "ws" / sid,
                       cpu_count=2, memory_mb=256, pids_max=256, envd_access_token=f"tok-{sid}",
                       env_vars={"A": "1"}, default_workdir="/home/user", **kw)


@pytest.fixture
async def fake_driver(tmp_path: Path, fake_binary: Path
                      ) -> AsyncIterator[tuple[FirecrackerDriver, FakeEnvd, FakeNetworks]]:
    envd = FakeEnvd()
    await envd.start()
    nets = FakeNetworks(envd)
    cfg = make_config(tmp_path, fake_binary)

    async def fake_probe(config: Config) -> probe.Availability:
        return probe.Availability(True, "fake", str(fake_binary),
                                  api.FirecrackerVersion(1, 16, 1))

    driver = FirecrackerDriver(cfg, networks=nets, probe=fake_probe)
    await driver.start()
    yield driver, envd, nets
    await driver.close()
    for proc in driver._procs.values():  # anything a failing test left behind
        proc.kill()
        proc.wait()
    await envd.close()


# ---------------------------------------------------------------------- the driver's sequence
BOOT = [("PUT", "/logger"), ("PUT", "/metrics"), ("PUT", "/machine-config"),
        ("PUT", "/boot-source"), ("PUT", "/drives/rootfs"), ("PUT", "/drives/tools"),
        ("PUT", "/network-interfaces/eth0"), ("PUT", "/balloon"), ("PUT", "/actions")]
LOAD = [("PUT", "/logger"), ("PUT", "/metrics"), ("PUT", "/snapshot/load")]


async def test_driver_lifecycle_requests_match_the_spec(
        spec: Spec, tmp_path: Path,
        fake_driver: tuple[FirecrackerDriver, FakeEnvd, FakeNetworks]) -> None:
    driver, envd, nets = fake_driver
    for protocol in (RuntimeDriver, PausableDriver, SnapshotDriver):
        assert isinstance(driver, protocol)
    parent_spec = spec_for(tmp_path, "parent0000000000000a")

    # create
    handle = await driver.create(parent_spec)
    ws = parent_spec.workspace
    assert (ws / "rootfs.ext4").read_bytes()[:10] == b"ext4 image"
    init = [r for r in envd.requests if r[1] == "/init"][-1]
    assert json.loads(init[3])["accessToken"] == "tok-parent0000000000000a"
    assert "x-access-token" not in init[2]  # a fresh envd has no token yet

    # pause: a Diff snapshot of a booted VM is a complete memory file; resume loads it
    paused = await driver.pause(handle)
    assert paused.data["pid"] is None and not driver._alive(handle.data)
    images = Path(paused.data["images"])
    assert (images / "vmstate").is_file() and (images / "memory").is_file()
    resumed = await driver.resume(paused, parent_spec)
    assert resumed.data["images"] is None and driver._alive(resumed.data)

    # snapshot while running: disk cloned while paused, Diff merged over the loaded memory
    snap = tmp_path / "snap"
    timings = await driver.snapshot(resumed, snap)
    assert timings["frozen_s"] >= 0 and (snap / "rootfs.ext4").is_file()
    mem = (snap / "memory").read_bytes()
    assert mem[:4096] == b"A" * 4096  # from the pause snapshot (the base)
    assert mem[4096:8192] == b"B" * 4096  # from this Diff snapshot
    assert len(mem) == 256 << 20

    # fork = N restores from the one snapshot: memory shared, disks private
    kids = [spec_for(tmp_path, f"child{i:015d}") for i in range(2)]
    children = await asyncio.gather(*(driver.restore(k, snap, "tok-parent0000000000000a")
                                      for k in kids))
    for kid in kids:
        assert (kid.workspace / "base.mem").stat().st_ino == (snap / "memory").stat().st_ino
        assert (kid.workspace / "rootfs.ext4").stat().st_ino != (snap / "rootfs.ext4").stat().st_ino
        inits = [r for r in envd.requests if r[1] == "/init"
                 and json.loads(r[3]).get("accessToken") == kid.envd_access_token]
        assert inits and inits[0][2]["x-access-token"] == "tok-parent0000000000000a"
    starts = [json.loads(r[3][5:]) for r in envd.requests if r[1] == "/process.Process/Start"]
    assert any("hostname child000000000000001" in s["process"]["args"][1] for s in starts)

    usage = await driver.stats(children[0])
    assert usage.mem_total_bytes == 256 << 20 and usage.mem_used_bytes == 128 << 20

    for h in (resumed, *children):
        await driver.destroy(h)
        await driver.destroy(h)  # idempotent
        assert not Path(h.data["workspace"]).exists()
    assert len(nets.acquired) == 4  # create, resume, 2 restores
    assert nets.released == 1 + 2 * 3  # the pause's, then each destroy (done twice) releases

    # Every request the driver made is in the spec, with a valid body...
    reqs = recorded(tmp_path)
    for r in reqs:
        spec.validate(r["method"], r["path"], r["body"])
    # ... and in order, per Firecracker process.
    by_pid: dict[int, list[tuple[str, str]]] = {}
    for r in reqs:
        if (r["method"], r["path"]) != ("GET", "/"):  # API readiness polls
            by_pid.setdefault(r["pid"], []).append((r["method"], r["path"]))
    procs = list(by_pid.values())
    assert len(procs) == 4
    assert procs[0] == [*BOOT, ("PATCH", "/vm"), ("PUT", "/snapshot/create")]
    assert procs[1] == [*LOAD, ("PATCH", "/vm"), ("PUT", "/snapshot/create"), ("PATCH", "/vm")]
    assert sorted(procs[2:]) == sorted([LOAD, [*LOAD, ("GET", "/balloon/statistics")]])
    bodies = {(r["method"], r["path"], r["pid"]): r["body"] for r in reqs}
    first, second = list(by_pid)[:2]
    assert bodies[("PUT", "/machine-config", first)]["track_dirty_pages"] is True
    assert bodies[("PUT", "/drives/rootfs", first)]["path_on_host"] == "rootfs.ext4"
    creates = [r["body"] for r in reqs if r["path"] == "/snapshot/create"]
    assert [c["snapshot_type"] for c in creates] == ["Diff", "Diff"]
    vm_states = [r["body"]["state"] for r in reqs if r["path"] == "/vm"]
    assert vm_states == ["Paused", "Paused", "Resumed"]
    loads = [r["body"] for r in reqs if r["path"] == "/snapshot/load"]
    assert all(b["track_dirty_pages"] and b["resume_vm"] for b in loads)
    assert all(b["mem_backend"]["backend_type"] == "File" for b in loads)
    assert bodies[("PUT", "/snapshot/load", second)]["mem_backend"]["backend_path"] == str(
        images / "memory")


async def test_diff_bases_and_pause_directories(
        spec: Spec, tmp_path: Path,
        fake_driver: tuple[FirecrackerDriver, FakeEnvd, FakeNetworks]) -> None:
    driver, _, _ = fake_driver
    s = spec_for(tmp_path, "solo0000000000000000", allow_internet_access=False)
    handle = await driver.create(s)
    handle = await driver.resume(await driver.pause(handle), s)  # pause dir 1 (page A)
    paused = await driver.pause(handle)  # a Diff (page B) merged over pause dir 1
    assert [p.name for p in s.workspace.glob("pause-*")] == [Path(paused.data["images"]).name]
    mem = (Path(paused.data["images"]) / "memory").read_bytes()
    assert mem[:8192] == b"A" * 4096 + b"B" * 4096
    handle = await driver.resume(paused, s)
    await driver.snapshot(handle, tmp_path / "snap1")  # Diff over pause dir 2 (page C)
    assert (tmp_path / "snap1" / "memory").read_bytes()[:12288] == mem[:8192] + b"C" * 4096
    (tmp_path / "snap1" / "memory").unlink()  # the orchestrator dropped the image
    await driver.snapshot(handle, tmp_path / "snap2")  # no base left: Full
    await driver.destroy(handle)
    creates = [r["body"] for r in recorded(tmp_path) if r["path"] == "/snapshot/create"]
    assert [c["snapshot_type"] for c in creates] == ["Diff", "Diff", "Diff", "Full"]
    for r in recorded(tmp_path):
        spec.validate(r["method"], r["path"], r["body"])


async def test_firecracker_faults_become_clear_errors(
        tmp_path: Path, fake_driver: tuple[FirecrackerDriver, FakeEnvd, FakeNetworks]) -> None:
    driver, _, _ = fake_driver
    s = spec_for(tmp_path, "broken00000000000000")
    s.workspace.mkdir(parents=True)
    (s.workspace / "vmstate").write_text("{}")  # no memory file next to it
    (s.workspace / "rootfs.ext4").write_text("x")
    with pytest.raises(AenvError) as exc:
        await driver.restore(spec_for(tmp_path, "broken00000000000001"), s.workspace, None)
    assert exc.value.code is ErrorCode.NOT_FOUND and "no memory" in exc.value.message
    # A 400 from the API carries Firecracker's fault_message.
    data = driver._new_data(spec_for(tmp_path, "fault000000000000000"))
    Path(data["workspace"]).mkdir(parents=True)
    driver._spawn("fault000000000000000", data, VmNet(None))
    try:
        async with driver._api(data) as fc:
            await fc.wait_ready(10)
            with pytest.raises(AenvError) as exc:
                await fc.call(api.snapshot_create(api.SnapshotCreate("v", "m", "Full")))
            assert exc.value.code is ErrorCode.INTERNAL
            assert "the microVM must be paused" in exc.value.message
    finally:
        await driver.destroy(RuntimeHandle("firecracker", "fault000000000000000", data))


# ---------------------------------------------------------------------- probe and start()
def test_start_refuses_clearly_without_firecracker(tmp_path: Path) -> None:
    cfg = Config()
    cfg.server.home = tmp_path
    cfg.runtime.firecracker_binary = str(tmp_path / "nowhere" / "firecracker")
    driver = load_driver("firecracker", cfg)
    assert isinstance(driver, FirecrackerDriver)
    with pytest.raises(AenvError) as exc:
        asyncio.run(driver.start())
    assert exc.value.code is ErrorCode.UNAVAILABLE
    assert exc.value.message == (
        "the firecracker runtime cannot run on this host: firecracker is not installed (no "
        f"executable at {tmp_path}/nowhere/firecracker; it is not packaged in Debian: download"
        " a release from https://github.com/firecracker-microvm/firecracker/releases and set "
        "runtime.firecracker_binary)")


@pytest.mark.skipif(probe.find_binary("") is not None, reason="firecracker is on PATH here")
def test_default_config_on_this_host_says_not_installed(tmp_path: Path) -> None:
    cfg = Config()
    cfg.server.home = tmp_path
    ok, reason = probe.firecracker_available(cfg)
    assert not ok and reason.startswith("firecracker is not installed (no `firecracker` on PATH")


async def test_probe_test_boot(tmp_path: Path, fake_binary: Path,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = make_config(tmp_path, fake_binary)
    kernel, rootfs = Path(cfg.runtime.firecracker_kernel), Path(cfg.runtime.firecracker_rootfs)
    assert await probe.test_boot(str(fake_binary), kernel, rootfs, 5) is None
    monkeypatch.setenv("FAKE_FC_NO_BOOT", "1")  # a guest that hangs, as on PVM hosts
    why = await probe.test_boot(str(fake_binary), kernel, rootfs, 0.5)
    assert why is not None and "did not reach userspace within" in why
    assert ("PVM" in why) == probe.is_pvm_host()
    # The probe's requests are valid too; its root disk is read-only.
    s = Spec(SPEC_FILE)
    for r in recorded(tmp_path):
        s.validate(r["method"], r["path"], r["body"])
    drives = [r["body"] for r in recorded(tmp_path) if r["path"].startswith("/drives/")]
    assert drives and all(d["is_read_only"] for d in drives)


async def test_probe_with_fake_binary_reaches_the_boot(tmp_path: Path, fake_binary: Path
                                                       ) -> None:
    cfg = make_config(tmp_path, fake_binary)
    found = await probe.probe(cfg, boot=False)
    if probe.check_kvm() is not None:
        assert not found.ok and "kvm" in found.reason.lower()
    else:
        assert found.ok and found.version == api.FirecrackerVersion(1, 16, 1)
    os.unlink(cfg.runtime.firecracker_kernel)
    found = await probe.probe(cfg, boot=False)
    assert not found.ok


# ---------------------------------------------------------------------- disk helpers
def test_clone_keeps_holes_and_merge_applies_the_diff(tmp_path: Path) -> None:
    base, diff = tmp_path / "base", tmp_path / "diff"
    with open(base, "wb") as f:
        f.truncate(1 << 20)
        f.write(b"a" * 8192)
    with open(diff, "wb") as f:
        f.truncate(1 << 20)
        f.seek(4096)
        f.write(b"d" * 4096)
        f.seek(65536)
        f.write(b"e" * 10)
    disk.clone_file(base, tmp_path / "copy")
    assert (tmp_path / "copy").read_bytes() == base.read_bytes()
    assert (tmp_path / "copy").stat().st_blocks * 512 < 1 << 20  # still sparse
    disk.merge_diff(base, diff, tmp_path / "merged")
    merged = (tmp_path / "merged").read_bytes()
    assert merged[:4096] == b"a" * 4096 and merged[4096:8192] == b"d" * 4096
    assert merged[65536:65546] == b"e" * 10 and len(merged) == 1 << 20
    assert base.read_bytes()[4096:8192] == b"a" * 4096  # the base is never written
