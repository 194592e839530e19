"""The S3 server (moto, real HTTP on a loopback port) stopped in the middle of the
repository's work: a snapshot's background push, and a create that must pull a snapshot
back. Nothing may be lost or stuck: the snapshot stays usable on its node and reaches the
bucket once S3 is back; the create fails with a clear error (never a 500 or a hang) and works
once S3 is back."""

from __future__ import annotations

import os
import secrets
import shutil
import time
from collections.abc import Iterator

import boto3
import pytest
from e2b import Sandbox
from e2e_helpers import container_only, wait_until
from faults_helpers import Node, assert_converged, set_up_sandbox, snapshots

from aenv.devserver import free_port
from aenv.runtime.container.layers import remove_layer

pytestmark = [container_only, pytest.mark.slow]

REGION = "us-east-1"


class Moto:
    """A moto S3 server that can be stopped and started again on the same port (its data
    lives in this process, so it survives)."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._cls = ThreadedMotoServer
        self._server = self._cls(ip_address="127.0.0.1", port=self.port, verbose=False)

    def start(self) -> None:
        self._server = self._cls(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()

    def stop(self) -> None:
        self._server.stop()


@pytest.fixture
def moto() -> Iterator[Moto]:
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    server = Moto()
    server.start()
    yield server
    server.stop()


def _manifests(moto: Moto, bucket: str) -> set[str]:
    client = boto3.client("s3", endpoint_url=moto.endpoint, region_name=REGION)
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket,
                                                             Prefix="meta/manifests/")
    return {obj["Key"] for page in pages for obj in page.get("Contents", [])}


def test_s3_down_during_a_push_and_a_pull(node: Node, moto: Moto, baseline: set[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    bucket = f"faults-{secrets.token_hex(4)}"
    boto3.client("s3", endpoint_url=moto.endpoint, region_name=REGION).create_bucket(
        Bucket=bucket)
    for key, value in {"AENV_SNAPSHOT_BACKEND": "s3", "AENV_SNAPSHOT_S3_ENDPOINT": moto.endpoint,
                       "AENV_SNAPSHOT_S3_BUCKET": bucket, "AENV_SNAPSHOT_S3_REGION": REGION,
                       "AENV_SNAPSHOT_PUSH_RETRY_S": "2"}.items():
        monkeypatch.setenv(key, value)
    node.start()
    sbx, sums = set_up_sandbox(node)
    moto.stop()
    with node.api() as api:  # captured and listed at once; the push fails in the background
        resp = api.post(f"/sandboxes/{sbx.sandbox_id}/snapshots", json={})
        assert resp.status_code in (200, 201), resp.text
        snap = resp.json()["snapshotID"]
    child = Sandbox.create(snap, timeout=120, **node.opts)  # usable on its node meanwhile
    assert child.commands.run("cd /home/user/data && sha256sum f* | sha256sum"
                              ).stdout.strip() == sums
    child.kill()
    time.sleep(3)
    with node.api() as api:
        assert not api.get(f"/snapshots/{snap}").json().get("inRepository")
    moto.start()
    wait_until(lambda: f"meta/manifests/{snap}.json" in _manifests(moto, bucket), 60,
               what="the push once S3 is back")

    # A node that lost its local copy must pull it; S3 is down: a clear error, quickly.
    assert node.server is not None
    node.server.stop()
    shutil.rmtree(node.home / "cache" / "snapshots")
    for layer in (node.home / "layers").glob("seal-*"):
        remove_layer(layer)
    node.start()
    moto.stop()
    with node.api() as api:
        t0 = time.monotonic()
        resp = api.post("/sandboxes", json={"templateID": snap, "timeout": 60})
        took = time.monotonic() - t0
    assert resp.status_code == 503, resp.text
    body = resp.json()
    assert body["code"] == 503 and body["message"], body
    assert took < 60, took
    assert snapshots(node) and snapshots(node)[0]["snapshotID"] == snap  # still listed
    moto.start()
    copy = Sandbox.create(snap, timeout=120, **node.opts)
    assert copy.commands.run("cd /home/user/data && sha256sum f* | sha256sum"
                             ).stdout.strip() == sums
    copy.kill()
    assert_converged(node, baseline)
