"""End to end: images built by the suite (the base template's Debian layer plus a layer of
our own; a busybox-only userland), pushed to a loopback registry, pulled through a real
`aenv serve` (CLI and HTTP API), and started as sandboxes with the official E2B SDK."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2b import Sandbox
from oci_helpers import (
    Entry,
    Image,
    Layer,
    Registry,
    busybox_rootfs,
    digest_of,
    make_tar,
    tar_directory,
)

from aenv.devserver import ServerProcess, base_layer
from aenv.images.layers import unpack_layer

pytestmark = pytest.mark.slow


def cli(server: ServerProcess, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "AENV_URL": server.url, "AENV_API_KEY": server.api_key}
    return subprocess.run([sys.executable, "-m", "aenv.cli.main", *args], env=env,
                          capture_output=True, text=True, timeout=600, check=False)


@pytest.fixture(scope="module")
def debian_image() -> Image:
    started = time.monotonic()
    bottom = Layer(tar_directory(base_layer()), "zstd")
    top = Layer(make_tar([
        Entry("etc/aenv-image-test.txt", data=b"from layer two\n"),
        Entry("usr/bin/less", "whiteout"),
    ]), "gzip")
    print(f"\nbuilt debian image: layer {len(bottom.tar) / 1e6:.0f} MB tar, "
          f"{len(bottom.blob) / 1e6:.0f} MB zstd, in {time.monotonic() - started:.1f}s")
    return Image([bottom, top], env=["PATH=/usr/local/bin:/usr/bin:/bin", "IMAGE_VAR=from-config"],
                 workdir="/home/user", user="user")


@pytest.fixture(scope="module")
def busybox_image() -> Image:
    entries = busybox_rootfs("sh", "ls", "cat", "echo", "id", "env", "pwd", "whoami", "uname")
    entries.append(Entry("etc/busybox-release", data=b"tiny\n"))
    # USER names someone the image lacks: the template falls back to root.
    return Image([Layer(make_tar(entries), "zstd")], env=["PATH=/bin"], user="nobody-here")


@pytest.fixture(scope="module")
def pushed(registry: Registry, debian_image: Image, busybox_image: Image) -> Iterator[dict[str, str]]:
    started = time.monotonic()
    registry.push_image("aenv/debian", "12", debian_image)
    registry.push_image("aenv/busybox", "1", busybox_image)
    print(f"pushed test images in {time.monotonic() - started:.1f}s")
    yield {"debian": f"{registry.host}/aenv/debian:12", "busybox": f"{registry.host}/aenv/busybox:1"}


def test_cli_pull_debian_image_and_run_it(server: ServerProcess, pushed: dict[str, str]) -> None:
    started = time.monotonic()
    res = cli(server, "pull", pushed["debian"], "--insecure", "--name", "debian-img")
    elapsed = time.monotonic() - started
    assert res.returncode == 0, res.stderr
    assert "template" in res.stdout and "debian-img" in res.stdout
    assert "done" in res.stderr  # per-layer progress lines (not a TTY here)
    print(f"\naenv pull of the debian image (~344 MB unpacked): {elapsed:.1f}s")

    ls = cli(server, "-o", "json", "template", "ls")
    rows = {r["names"][0]: r for r in json.loads(ls.stdout)}
    assert rows["debian-img"]["kind"] == "image" and rows["debian-img"]["defaultUser"] == "user"
    assert rows["base"]["kind"] == "base"

    sbx = Sandbox.create("debian-img", timeout=120)
    try:
        out = sbx.commands.run("cat /etc/aenv-image-test.txt; echo $IMAGE_VAR; id -un; pwd; "
                               "command -v less || echo no-less")
        assert out.stdout.split("\n")[:5] == ["from layer two", "from-config", "user",
                                              "/home/user", "no-less"]
        assert sbx.files.read("/etc/os-release").startswith("PRETTY_NAME=\"Debian")
        sbx.files.write("/home/user/new.txt", "written")  # the sandbox's own upper layer
        assert sbx.commands.run("cat new.txt").stdout == "written"
    finally:
        sbx.kill()


def test_api_pull_busybox_only_image(server: ServerProcess, pushed: dict[str, str]) -> None:
    events: list[dict[str, Any]] = []
    with httpx.Client(base_url=server.url, headers={"X-API-Key": server.api_key},
                      timeout=300) as http, http.stream("POST", "/aenv/images/pull",
                     json={"image": pushed["busybox"], "insecure": True}) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("application/x-ndjson")
        events = [json.loads(line) for line in resp.iter_lines() if line]
    assert events[0]["type"] == "resolved" and events[-1]["type"] == "template"
    assert any(e["type"] == "layer" and e["state"] == "done" for e in events)
    tpl = events[-1]["template"]
    assert tpl["names"] == [pushed["busybox"]] and tpl["defaultUser"] == "root"

    sbx = Sandbox.create(pushed["busybox"], timeout=120)
    try:
        # The SDK asks for /bin/bash -l -c; envd falls back to /bin/sh (busybox ash).
        out = sbx.commands.run("echo hello from $(cat /etc/busybox-release); whoami; ls /")
        lines = out.stdout.split("\n")
        assert lines[:2] == ["hello from tiny", "root"]
        assert {"bin", "etc", "proc", "tmp", "dev"} <= set(lines[2:])
        assert sbx.files.read("/etc/busybox-release") == "tiny\n"
    finally:
        sbx.kill()
    res = cli(server, "template", "rm", pushed["busybox"])
    assert res.returncode == 0, res.stderr
    ls = cli(server, "-o", "json", "template", "ls")
    assert pushed["busybox"] not in {n for r in json.loads(ls.stdout) for n in r["names"]}


def test_pull_errors_are_clear(server: ServerProcess, registry: Registry) -> None:
    res = cli(server, "pull", f"{registry.host}/no/such:image", "--insecure")
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert "MANIFEST_UNKNOWN" in res.stderr or "not found" in res.stderr.lower()
    res = cli(server, "pull", "Not A Ref")
    assert res.returncode == 1 and "invalid image reference" in res.stderr
    res = cli(server, "pull", f"{registry.host}/aenv/busybox:1", "--name", "base", "--insecure")
    assert res.returncode == 1 and "pick another --name" in res.stderr
    with httpx.Client(base_url=server.url, headers={"X-API-Key": server.api_key}) as http:
        resp = http.post("/aenv/images/pull", json={"image": "x", "bogus": 1})
        assert resp.status_code == 400


def test_unpack_throughput(debian_image: Image, tmp_path: Path) -> None:
    """Not a pass/fail bound: prints the number for docs/benchmarks.md."""
    bottom = debian_image.layers[0]
    blob = tmp_path / "blob"
    blob.write_bytes(bottom.blob)
    started = time.monotonic()
    out = unpack_layer(blob, bottom.media_type, digest_of(bottom.tar), tmp_path / "layers")
    elapsed = time.monotonic() - started
    assert (out / "etc/os-release").exists()
    print(f"\nunpack of a {len(bottom.tar) / 1e6:.0f} MB layer ({len(bottom.blob) / 1e6:.0f} MB "
          f"zstd): {elapsed:.1f}s, {len(bottom.tar) / 1e6 / elapsed:.0f} MB/s")
    shutil.rmtree(out)
