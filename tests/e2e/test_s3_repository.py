"""The server with its snapshot repository on a real S3-compatible server (moto): snapshots
(their images and sealed layers) go to the bucket before they are listed, and a node that lost
its local copies (cache and layers wiped, server restarted) creates sandboxes from them again.
"""

from __future__ import annotations

import os
import secrets
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
from e2b import Sandbox
from e2e_helpers import container_only, lose_local_state, wait_until

from aenv.devserver import S3Server, ServerProcess, prepare_home, remove_home
from aenv.runtime.container.layers import remove_layer


@pytest.fixture
def own_home() -> Iterator[Path]:
    home = prepare_home("aenv-e2e-s3-")
    yield home
    remove_home(home)


def _keys(s3: S3Server, prefix: str) -> set[str]:
    client = boto3.client("s3", endpoint_url=s3.endpoint, region_name=s3.region)
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=s3.bucket, Prefix=prefix)
    return {obj["Key"][len(prefix):] for page in pages for obj in page.get("Contents", [])}


def _s3_env(s3: S3Server, prefix: str) -> dict[str, str]:
    return {"AENV_SNAPSHOT_BACKEND": "s3", "AENV_SNAPSHOT_S3_ENDPOINT": s3.endpoint,
            "AENV_SNAPSHOT_S3_BUCKET": s3.bucket, "AENV_SNAPSHOT_S3_PREFIX": prefix,
            "AENV_SNAPSHOT_S3_REGION": s3.region,
            **{k: os.environ[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}}


@pytest.mark.slow
def test_snapshots_live_in_s3_and_come_back_to_a_node_that_lost_them(
        s3_server: S3Server, own_home: Path) -> None:
    prefix = f"e2e-{secrets.token_hex(4)}"
    env = _s3_env(s3_server, prefix)
    srv = ServerProcess(home=own_home, api_key="s3-key", extra_env=env).start(ready_timeout=300)
    opts = {"api_key": srv.api_key, "api_url": srv.url, "sandbox_url": srv.url}
    name = f"s3-{uuid.uuid4().hex[:8]}"
    payload = os.urandom(2 << 20)
    try:
        source = Sandbox.create(timeout=120, **opts)
        source.files.write("/home/user/payload.bin", payload)
        snap = source.create_snapshot(name=name, **opts)
        source.kill()
        # pushed in the background: the snapshot's manifest is written last
        wait_until(lambda: f"meta/manifests/{snap.snapshot_id}.json" in _keys(
            s3_server, prefix + "/"), 120, what="the snapshot in the bucket")
        stored = _keys(s3_server, prefix + "/")
        manifests = {k for k in stored if k.startswith("meta/manifests/")}
        assert f"meta/manifests/{snap.snapshot_id}.json" in manifests, stored
        assert any(k.startswith("meta/manifests/layer-seal-") for k in manifests), manifests
        assert sum(1 for k in stored if k.startswith("blobs/")) > 2  # content chunks

        # The node loses every local copy (cache and sealed layers) and restarts.
        srv.stop()
        shutil.rmtree(own_home / "cache" / "snapshots")
        sealed = list((own_home / "layers").glob("seal-*"))
        assert sealed
        for layer in sealed:
            remove_layer(layer)
        srv = ServerProcess(home=own_home, port=srv.port, api_key=srv.api_key,
                            extra_env=env).start(ready_timeout=300)
        copy = Sandbox.create(name, timeout=60, **opts)
        assert copy.files.read("/home/user/payload.bin", format="bytes") == payload
        assert copy.commands.run("hostname").stdout.strip() == copy.sandbox_id
        copy.kill()
        assert Sandbox.delete_snapshot(snap.snapshot_id, **opts) is True
        left = {k for k in _keys(s3_server, prefix + "/") if k.startswith("meta/manifests/")}
        assert left == set(), left  # the snapshot and its layer are gone from the bucket
    finally:
        srv.shutdown()


@container_only
@pytest.mark.slow
def test_a_paused_sandbox_lives_in_s3_and_resumes_on_a_node_that_lost_it(
        s3_server: S3Server, own_home: Path) -> None:
    """The paused state (checkpoint image + writable layer) is uploaded to the bucket; the
    node loses it, restarts, and the sandbox resumes with its files and processes."""
    prefix = f"e2e-{secrets.token_hex(4)}"
    env = _s3_env(s3_server, prefix)
    srv = ServerProcess(home=own_home, api_key="s3-key", extra_env=env).start(ready_timeout=300)
    opts = {"api_key": srv.api_key, "api_url": srv.url, "sandbox_url": srv.url}

    def paused_manifests(sandbox_id: str) -> set[str]:
        return {k for k in _keys(s3_server, f"{prefix}/meta/manifests/")
                if k.startswith(f"paused-{sandbox_id}-")}

    try:
        s = Sandbox.create(timeout=120, **opts)
        s.files.write("/home/user/kept.txt", "in the bucket")
        s.commands.run("nohup sleep 100000 >/dev/null 2>&1 &")
        assert s.pause() is True
        wait_until(lambda: len(paused_manifests(s.sandbox_id)) == 2, 60,
                   what="the paused state in the bucket")
        srv.stop()
        lose_local_state(own_home, s.sandbox_id)
        srv = ServerProcess(home=own_home, port=srv.port, api_key=srv.api_key,
                            extra_env=env).start(ready_timeout=300)
        again = Sandbox.connect(s.sandbox_id, **opts)
        assert again.files.read("/home/user/kept.txt") == "in the bucket"
        assert "sleep 100000" in again.commands.run("ps -eo args").stdout
        wait_until(lambda: not paused_manifests(s.sandbox_id), 20,
                   what="the paused state to leave the bucket")
        again.kill()
    finally:
        srv.shutdown()
