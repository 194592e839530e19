"""The bounded image layer cache: with a limit smaller than the images in use, cold layers
are evicted (checked on disk), layers of live work never are, and evicted layers are fetched
again from the registry when a sandbox needs them.

Three images share a busybox layer and each has a 6 MB layer of its own; the cache holds
12 MB, less than the ~20 MB they need together."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox
from oci_helpers import Entry, Image, Layer, Registry, busybox_rootfs, digest_of, make_tar, random_bytes

from aenv.config import Config
from aenv.devserver import ServerProcess, sdk_server
from aenv.images.cache import LayerCache
from aenv.images.layers import layer_id
from aenv.images.pull import ImagePuller
from aenv.orchestrator.store import Store
from aenv.storage.layout import Layout

LIMIT = 12_000_000
NAMES = ("a", "b", "c")


def _busybox_layer() -> Layer:
    entries = busybox_rootfs("sh", "cat", "ls", "wc", "echo")
    return Layer(make_tar(entries), "zstd")


@pytest.fixture(scope="module")
def images(registry: Registry) -> dict[str, tuple[str, str]]:
    """name -> (reference, layer id of the image's own layer)."""
    bottom = _busybox_layer()
    out = {}
    for seed, name in enumerate(NAMES, start=1):
        own = Layer(make_tar([Entry("data", "dir", mode=0o755),
                              Entry(f"data/{name}.bin", data=random_bytes(6_000_000, seed)),
                              Entry("etc/image-name", data=name.encode() + b"\n")]), "gzip")
        registry.push_image(f"aenv/cache-{name}", "1", Image([bottom, own], env=["PATH=/bin"]))
        out[name] = (f"{registry.host}/aenv/cache-{name}:1", layer_id(digest_of(own.tar)))
    return out


def _own_layers(layout: Layout, images: dict[str, tuple[str, str]]) -> dict[str, bool]:
    return {name: layout.layer(lid).is_dir() for name, (_, lid) in images.items()}


async def test_lru_eviction_protection_and_refetch(config: Config, layout: Layout, store: Store,
                                                   images: dict[str, tuple[str, str]]) -> None:
    config.images.cache_bytes = LIMIT
    live: set[str] = set()
    cache = LayerCache(layout.layers_dir, layout.cache_dir / "oci-layers.json", LIMIT,
                       in_use=lambda: live)
    puller = ImagePuller(config, layout, store, cache)
    puller.sweep()
    tpls = {}
    for name in NAMES:
        tpls[name] = await puller.pull(images[name][0], name=name, insecure=True)
        await cache.drain()
        assert cache.total_bytes() <= LIMIT
    # The layers of the image just pulled stay; the least recently used one went first.
    assert _own_layers(layout, images) == {"a": False, "b": False, "c": True}
    assert cache.evictions == 2 and cache.stats().evicted_bytes > 11_000_000

    # A create from `a` fetches its evicted layer again (by manifest digest), counts a miss.
    await puller.ensure_layers(tpls["a"].layers)
    await cache.drain()
    assert (layout.layer(images["a"][1]) / "data/a.bin").stat().st_size == 6_000_000
    assert cache.misses == 1 and cache.hits == 1  # the shared busybox layer was local
    assert _own_layers(layout, images) == {"a": True, "b": False, "c": False}

    # A layer in use (a live sandbox's) is never evicted, even when the cache must go over.
    live.update(tpls["a"].layers)
    await puller.ensure_layers(tpls["b"].layers)
    await puller.ensure_layers(tpls["c"].layers)
    await cache.drain()
    assert _own_layers(layout, images) == {"a": True, "b": False, "c": True}
    live.update(tpls["c"].layers)
    await puller.ensure_layers(tpls["b"].layers)
    assert _own_layers(layout, images) == {"a": True, "b": True, "c": True}
    assert cache.stats().over_limit  # everything is in use: over the limit, nothing failed
    live.clear()
    await puller.collect_layers()
    await cache.drain()
    assert cache.total_bytes() <= LIMIT
    assert _own_layers(layout, images) == {"a": False, "b": True, "c": False}

    # The index survives a restart; layers found on disk without it are adopted.
    again = LayerCache(layout.layers_dir, layout.cache_dir / "oci-layers.json", LIMIT)
    again.load()
    assert again.total_bytes() == cache.total_bytes()
    assert (entry := again.entry(images["b"][1])) is not None and entry.source is not None
    (layout.cache_dir / "oci-layers.json").unlink()
    again.load()
    assert images["b"][1] in again and again.total_bytes() == cache.total_bytes()


# ---------------------------------------------------------------------------- with sandboxes
def _cli(server: ServerProcess, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "AENV_URL": server.url, "AENV_API_KEY": server.api_key}
    return subprocess.run([sys.executable, "-m", "aenv.cli.main", *args], env=env,
                          capture_output=True, text=True, timeout=600, check=False)


@pytest.fixture(scope="module")
def cache_server() -> Iterator[ServerProcess]:
    """A server of its own: a 12 MB layer cache and small warm pools (2 shared cores)."""
    with sdk_server("aenv-test-cache-", {
            "AENV_IMAGES_CACHE_BYTES": str(LIMIT), "AENV_RUNTIME_READY_POOL": "0",
            "AENV_RUNTIME_WARM_POOL": "2", "AENV_RUNTIME_WARM_PROCESSES": "2"}) as srv:
        yield srv


def _run(sbx: Sandbox, cmd: str) -> str:
    return sbx.commands.run(cmd).stdout.strip()


@pytest.mark.slow
def test_sandboxes_start_from_more_images_than_the_cache_holds(
        cache_server: ServerProcess, images: dict[str, tuple[str, str]]) -> None:
    layout = Layout(cache_server.home)
    for name in NAMES:
        res = _cli(cache_server, "pull", images[name][0], "--insecure", "--name", f"cache-{name}")
        assert res.returncode == 0, res.stderr
    assert _own_layers(layout, images) == {"a": False, "b": False, "c": True}

    live = Sandbox.create("cache-a", timeout=300)  # its layer is fetched again first
    paused = Sandbox.create("cache-b", timeout=300)
    try:
        assert _run(live, "cat /etc/image-name; wc -c < /data/a.bin") == "a\n6000000"
        assert _run(paused, "cat /etc/image-name") == "b"
        assert paused.pause() is True
        # `c` was evicted to make room for `a` and `b`; it starts too, and a's and b's layers
        # (a running and a paused sandbox use them) stay although the cache is over its limit.
        third = Sandbox.create("cache-c", timeout=300)
        try:
            assert _run(third, "cat /etc/image-name; wc -c < /data/c.bin") == "c\n6000000"
            assert _own_layers(layout, images) == {"a": True, "b": True, "c": True}
        finally:
            third.kill()
        # c's sandbox is gone: its layer is cold and over the limit, so it goes.
        assert _own_layers(layout, images) == {"a": True, "b": True, "c": False}
        resumed = Sandbox.connect(paused.sandbox_id, timeout=300)
        assert _run(resumed, "cat /etc/image-name") == "b"
    finally:
        for sbx in (live, paused):
            Sandbox.kill(sbx.sandbox_id)

    res = _cli(cache_server, "-o", "json", "cache")
    assert res.returncode == 0, res.stderr
    body = json.loads(res.stdout)
    assert body["maxBytes"] == LIMIT and body["misses"] >= 3 and body["evictions"] >= 3
    assert body["bytes"] <= LIMIT  # no sandbox left: back under the limit
    text = _cli(cache_server, "cache").stdout
    assert "image layer cache:" in text and "evictions" in text
    metrics = httpx.get(cache_server.url + "/metrics").text  # unauthenticated, like /health
    from prometheus_client.parser import text_string_to_metric_families
    values = {s.name: s.value for f in text_string_to_metric_families(metrics) for s in f.samples}
    assert values["aenv_layer_cache_max_bytes"] == LIMIT
    assert values["aenv_layer_cache_evictions_total"] >= 3


async def test_lazy_layers_are_evicted_with_their_fetched_chunks(tmp_path: Path) -> None:
    """An on-demand layer (a symlink into the FUSE mount, chunks in cache/lazy/<id>) counts
    what was fetched of it, and eviction removes the link and the chunks, never while used."""
    from aenv.images.lazy import LazyLayers
    from aenv.storage.repository import Repository, open_blob_store

    cfg = Config()
    cfg.server.home = tmp_path / "home"
    layout = Layout(cfg.home)
    layout.ensure()
    lazy = LazyLayers(layout, Repository(open_blob_store(cfg.snapshot, cfg.home)), None)
    live: set[str] = set()
    cache = LayerCache(layout.layers_dir, layout.cache_dir / "oci-layers.json", 1_000_000,
                       in_use=lambda: live, lazy=lazy)
    cache.load()
    names = [f"oci-sha256-{i:024x}" for i in range(2)]
    for name in names:
        (lazy.state / name / "chunks").mkdir(parents=True)
        (lazy.state / name / "manifest.json").write_text("{}")
        (lazy.state / name / "chunks" / ("0" * 64)).write_bytes(random_bytes(800_000, 3))
        (lazy.mountpoint / name).mkdir(parents=True)  # stands in for the FUSE directory
        layout.layer(name).symlink_to(lazy.mountpoint / name)
        cache.add(name, 0, "127.0.0.1:1/x@sha256:" + "0" * 64, True, lazy=True)
    assert cache.total_bytes() >= 1_600_000  # the fetched chunks, not the layers' sizes
    live.add(names[0])
    assert await cache.evict() == [names[1]]
    await cache.drain()
    assert not layout.layer(names[1]).is_symlink() and not (lazy.state / names[1]).exists()
    assert layout.layer(names[0]).is_symlink() and (lazy.state / names[0]).exists()
    assert (lazy.mountpoint / names[1]).is_dir()  # the FUSE side is not the cache's to touch
    entry = cache.entry(names[1])
    assert entry is not None and entry.source is not None and not entry.lazy  # fetchable again
