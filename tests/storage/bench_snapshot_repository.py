"""Chunking and throughput measurements for docs/operations.md (not part of the test suite).

Run: .venv/bin/python tests/storage/bench_snapshot_repository.py [--s3]
Pushes 64 MiB of random "page images" (A), then B = A with 12 KiB rewritten, 8 KiB inserted
mid-file and a new 3 KB file, for several chunking settings; prints dedup and throughput.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
import tempfile
from pathlib import Path

from snapshot_helpers import write_random
from test_snapshot_repository import change_a_little

from aenv.storage.repository import Chunking, PosixBlobStore, Repository
from aenv.storage.repository.blobstore import BlobStore

KiB, MiB = 1024, 1 << 20
SETTINGS = {
    "fixed 64 KiB": Chunking(min_size=64 * KiB, avg_bits=0, max_size=64 * KiB),
    "fixed 1 MiB": Chunking(min_size=MiB, avg_bits=0, max_size=MiB),
    "cdc ~96 KiB (32K min, 1/16)": Chunking(min_size=32 * KiB, avg_bits=4, max_size=512 * KiB),
    "cdc ~192 KiB (default)": Chunking(),
    "cdc ~576 KiB (320K min, 1/64)": Chunking(min_size=320 * KiB, avg_bits=6, max_size=2 * MiB),
}


async def run(store_factory: object, tmp: Path) -> None:
    a = tmp / "a"
    a.mkdir()
    for i in range(4):
        write_random(a / f"pages-{i}.img", 16 * MiB, seed=100 + i)
    b = tmp / "b"
    shutil.copytree(a, b)
    change_a_little(b)
    for name, params in SETTINGS.items():
        store: BlobStore = store_factory(name)  # type: ignore[operator]
        repo = Repository(store, chunking=params)
        sa = await repo.push("a", a)
        sb = await repo.push("b", b, parent_id="a")
        out = tmp / f"out-{abs(hash(name))}"
        pb = await repo.pull("b", out)
        shutil.rmtree(out)
        print(f"{name:32s} chunks {sa.chunks_total:5d}  B uploads {sb.bytes_uploaded / KiB:7.0f} KiB "
              f"({sb.bytes_uploaded / sb.bytes_total:6.2%})  push A {sa.bytes_total / MiB / sa.seconds:6.0f} MiB/s"
              f"  pull B {pb.bytes_total / MiB / pb.seconds:6.0f} MiB/s")
        repo.close()


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if "--s3" in sys.argv:
            import os
            import secrets

            from moto.server import ThreadedMotoServer

            from aenv.storage.repository.s3 import S3BlobStore

            os.environ.update(AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="x")
            server = ThreadedMotoServer(ip_address="127.0.0.1", port=5399, verbose=False)
            server.start()
            import boto3

            boto3.client("s3", endpoint_url="http://127.0.0.1:5399", region_name="us-east-1").create_bucket(
                Bucket="bench")

            def factory(name: str) -> BlobStore:
                return S3BlobStore("http://127.0.0.1:5399", "bench", secrets.token_hex(4), "us-east-1")

            asyncio.run(run(factory, tmp))
            server.stop()
        else:
            asyncio.run(run(lambda name: PosixBlobStore(tmp / f"repo-{abs(hash(name))}"), tmp))


if __name__ == "__main__":
    main()
