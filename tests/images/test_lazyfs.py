"""The on-demand layer filesystem's operations, called directly (no mount): a converted layer
answers metadata from its manifest, fetches only the chunks a read covers, and prefetches
the rest in the background when asked to. (A mounted layer under overlayfs and a real
sandbox: test_on_demand.py.)"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import stat
import time
from pathlib import Path

import pytest
from fuse import FuseOSError  # type: ignore[import-untyped]
from oci_helpers import random_bytes

from aenv.config import Config
from aenv.images.lazy import LazyLayers
from aenv.images.lazyfs import LazyFS
from aenv.storage.layout import Layout
from aenv.storage.repository import Repository, open_blob_store

LAYER = "oci-sha256-" + "ab" * 12


@pytest.fixture
def converted(tmp_path: Path) -> tuple[LazyLayers, Repository]:
    src = tmp_path / "src"
    (src / "etc").mkdir(parents=True)
    (src / "etc/hello").write_text("hello\n")
    os.link(src / "etc/hello", src / "hardlink")
    (src / "big").write_bytes(random_bytes(4_000_000, 7))
    (src / "link").symlink_to("etc/hello")
    os.mknod(src / "gone", stat.S_IFCHR | 0o644, 0)  # an overlayfs whiteout
    (src / "opaque").mkdir()
    os.setxattr(src / "opaque", "trusted.overlay.opaque", b"y")
    cfg = Config()
    cfg.server.home = tmp_path / "home"
    layout = Layout(cfg.home)
    layout.ensure()
    repo = Repository(open_blob_store(cfg.snapshot, cfg.home))
    lazy = LazyLayers(layout, repo, None)
    return lazy, repo


async def test_reads_fetch_only_what_they_cover(converted: tuple[LazyLayers, Repository],
                                                tmp_path: Path) -> None:
    lazy, repo = converted
    await lazy.convert(LAYER, tmp_path / "src")
    await lazy.convert(LAYER, tmp_path / "src")  # converted once: the key names the content
    total = await lazy.attach(LAYER, lazy.layout.layer(LAYER))
    assert lazy.layout.layer(LAYER).readlink() == lazy.mountpoint / LAYER
    fs = LazyFS(lazy.state, repo.store, prefetch_after=None)

    assert fs.getattr(f"/{LAYER}/big")["st_size"] == 4_000_000
    names = {item[0] if isinstance(item, tuple) else item
             for item in fs.readdir(f"/{LAYER}", None)}
    assert {"etc", "big", "link", "gone", "opaque", "hardlink"} <= names
    kinds = {item[0]: item[1]["st_mode"] for item in fs.readdir(f"/{LAYER}", None)
             if isinstance(item, tuple)}
    assert stat.S_ISCHR(kinds["gone"])  # d_type: overlayfs hides whiteouts in listings
    gone = fs.getattr(f"/{LAYER}/gone")
    assert stat.S_ISCHR(gone["st_mode"]) and gone["st_rdev"] == 0
    assert fs.getxattr(f"/{LAYER}/opaque", "trusted.overlay.opaque") == b"y"
    with pytest.raises(FuseOSError) as err:
        fs.getxattr(f"/{LAYER}/etc", "trusted.overlay.opaque")
    assert err.value.errno == errno.ENODATA
    assert fs.readlink(f"/{LAYER}/link") == "etc/hello"
    assert lazy.stats(LAYER) == {}  # nothing fetched by metadata

    assert fs.read(f"/{LAYER}/hardlink", 100, 0, 0) == b"hello\n"
    big = (tmp_path / "src/big").read_bytes()
    assert fs.read(f"/{LAYER}/big", 4096, 2_000_000, 0) == big[2_000_000:2_004_096]
    stats = lazy.stats(LAYER)
    assert stats["total_bytes"] == total and 0 < stats["fetched_bytes"] <= 6 + (1 << 20) * 2
    before = stats["fetched_bytes"]
    assert fs.read(f"/{LAYER}/big", 4096, 2_000_000, 0) == big[2_000_000:2_004_096]
    assert lazy.stats(LAYER)["fetched_bytes"] == before  # a chunk is fetched once
    assert b"".join(fs.read(f"/{LAYER}/big", 1 << 17, off, 0)
                    for off in range(0, 4_000_000, 1 << 17)) == big
    with pytest.raises(FuseOSError):
        fs.open(f"/{LAYER}/big", os.O_WRONLY)
    with pytest.raises(FuseOSError):
        fs.getattr(f"/{LAYER}/nope")
    with pytest.raises(FuseOSError):
        fs.getattr("/oci-sha256-not-attached")


async def test_prefetch_fetches_the_rest(converted: tuple[LazyLayers, Repository],
                                         tmp_path: Path) -> None:
    lazy, repo = converted
    await lazy.convert(LAYER, tmp_path / "src")
    total = await lazy.attach(LAYER, lazy.layout.layer(LAYER))
    fs = LazyFS(lazy.state, repo.store, prefetch_after=0.0)
    assert fs.read(f"/{LAYER}/etc/hello", 100, 0, 0) == b"hello\n"
    deadline = time.monotonic() + 30
    while lazy.stats(LAYER).get("fetched_bytes") != total:
        assert time.monotonic() < deadline, json.dumps(lazy.stats(LAYER))
        await asyncio.sleep(0.05)
    assert lazy.local_bytes(LAYER) >= total
