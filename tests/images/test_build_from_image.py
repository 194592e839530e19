"""A template build `fromImage` an OCI image the server has not pulled yet: the build pulls it
(a loopback registry the server's `images.insecure_registries` allows), runs its steps with
/bin/sh (the image has no bash), and sandboxes start from the result. Drives the build over
the documented REST shape with plain httpx, then creates a sandbox with the official SDK."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from e2b import Sandbox
from oci_helpers import Image, Layer, Registry, busybox_rootfs, make_tar

from aenv.devserver import ServerProcess, sdk_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def image_server(registry: Registry) -> Iterator[ServerProcess]:
    entries = busybox_rootfs("sh", "cat", "echo", "id", "env", "pwd", "whoami")
    registry.push_image("aenv/build-busybox", "1",
                        Image([Layer(make_tar(entries), "gzip")], env=["PATH=/bin"]))
    with sdk_server("aenv-build-image-",
                    {"AENV_IMAGES_INSECURE_REGISTRIES": registry.host}) as srv:
        yield srv


def test_build_from_image_pulls_it(image_server: ServerProcess, registry: Registry) -> None:
    image = f"{registry.host}/aenv/build-busybox:1"
    with httpx.Client(base_url=image_server.url, headers={"X-API-Key": image_server.api_key},
                      timeout=60) as api:
        req = api.post("/v3/templates", json={"name": "from-busybox"})
        assert req.status_code == 202, req.text
        tpl_id, build_id = req.json()["templateID"], req.json()["buildID"]
        start = api.post(f"/v2/templates/{tpl_id}/builds/{build_id}", json={
            "fromImage": image,
            "steps": [{"type": "ENV", "args": ["BUILT_BY", "aenv"]},
                      {"type": "RUN", "args": ["echo $BUILT_BY > /tmp/made; cat /tmp/made"]}]})
        assert start.status_code == 202, start.text
        assert api.post(f"/v2/templates/{tpl_id}/builds/{build_id}", json={}).status_code == 409
        deadline = time.monotonic() + 180
        while True:
            status = api.get(f"/templates/{tpl_id}/builds/{build_id}/status").json()
            if status["status"] in ("ready", "error"):
                break
            assert time.monotonic() < deadline
            time.sleep(0.3)
        messages = [e["message"] for e in status["logEntries"]]
        assert status["status"] == "ready", status
        assert any("pulling the image" in m for m in messages) and "aenv" in messages, messages
        # Paging: logsOffset skips what was read, `level` filters.
        tail = api.get(f"/templates/{tpl_id}/builds/{build_id}/status",
                       params={"logsOffset": len(messages) - 1}).json()["logEntries"]
        assert [e["message"] for e in tail] == messages[-1:]
        logs = api.get(f"/templates/{tpl_id}/builds/{build_id}/logs").json()["logs"]
        assert [e["message"] for e in logs] == messages
        sbx = Sandbox.create("from-busybox", timeout=60)
        try:
            assert sbx.files.read("/tmp/made").strip() == "aenv"
            assert sbx.commands.run("echo $BUILT_BY").stdout.strip() == "aenv"
        finally:
            sbx.kill()
        assert api.delete(f"/templates/{tpl_id}").status_code == 204
