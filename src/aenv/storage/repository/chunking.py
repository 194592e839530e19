"""Splitting files into content-defined, page-aligned chunks for deduplication.

Owns: where chunk boundaries fall. Must not touch: storage or hashing policy beyond naming
each chunk by its sha256.

Why page-aligned content-defined chunking rather than fixed-size chunks: CRIU `pages-*.img`
hold the dumped pages back to back in pagemap order. When a process maps or touches new
memory between two snapshots, every later page shifts by a multiple of 4 KiB, so fixed 1 MiB
chunks would all change after the insertion point. Here a boundary may only fall after a
4 KiB page, and falls after a page whose crc32 matches a mask, so boundaries move with the
content and re-synchronise right after an insertion. No soft-dirty tracking is needed.
All-zero pages never cut (else runs of zero pages would make 4 KiB chunks); `max_size`
bounds chunks, and runs of zeros dedup to one blob per distinct length anyway.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

KiB = 1024
MiB = 1024 * KiB
PAGE = 4096
_ZERO_PAGE = bytes(PAGE)
_READ = 8 * MiB  # read-ahead window; bounds memory per file being chunked


@dataclass(frozen=True)
class Chunking:
    min_size: int = 64 * KiB
    avg_bits: int = 5  # cut probability 1/2**avg_bits per page past min_size
    max_size: int = 1 * MiB

    @property
    def expected_size(self) -> int:
        return self.min_size + PAGE * (1 << self.avg_bits)

    def as_dict(self) -> dict[str, int]:
        return {"page": PAGE, "min_size": self.min_size, "avg_bits": self.avg_bits,
                "max_size": self.max_size}


DEFAULT_CHUNKING = Chunking()  # ~192 KiB average: see docs/operations.md for the measurements


def _cut_points(buf: memoryview, params: Chunking, final: bool) -> list[int]:
    """End offsets of complete chunks in `buf`. Without `final`, the tail is left for later."""
    mask = (1 << params.avg_bits) - 1
    cuts: list[int] = []
    start = 0
    n = len(buf)
    while True:
        pos = start + params.min_size
        limit = start + params.max_size
        cut = -1
        while pos < min(limit, n):
            page = buf[pos:pos + PAGE]
            pos += len(page)
            if (zlib.crc32(page) & mask) == 0 and page != _ZERO_PAGE:
                cut = pos
                break
        if cut < 0:
            if limit <= n:
                cut = limit
            elif final and start < n:
                cut = n
            else:
                return cuts
        cuts.append(cut)
        start = cut
        if start >= n:
            return cuts


def iter_chunks(f: BinaryIO, params: Chunking = DEFAULT_CHUNKING) -> Iterator[tuple[str, bytes]]:
    """Yield (sha256 hex, bytes) for consecutive chunks of the open file."""
    pending = b""
    eof = False
    while not eof:
        block = f.read(_READ)
        eof = len(block) < _READ
        buf = pending + block if pending else block
        view = memoryview(buf)
        start = 0
        for cut in _cut_points(view, params, final=eof):
            data = bytes(view[start:cut])
            yield hashlib.sha256(data).hexdigest(), data
            start = cut
        pending = bytes(view[start:])
        view.release()
    if pending:  # only reachable if the last read was exactly _READ bytes and nothing followed
        yield hashlib.sha256(pending).hexdigest(), pending
