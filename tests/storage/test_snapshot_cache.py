"""LocalCache over a real repository (posix_fs and moto S3): LRU, pins, wipe-and-restore."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
from snapshot_helpers import tree_signature, write_random

from aenv.errors import AenvError, ErrorCode
from aenv.storage.repository import LocalCache, Repository

MiB = 1 << 20


async def _push_three(repo: Repository, tmp_path: Path) -> dict[str, Path]:
    sources = {}
    for i, sid in enumerate(("s1", "s2", "s3")):
        src = tmp_path / "src" / sid
        src.mkdir(parents=True)
        write_random(src / "pages-1.img", MiB, seed=i)
        (src / "manifest.txt").write_text(sid)
        await repo.push(sid, src)
        sources[sid] = src
    return sources


async def test_lru_eviction_and_pins(repo: Repository, tmp_path: Path) -> None:
    sources = await _push_three(repo, tmp_path)
    size = MiB + 2
    cache = LocalCache(tmp_path / "cache", int(1.5 * size), repo)  # room for one snapshot

    p1 = await cache.ensure_local("s1")
    assert tree_signature(p1) == tree_signature(sources["s1"])
    await cache.ensure_local("s2")  # s1 is least recently used and unpinned: evicted
    assert "s1" not in cache and "s2" in cache and not p1.exists()
    st = cache.stats()
    assert (st.misses, st.hits, st.evictions, st.entries, st.bytes) == (2, 0, 1, 1, size)

    async with cache.use("s2") as p2:  # pinned while in use
        await cache.ensure_local("s3")  # over the limit, but s2 is pinned: nothing to evict
        assert "s2" in cache and "s3" in cache and p2.is_dir()
        assert cache.stats().pinned == 1
        with pytest.raises(AenvError) as exc:
            await cache.evict("s2")
        assert exc.value.code is ErrorCode.CONFLICT
        await cache.ensure_local("s2")  # a hit; s3 becomes the LRU victim
    assert "s3" not in cache and "s2" in cache
    st = cache.stats()
    assert st.hits == 2 and st.evictions == 2 and st.pinned == 0  # use() and ensure_local hit


async def test_wiped_cache_pulls_again(repo: Repository, tmp_path: Path) -> None:
    sources = await _push_three(repo, tmp_path)
    root = tmp_path / "cache"
    cache = LocalCache(root, 100 * MiB, repo)
    path = await cache.ensure_local("s2")
    shutil.rmtree(root)  # the local cache is wiped; the snapshot only exists in the repository
    again = await cache.ensure_local("s2")
    assert again == path and tree_signature(again) == tree_signature(sources["s2"])
    assert cache.stats().misses == 2

    shutil.rmtree(root)  # and after a restart with an empty cache
    fresh = LocalCache(root, 100 * MiB, repo)
    restored = await fresh.ensure_local("s2")
    assert tree_signature(restored) == tree_signature(sources["s2"])
    # a restart over a populated cache keeps its entries (and sizes) without pulling
    third = LocalCache(root, 100 * MiB, repo)
    assert "s2" in third and third.stats().bytes == MiB + 2
    await third.ensure_local("s2")
    assert third.stats().hits == 1 and third.stats().misses == 0


async def test_concurrent_ensure_local_pulls_once(repo: Repository, tmp_path: Path) -> None:
    await _push_three(repo, tmp_path)
    cache = LocalCache(tmp_path / "cache", 100 * MiB, repo)
    paths = await asyncio.gather(*(cache.ensure_local("s1") for _ in range(5)))
    assert len(set(paths)) == 1
    st = cache.stats()
    assert (st.misses, st.hits) == (1, 4)
    with pytest.raises(AenvError) as exc:
        await cache.ensure_local("missing")
    assert exc.value.code is ErrorCode.NOT_FOUND
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["s1"]


async def test_adopt_moves_a_local_snapshot_in(repo: Repository, tmp_path: Path) -> None:
    src = tmp_path / "fresh"
    src.mkdir()
    write_random(src / "pages-1.img", MiB, seed=9)
    sig = tree_signature(src)
    cache = LocalCache(tmp_path / "cache", 100 * MiB, repo)
    path = await cache.adopt("local-1", src)
    assert not src.exists() and tree_signature(path) == sig
    assert await cache.ensure_local("local-1") == path and cache.stats().hits == 1
