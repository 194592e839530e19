"""Chunk boundaries: deterministic, bounded, and re-synchronised after page insertions."""

from __future__ import annotations

import io
import random

from aenv.storage.repository.chunking import DEFAULT_CHUNKING, PAGE, Chunking, iter_chunks

MiB = 1 << 20


def chunks(data: bytes, params: Chunking = DEFAULT_CHUNKING) -> list[tuple[str, bytes]]:
    return list(iter_chunks(io.BytesIO(data), params))


def test_chunks_cover_the_file_within_bounds() -> None:
    data = random.Random(1).randbytes(20 * MiB + 777)
    out = chunks(data)
    assert b"".join(c for _, c in out) == data
    sizes = [len(c) for _, c in out]
    p = DEFAULT_CHUNKING
    assert all(p.min_size <= s <= p.max_size for s in sizes[:-1])
    assert all(s % PAGE == 0 for s in sizes[:-1])  # boundaries only between pages
    assert 0.5 * p.expected_size < len(data) / len(sizes) < 2 * p.expected_size
    assert chunks(b"") == []
    assert [len(c) for _, c in chunks(b"x")] == [1]


def test_page_insertion_resynchronises() -> None:
    rnd = random.Random(2)
    data = rnd.randbytes(16 * MiB)
    shifted = data[: 5 * MiB] + rnd.randbytes(3 * PAGE) + data[5 * MiB:]
    a = {d for d, _ in chunks(data)}
    b = chunks(shifted)
    new = sum(len(c) for d, c in b if d not in a)
    assert new <= 2 * DEFAULT_CHUNKING.max_size  # only the chunk(s) around the insertion


def test_zero_runs_do_not_make_tiny_chunks() -> None:
    out = chunks(bytes(8 * MiB))
    assert [len(c) for _, c in out] == [DEFAULT_CHUNKING.max_size] * 8
    assert len({d for d, _ in out}) == 1
