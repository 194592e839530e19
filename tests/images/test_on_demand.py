"""On-demand image layers: a node converts a ~350 MB Debian image's layers into a shared
snapshot repository; a second node (its own AENV_HOME and server, same repository) pulls the
image on demand and starts a sandbox that answers having fetched a small part of the layer.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2b import Sandbox
from oci_helpers import Entry, Image, Layer, Registry, digest_of, make_tar, tar_directory

from aenv.config import Config
from aenv.devserver import ServerProcess, base_layer, prepare_home, remove_home
from aenv.images.layers import layer_id
from aenv.images.lazy import LazyLayers, repository_key
from aenv.images.pull import ImagePuller
from aenv.orchestrator.store import Store
from aenv.storage.layout import Layout
from aenv.storage.repository import Repository, open_blob_store

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def debian(registry: Registry) -> tuple[str, str, str]:
    """(reference, bottom layer id, top layer id) of the base layer plus a small layer."""
    bottom = Layer(tar_directory(base_layer()), "zstd")
    top = Layer(make_tar([Entry("etc/aenv-image-test.txt", data=b"from layer two\n")]), "gzip")
    registry.push_image("aenv/lazy-debian", "12", Image([bottom, top]))
    return (f"{registry.host}/aenv/lazy-debian:12", layer_id(digest_of(bottom.tar)),
            layer_id(digest_of(top.tar)))


@pytest.fixture(scope="module")
def repository_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="aenv-lazy-repo-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def _node1_pull_and_convert(image: str, bottom: str, top: str, repository_dir: Path,
                                  tmp_path: Path) -> Layout:
    """Node 1: an ordinary pull that converts its layers into the shared repository."""
    cfg = Config()
    cfg.server.home = tmp_path / "node1"
    cfg.snapshot.path = str(repository_dir)
    cfg.images.convert_layers = True
    layout = Layout(cfg.home)
    layout.ensure()
    store = Store(layout.database)
    repo = Repository(open_blob_store(cfg.snapshot, cfg.home))
    puller = ImagePuller(cfg, layout, store, lazy=LazyLayers(layout, repo, None))
    started = time.monotonic()
    await puller.pull(image, insecure=True)
    pulled = time.monotonic() - started
    await puller.wait_conversions()
    converted = time.monotonic() - started - pulled
    manifest = await repo.manifest(repository_key(bottom))
    print(f"\nnode 1: pull {pulled:.1f}s, conversion {converted:.1f}s "
          f"({manifest.bytes_total / 1e6:.0f} MB of files)")
    assert await repo.exists(repository_key(top))
    store.close()
    repo.close()
    return layout


def test_convert_then_start_on_demand(debian: tuple[str, str, str], repository_dir: Path,
                                      tmp_path: Path) -> None:
    image, bottom, top = debian
    layout = asyncio.run(_node1_pull_and_convert(image, bottom, top, repository_dir, tmp_path))

    # Node 2: a server pulling on demand from the same repository.
    home = prepare_home("aenv-test-lazy-")
    srv = ServerProcess(home=home, extra_env={
        "AENV_SNAPSHOT_PATH": str(repository_dir), "AENV_IMAGES_ON_DEMAND": "1",
        "AENV_IMAGES_ON_DEMAND_PREFETCH_S": "-1", "AENV_RUNTIME_READY_POOL": "0",
        "AENV_RUNTIME_WARM_POOL": "2", "AENV_RUNTIME_WARM_PROCESSES": "2"})
    srv.start(ready_timeout=300)
    saved = dict(os.environ)
    os.environ.update(srv.sdk_env())
    try:
        env = {**os.environ, "AENV_URL": srv.url, "AENV_API_KEY": srv.api_key}
        started = time.monotonic()
        res = subprocess.run([sys.executable, "-m", "aenv.cli.main", "pull", image, "--insecure",
                              "--name", "lazy-debian"], env=env, capture_output=True, text=True,
                             timeout=600, check=False)
        assert res.returncode == 0, res.stderr
        pull_s = time.monotonic() - started
        layout2 = Layout(home)
        assert layout2.layer(bottom).is_symlink()  # attached, not unpacked
        sbx = Sandbox.create("lazy-debian", timeout=120)
        try:
            out = sbx.commands.run("cat /etc/aenv-image-test.txt; head -1 /etc/os-release; "
                                   "ls /usr/bin | wc -l")
            ready_s = time.monotonic() - started
            stats = json.loads((home / "cache/lazy" / bottom / "stats.json").read_text())
            lines = out.stdout.split("\n")
            assert lines[0] == "from layer two" and lines[1].startswith("PRETTY_NAME=\"Debian")
            assert int(lines[2]) > 100
            # The sandbox answered having fetched a small part of the layer.
            assert 0 < stats["fetched_bytes"] < stats["total_bytes"] / 4
            print(f"node 2: on-demand pull {pull_s:.2f}s, sandbox answered after {ready_s:.2f}s "
                  f"with {stats['fetched_bytes'] / 1e6:.1f} of {stats['total_bytes'] / 1e6:.0f} "
                  "MB fetched")
            # Contents read through FUSE are the layer's (checked against node 1's copy).
            want = (layout.layer(bottom) / "etc/os-release").read_text()
            assert sbx.files.read("/etc/os-release") == want
            sbx.files.write("/etc/new.txt", "upper")  # writes land in the sandbox's upper
            assert sbx.commands.run("cat /etc/new.txt").stdout == "upper"
            # Pause (CRIU) and resume a sandbox whose root stacks on the FUSE layer.
            assert sbx.pause() is True
            sbx = Sandbox.connect(sbx.sandbox_id, timeout=120)
            assert sbx.commands.run("cat /etc/new.txt; tail -1 /etc/aenv-image-test.txt"
                                    ).stdout == "upperfrom layer two\n"
        finally:
            sbx.kill()
    finally:
        srv.shutdown()
        os.environ.clear()
        os.environ.update(saved)
        remove_home(home)
    assert not os.path.ismount(home / "lazy")
