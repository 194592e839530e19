"""Snapshot repository over real backends: a posix directory and a moto S3 server."""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import stat
import time
from pathlib import Path

import pytest
from snapshot_helpers import tree_signature, write_random

from aenv.errors import AenvError, ErrorCode
from aenv.storage.repository import BlobCorrupted, BlobStore, PosixBlobStore, Repository
from aenv.storage.repository.s3 import S3BlobStore

MiB = 1 << 20
IS_ROOT = os.geteuid() == 0


def build_tree(root: Path) -> None:
    """A small snapshot: CRIU-like images plus a filesystem layer with every entry kind."""
    img = root / "img"
    img.mkdir(parents=True)
    write_random(img / "pages-1.img", 3 * MiB + 123, seed=1)  # several chunks, odd tail
    (img / "pagemap-1.img").write_bytes(b"\x01" * 5000)
    (img / "empty.img").write_bytes(b"")
    (img / "zeros.img").write_bytes(bytes(2 * MiB))  # all-zero: stays sparse on pull
    upper = root / "upper"
    (upper / "home/user/.cache").mkdir(parents=True)
    (upper / "home/user/run.sh").write_text("#!/bin/sh\necho hi\n")
    os.chmod(upper / "home/user/run.sh", 0o750)
    os.chmod(upper / "home/user/.cache", 0o700)
    (upper / "home/user/secret").write_text("s")
    os.chmod(upper / "home/user/secret", 0o600)
    os.symlink("run.sh", upper / "home/user/link")
    os.symlink("/does/not/exist", upper / "home/user/dangling")
    os.link(upper / "home/user/run.sh", upper / "home/user/hardlink.sh")
    os.mkfifo(upper / "home/user/fifo")
    os.utime(upper / "home/user/run.sh", ns=(1_600_000_000_123_456_789, 1_600_000_000_123_456_789))
    if IS_ROOT:
        os.mknod(upper / "home/user/whiteout", stat.S_IFCHR | 0o000, os.makedev(0, 0))
        os.chown(upper / "home/user", 1000, 1000)
        os.chown(upper / "home/user/secret", 1000, 1000)
        os.setxattr(upper / "home", "trusted.overlay.opaque", b"y")
    os.chmod(root, 0o711)


async def test_round_trip(repo: Repository, tmp_path: Path) -> None:
    src = tmp_path / "src"
    build_tree(src)
    stats = await repo.push("snap-rt", src)
    assert stats.bytes_total == 3 * MiB + 123 + 5000 + 2 * MiB + len("#!/bin/sh\necho hi\n") + 1
    assert stats.chunks_total >= 5
    assert await repo.exists("snap-rt")
    assert "snap-rt" in await repo.list()
    out = tmp_path / "out" / "snap-rt"
    pstats = await repo.pull("snap-rt", out)
    assert pstats.bytes_total == stats.bytes_total
    assert tree_signature(out) == tree_signature(src)
    # the zero image came back as a hole, not as 2 MiB of written zeros
    assert os.stat(out / "img/zeros.img").st_blocks == 0
    with pytest.raises(AenvError) as exc:
        await repo.push("snap-rt", src)
    assert exc.value.code is ErrorCode.CONFLICT
    with pytest.raises(AenvError) as exc:
        await repo.pull("snap-rt", out)  # never merges into an existing tree
    assert exc.value.code is ErrorCode.CONFLICT
    with pytest.raises(AenvError) as exc:
        await repo.pull("no-such-snapshot", tmp_path / "x")
    assert exc.value.code is ErrorCode.NOT_FOUND


def change_a_little(b: Path) -> None:
    """What a second snapshot of a barely changed sandbox looks like."""
    rnd = random.Random(7)
    with (b / "pages-1.img").open("r+b") as f:  # a few KiB rewritten in place
        f.seek(5 * MiB + 4096)
        f.write(rnd.randbytes(3 * 4096))
    data = (b / "pages-2.img").read_bytes()  # two pages inserted: everything after shifts
    (b / "pages-2.img").write_bytes(data[:7 * MiB] + rnd.randbytes(2 * 4096) + data[7 * MiB:])
    (b / "core-1.img").write_bytes(rnd.randbytes(3000))  # a new small file


async def test_dedup_second_snapshot_stores_little(repo: Repository, tmp_path: Path) -> None:
    a = tmp_path / "a"
    a.mkdir()
    for i in range(4):
        write_random(a / f"pages-{i}.img", 16 * MiB, seed=100 + i)
    sa = await repo.push("snap-a", a)
    assert sa.bytes_total == 64 * MiB
    assert sa.chunks_new == sa.chunks_total

    b = tmp_path / "b"
    shutil.copytree(a, b, symlinks=True)
    change_a_little(b)
    sb = await repo.push("snap-b", b, parent_id="snap-a")
    ratio = sb.bytes_uploaded / sb.bytes_total
    print(f"\n{type(repo.store).__name__}: A {sa.bytes_total / MiB:.0f} MiB in {sa.seconds:.2f}s "
          f"({sa.bytes_total / MiB / sa.seconds:.0f} MiB/s), chunks {sa.chunks_total}; "
          f"B uploaded {sb.bytes_uploaded / 1024:.0f} KiB = {ratio:.2%} "
          f"({sb.chunks_new}/{sb.chunks_total} chunks) in {sb.seconds:.2f}s")
    assert ratio < 0.05
    out = tmp_path / "out-b"
    pb = await repo.pull("snap-b", out)
    print(f"pull B: {pb.bytes_total / MiB / pb.seconds:.0f} MiB/s ({pb.seconds:.2f}s)")
    assert tree_signature(out) == tree_signature(b)


async def _corrupt_one_chunk(repo: Repository, snapshot_id: str) -> str:
    manifest = await repo.manifest(snapshot_id)
    digest = next(e.chunks[1][0] for e in manifest.entries if e.path == "img/pages-1.img")
    store = repo.store
    if isinstance(store, PosixBlobStore):
        path = store.blob_path(digest)
        blob = bytearray(path.read_bytes())
        blob[len(blob) // 2] ^= 0x01
        path.write_bytes(bytes(blob))
    else:
        assert isinstance(store, S3BlobStore)
        client = store._client
        key = store.blob_key(digest)
        blob = bytearray(client.get_object(Bucket=store.bucket, Key=key)["Body"].read())
        blob[len(blob) // 2] ^= 0x01
        client.put_object(Bucket=store.bucket, Key=key, Body=bytes(blob))
    return digest


async def test_corrupt_chunk_is_detected_and_nothing_partial_remains(
        repo: Repository, tmp_path: Path) -> None:
    src = tmp_path / "src"
    build_tree(src)
    await repo.push("snap-c", src)
    digest = await _corrupt_one_chunk(repo, "snap-c")
    dest_parent = tmp_path / "out"
    dest_parent.mkdir()
    with pytest.raises(BlobCorrupted) as exc:
        await repo.pull("snap-c", dest_parent / "snap-c")
    assert digest in exc.value.message
    assert repo.description in exc.value.message
    assert exc.value.code is ErrorCode.DATA_LOSS
    assert list(dest_parent.iterdir()) == []  # no target, no staging leftovers
    with pytest.raises(BlobCorrupted):
        repo.store.get(digest)  # the store itself never hands out the bad bytes


async def test_corrupt_manifest_is_detected(repo: Repository, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d/f").write_text("hello")
    await repo.push("snap-m", src)
    raw = repo.store.get_meta("manifests/snap-m.json")
    assert raw is not None
    repo.store.put_meta("manifests/snap-m.json", raw.replace(b'"mode":420', b'"mode":511'))
    with pytest.raises(BlobCorrupted, match="manifest of snapshot snap-m"):
        await repo.pull("snap-m", tmp_path / "out")
    assert not (tmp_path / "out").exists()


async def test_push_that_dies_before_manifest_leaves_no_snapshot(
        repo: Repository, tmp_path: Path) -> None:
    src = tmp_path / "src"
    build_tree(src)

    def die(done: int, total: int) -> None:
        if done > 2 * MiB:
            raise RuntimeError("simulated crash mid-push")

    with pytest.raises(RuntimeError, match="simulated crash"):
        await repo.push("snap-crash", src, progress=die)
    assert not await repo.exists("snap-crash")
    assert "snap-crash" not in await repo.list()
    assert repo.store.list_meta("pending") == []  # the push marker is gone too
    orphans = set(repo.store.list())
    assert orphans  # some chunks did make it
    gc = await repo.gc()
    assert gc.skipped is None and gc.blobs_deleted == len(orphans)
    assert list(repo.store.list()) == []
    # the same id can be pushed for real afterwards
    await repo.push("snap-crash", src)
    await repo.pull("snap-crash", tmp_path / "out")
    assert tree_signature(tmp_path / "out") == tree_signature(src)


async def test_delete_and_gc_keep_shared_chunks(repo: Repository, tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    write_random(a / "shared", 2 * MiB, seed=1)
    write_random(a / "only-a", 1 * MiB, seed=2)
    write_random(b / "shared", 2 * MiB, seed=1)
    write_random(b / "only-b", 1 * MiB, seed=3)
    await asyncio.gather(repo.push("gc-a", a), repo.push("gc-b", b))  # concurrent, different ids
    before = set(repo.store.list())
    only_a = (await repo.manifest("gc-a")).digests() - (await repo.manifest("gc-b")).digests()
    # gc refuses to delete while a push is in flight (its marker is fresh)
    repo.store.put_meta("pending/other-push.x", b"{}")
    await repo.delete("gc-a")
    skipped = await repo.gc()
    assert skipped.skipped and skipped.blobs_deleted == 0
    repo.store.delete_meta("pending/other-push.x")
    stats = await repo.gc()
    assert stats.blobs_deleted == len(only_a) > 0
    assert set(repo.store.list()) == before - only_a
    assert await repo.list() == ["gc-b"]
    await repo.pull("gc-b", tmp_path / "out")
    assert tree_signature(tmp_path / "out") == tree_signature(b)
    with pytest.raises(AenvError) as exc:
        await repo.delete("gc-a")
    assert exc.value.code is ErrorCode.NOT_FOUND


async def test_gc_removes_the_markers_of_pushes_that_died(repo: Repository) -> None:
    """A push killed with its server (kill -9) leaves `pending/<id>.<token>` behind: past its
    time gc neither waits for it nor keeps it (it used to stay for good)."""
    repo.store.put_meta("pending/died.x", b"{}")
    repo.store.put_meta("pending/running.y", b"{}")
    repo.marker_ttl_s = 3600
    old = time.time() - 7200
    marker = next(m for m in repo.store.list_meta("pending") if m.name.endswith("died.x"))
    path = getattr(repo.store, "_meta", None)
    if path is None:
        pytest.skip("this backend cannot age a marker")  # S3 has no settable mtime
    os.utime(path / marker.name, (old, old))
    stats = await repo.gc()
    assert stats.stale_markers == 1 and stats.skipped  # the fresh one still holds gc off
    assert [m.name for m in repo.store.list_meta("pending")] == [
        m.name for m in repo.store.list_meta("pending") if m.name.endswith("running.y")]
    repo.store.delete_meta(next(m.name for m in repo.store.list_meta("pending")))
    assert not (await repo.gc()).skipped


async def test_gc_is_not_held_off_by_a_push_whose_server_died(repo: Repository) -> None:
    """After a `kill -9` in the middle of a push its marker stays; a restarted server redoes
    the push under a new marker, so the old one used to hold gc off for 6 h. A marker names
    its writer: one whose process is gone (this host, this boot) goes at once."""
    import json
    import subprocess
    import sys

    from aenv.storage.repository import repository as repo_module

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])  # noqa: ASYNC220
    owner = {**repo_module.marker_owner(), "pid": child.pid,
             "start": repo_module._start_time(child.pid)}
    repo.store.put_meta("pending/died-with-its-server.x",
                        json.dumps({"at": time.time(), "owner": owner}).encode())
    held = await repo.gc()
    assert held.skipped and held.stale_markers == 0  # its writer still runs: a real push
    child.kill()
    child.wait()
    stats = await repo.gc()
    assert not stats.skipped and stats.stale_markers == 1
    assert repo.store.list_meta("pending") == []
    # A marker of a live push of ours (this process) still holds gc off.
    repo.store.put_meta("pending/live.y", json.dumps(
        {"at": time.time(), "owner": repo_module.marker_owner()}).encode())
    assert (await repo.gc()).skipped
    repo.store.delete_meta("pending/live.y")


async def test_bad_ids_and_unsafe_manifest_paths(repo: Repository, tmp_path: Path) -> None:
    for bad in ("../x", "a/b", "", ".hidden", "x" * 200):
        with pytest.raises(AenvError) as exc:
            await repo.push(bad, tmp_path)
        assert exc.value.code is ErrorCode.INVALID_ARGUMENT


def test_blob_store_rejects_mislabelled_content(store: BlobStore) -> None:
    with pytest.raises(AenvError, match="does not hash"):
        store.put("0" * 64, b"not zeros")
    with pytest.raises(AenvError) as exc:
        store.get("1" * 64)
    assert exc.value.code is ErrorCode.NOT_FOUND


class FlakyStore(PosixBlobStore):
    """A posix store whose 5th chunk write fails, like a full disk or a dropped connection."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.puts = 0

    def _raw_put(self, digest: str, stored: bytes) -> None:
        self.puts += 1
        if self.puts == 5:
            raise AenvError(ErrorCode.UNAVAILABLE, "disk on fire")
        super()._raw_put(digest, stored)


async def test_failed_chunk_upload_fails_the_push_cleanly(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    write_random(src / "pages-1.img", 8 * MiB, seed=5)
    store = FlakyStore(tmp_path / "repo")
    repo = Repository(store, concurrency=4)
    try:
        with pytest.raises(AenvError, match="disk on fire"):
            await repo.push("snap-f", src)
        assert not await repo.exists("snap-f")
        assert store.list_meta("pending") == []
        settled = store.puts
        await asyncio.sleep(0.2)
        assert store.puts == settled  # no writer thread outlived the failed push
        assert list((tmp_path / "repo/tmp").iterdir()) == []
    finally:
        repo.close()
