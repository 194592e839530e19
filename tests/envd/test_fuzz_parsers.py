"""Fuzz of envd's parsers (hypothesis), in two layers:

- each parser as a function, in this process: the HTTP/1.1 request parser (`envd/http.py`,
  driven through its asyncio Protocol on a fake transport), query and header-parameter
  decoding, byte ranges, Content-Disposition, the multipart/form-data parser and the gzip
  source of `/files` (`envd/files.py`), Connect envelopes and headers on both sides
  (`envd/connect.py`, `aenv/connect_frames.py`), paths, metadata and proto3 JSON fields
  (`envd/entries.py`, `envd/proto.py`). Valid inputs must round-trip; any input must end in a
  value or in the parser's own error (a 4xx), never in another exception or a hang.
- a real envd process over a loopback socket, fed malformed HTTP, Connect and multipart
  requests: every request is answered (or, when its framing is cut short, the connection is
  closed), no answer is a 5xx (except the 501s that HTTP and Connect prescribe for
  "not implemented": an unknown transfer coding, Connect `unimplemented`), a connection whose
  request was well framed still serves the next request, and envd stays healthy (no
  traceback in its log, no file descriptor leaked).

Bounded: each fuzzer runs a fixed number of examples. The default is the CI profile (about a
minute and a half here for the whole module, in `make test`); the `long` profile runs 20 times
as many and only when asked for (`AENV_FUZZ_LONG=1`, `make fuzz-long`). `AENV_FUZZ_EXAMPLES=N` sets every fuzzer's count instead. A summary (examples, time)
is printed at the end and appended as JSON lines to `$AENV_FUZZ_REPORT` when that is set.

Each bug the fuzz found has its failing input pinned as a regression test at the bottom.
Nothing here sends traffic anywhere but 127.0.0.1. Paths written by the socket fuzz stay under
a directory of the test user's that is removed afterwards; commands are only `true`/`echo`.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import itertools
import json
import os
import pwd
import re
import shutil
import socket
import string
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import pytest
from envd_helpers import TEST_USER, Envd, start_envd
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from aenv import connect_frames
from aenv.envd import connect, entries, files, http, proto
from aenv.envd.errors import RpcError
from aenv.envd.users import User

# ----------------------------------------------------------------------------- budgets

LONG_FACTOR = 20
REPORT: list[dict[str, Any]] = []


def budget(profile: str, ci: int) -> int:
    override = os.environ.get("AENV_FUZZ_EXAMPLES")
    if override:
        return max(1, int(override))
    return ci * (LONG_FACTOR if profile == "long" else 1)


# The long profile (20x the examples, ~30 min here) is the recorded run of docs/reliability.md,
# not part of `make test`: `AENV_FUZZ_LONG=1` (`make fuzz-long`) adds it.
PROFILES = [pytest.param("ci")] + ([pytest.param("long", marks=pytest.mark.slow)]
                                   if os.environ.get("AENV_FUZZ_LONG") == "1" else [])


def run_fuzz(name: str, profile: str, examples: int, strategy: st.SearchStrategy[Any],
             check: Callable[[Any], None]) -> None:
    """Run `check` over `examples` inputs drawn from `strategy`; record the numbers."""
    count = [0]

    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def one(value: Any) -> None:
        count[0] += 1
        check(value)

    started = time.monotonic()
    try:
        one()
    finally:
        entry = {"fuzzer": name, "profile": profile, "examples": count[0],
                 "seconds": round(time.monotonic() - started, 2)}
        REPORT.append(entry)


@pytest.fixture(scope="module", autouse=True)
def fuzz_report() -> Iterator[None]:
    yield
    if not REPORT:
        return
    total = sum(e["examples"] for e in REPORT)
    seconds = sum(e["seconds"] for e in REPORT)
    print(f"\nenvd parser fuzz: {total} examples in {seconds:.1f} s")
    for e in REPORT:
        print(f"  {e['fuzzer']:<28} {e['profile']:<5} {e['examples']:>7} examples {e['seconds']:>7.1f} s")
    path = os.environ.get("AENV_FUZZ_REPORT")
    if path:
        with open(path, "a") as f:
            for e in REPORT:
                f.write(json.dumps(e) + "\n")
    REPORT.clear()


# ----------------------------------------------------------------------------- strategies

LATIN1 = st.characters(min_codepoint=0, max_codepoint=255)
SPECIAL_VALUES = ["", " ", "0", "-1", "+5", "1_0", "0x10", "9" * 30, "9" * 5000, "1" + "0" * 400,
                  "\xb2", "\xb9", " 5", "5 ", "\x00", "chunked", "gzip", "identity", "close",
                  "keep-alive", "100-continue", "Basic", "Basic \xe9", "Basic AAAA", "bytes=0-",
                  "bytes=-0", "bytes=5-1", "bytes=0-0,1-1", "NaN", "inf", "1e999", "\r", "\n"]
HEADER_VALUE = st.one_of(st.text(LATIN1, max_size=40), st.sampled_from(SPECIAL_VALUES),
                         st.lists(st.sampled_from(SPECIAL_VALUES), max_size=4).map("".join))
PATH_PIECES = ["\x00", "\ud800", "\udcff", "~", "~root", "..", ".", "//", "\n", " ", "%", "é",
               "\U0001f600", "a" * 300]
PATH_TEXT = st.one_of(
    st.text(max_size=30),
    st.lists(st.one_of(st.sampled_from(PATH_PIECES), st.text(max_size=5)), max_size=6).map("".join),
    st.text(st.characters(codec="utf-8"), max_size=20))
JSON_SCALAR = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(min_value=-(10**40),
                        max_value=10**40), st.floats(allow_nan=False), st.text(max_size=20), PATH_TEXT)
JSON = st.recursive(JSON_SCALAR, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=10), inner, max_size=4), max_leaves=20)
# Without lone surrogates: JSON itself joins an escaped pair into one character, so only
# these survive a round trip unchanged.
CLEAN_TEXT = st.text(st.characters(codec="utf-8"), max_size=20)
CLEAN_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | CLEAN_TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(CLEAN_TEXT, inner, max_size=4),
    max_leaves=20)


def deep_json(depth: int, opener: str = "[") -> str:
    closer = {"[": "]", "{": "}"}[opener]
    if opener == "{":
        return '{"a":' * depth + "1" + "}" * depth
    return opener * depth + closer * depth


RAW_JSON = st.one_of(
    JSON.map(lambda v: json.dumps(v).encode("utf-8", "surrogatepass")),
    st.binary(max_size=64),
    st.sampled_from([b"", b"{", b"null", b"[]", b'"x"', b"1", b"{}", b'{"a":1}' * 2, b"NaN",
                     ("1" * 5000).encode(), b"\xff\xfe{\x00}\x00"]),
    st.integers(1, 200_000).map(lambda n: deep_json(n).encode()),
    st.integers(1, 200_000).map(lambda n: deep_json(n, "{").encode()),
)


def chunked_split(data: bytes, cuts: list[int]) -> list[bytes]:
    """`data` split at the given offsets (taken modulo its length)."""
    if not data:
        return [data]
    points = sorted({c % len(data) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


CUTS = st.lists(st.integers(0, 1 << 20), max_size=8)


@st.composite
def mutated(draw: st.DrawFn, base: bytes) -> bytes:
    """`base` with a few byte-level mutations: flips, insertions of protocol tokens,
    deletions, duplications, truncation."""
    data = bytearray(base)
    tokens = [b"\r\n", b"\r\n\r\n", b":", b" ", b"\x00", b"\n", b"0\r\n\r\n", b"--", b";",
              b"Transfer-Encoding: chunked\r\n", b"Content-Length: 99999999999\r\n",
              b"Content-Length: -1\r\n", b"Expect: 100-continue\r\n", b"\xff", b"\"", b"=",
              b"ffffffffffffffff\r\n", b"9" * 40]
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "insert", "delete", "dup", "truncate"]))
        pos = draw(st.integers(0, max(0, len(data))))
        if op == "flip" and data:
            i = pos % len(data)
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "insert":
            data[pos:pos] = draw(st.sampled_from(tokens) | st.binary(max_size=8))
        elif op == "delete" and data:
            del data[pos:pos + draw(st.integers(1, 16))]
        elif op == "dup" and data:
            data[pos:pos] = data[pos:pos + draw(st.integers(1, 32))]
        elif op == "truncate":
            del data[pos:]
    return bytes(data)


# ----------------------------------------------------------------------------- in-process HTTP


class FakeTransport(asyncio.Transport):
    """What `http.Connection` writes, kept in memory; closing calls connection_lost."""

    def __init__(self, protocol: http.Connection) -> None:
        super().__init__()
        self.protocol = protocol
        self.out = bytearray()
        self.closing = False
        self.aborted = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        assert not self.closing, "write after close"
        self.out += data

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        if not self.closing:
            self.closing = True
            asyncio.get_running_loop().call_soon(self.protocol.connection_lost, None)

    def abort(self) -> None:
        self.aborted = True
        self.close()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


@dataclass
class Seen:
    method: str
    path: str
    query: dict[str, str]
    body: bytes


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


@pytest.fixture
def logged(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Exceptions envd logs as bugs (`log_exception`): the fuzz's 'crash'."""
    seen: list[str] = []

    def record(what: str, error: BaseException) -> None:
        seen.append(f"{what}: {type(error).__name__}: {error}")

    for module in (http, connect):
        monkeypatch.setattr(module, "log_exception", record)
    return seen


def serve_bytes(loop: asyncio.AbstractEventLoop, chunks: list[bytes],
                handler: http.Handler | None = None) -> tuple[bytes, list[Seen], FakeTransport]:
    """Feed `chunks` then EOF to a Connection; its output once it has finished."""
    seen: list[Seen] = []

    async def echo(request: http.Request, response: http.Response) -> None:
        body = await request.body.read_all(1 << 20)
        seen.append(Seen(request.method, request.path, request.query, body))
        await response.send_json(200, {"n": len(body)})

    async def run() -> FakeTransport:
        conn = http.Connection(handler or echo)
        transport = FakeTransport(conn)
        conn.connection_made(transport)
        for chunk in chunks:
            conn.data_received(chunk)
            await asyncio.sleep(0)
        conn.eof_received()
        assert conn._task is not None
        await asyncio.wait_for(conn._task, 5)
        return transport

    transport = loop.run_until_complete(run())
    return bytes(transport.out), seen, transport


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes


class Incomplete(Exception):
    pass


def parse_answers(data: bytes, methods: list[str] | None = None, limit: int = 16) -> list[Answer]:
    """The responses in `data` (1xx interim answers skipped); raises if `data` is not a
    sequence of whole, well-formed responses."""
    out: list[Answer] = []
    methods = list(methods or [])
    while data and len(out) < limit:
        end = data.find(b"\r\n\r\n")
        if end < 0:
            raise Incomplete(f"no end of head in {data[:200]!r}")
        lines = data[:end].decode("latin-1").split("\r\n")
        match = re.fullmatch(r"HTTP/1\.1 (\d{3}) [^\r\n]*", lines[0])
        assert match, f"bad status line {lines[0]!r}"
        status = int(match.group(1))
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            assert sep and name and name == name.strip(), f"bad header {line!r}"
            headers[name.lower()] = value.strip()
        data = data[end + 4:]
        if 100 <= status < 200:
            continue
        method = methods.pop(0) if methods else "GET"
        body = b""
        if status in (204, 304) or method == "HEAD":
            pass
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                line_end = data.find(b"\r\n")
                if line_end < 0:
                    raise Incomplete("chunk size line")
                size = int(data[:line_end], 16)
                data = data[line_end + 2:]
                if size == 0:
                    if not data.startswith(b"\r\n"):
                        raise Incomplete("last chunk")
                    data = data[2:]
                    break
                if len(data) < size + 2:
                    raise Incomplete("chunk")
                assert data[size:size + 2] == b"\r\n"
                body += data[:size]
                data = data[size + 2:]
        else:
            length = int(headers.get("content-length", "0"))
            if len(data) < length:
                raise Incomplete("body")
            body, data = data[:length], data[length:]
        out.append(Answer(status, headers, body))
    return out


@st.composite
def valid_requests(draw: st.DrawFn) -> tuple[bytes, list[Seen]]:
    """1-3 pipelined well-formed requests, and what a handler must see of each."""
    raw = bytearray()
    expected: list[Seen] = []
    for _ in range(draw(st.integers(1, 3))):
        method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE", "OPTIONS", "PATCH"]))
        path = "/" + quote(draw(st.text(max_size=12)), safe="/")
        query = draw(st.dictionaries(st.text(max_size=8), st.text(max_size=12), max_size=3))
        target = path + ("?" + urlencode(query) if query else "")
        framing = draw(st.sampled_from(["length", "chunked", "none"]))
        body = b"" if framing == "none" else draw(st.binary(max_size=300))
        headers = [("Host", "x")]
        headers += draw(st.lists(st.tuples(st.sampled_from(["X-A", "Accept", "X-Metadata-k"]),
                                           st.text(LATIN1.filter(lambda c: c not in "\r\n\x00"),
                                                   max_size=10)), max_size=3))
        encoded = body
        if framing == "length":
            headers.append(("Content-Length", str(len(body))))
        elif framing == "chunked":
            headers.append(("Transfer-Encoding", "chunked"))
            pieces = chunked_split(body, draw(CUTS)) if body else []
            ext = draw(st.sampled_from(["", ";a=b", "; x"]))
            encoded = b"".join(b"%x%s\r\n%s\r\n" % (len(p), ext.encode(), p) for p in pieces if p)
            encoded += b"0\r\n" + draw(st.sampled_from([b"", b"X-Trailer: 1\r\n"])) + b"\r\n"
        head = f"{method} {target} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers)
        raw += head.encode("latin-1") + b"\r\n" + encoded
        expected.append(Seen(method, path, query, body))
    return bytes(raw), expected


@pytest.mark.parametrize("profile", PROFILES)
def test_http_valid_requests_round_trip(profile: str, loop: asyncio.AbstractEventLoop,
                                        logged: list[str]) -> None:
    def check(case: tuple[tuple[bytes, list[Seen]], list[int]]) -> None:
        (raw, expected), cuts = case
        out, seen, _ = serve_bytes(loop, chunked_split(raw, cuts))
        assert not logged, logged
        # envd routes on the raw path (percent-escapes kept, as Go's mux does)
        assert [(s.method, s.path, s.query, s.body) for s in seen] == \
               [(e.method, e.path, e.query, e.body) for e in expected]
        answers = parse_answers(out)
        assert [a.status for a in answers] == [200] * len(expected)

    run_fuzz("http round trip", profile, budget(profile, 400),
             st.tuples(valid_requests(), CUTS), check)


@st.composite
def malformed_requests(draw: st.DrawFn) -> bytes:
    raw, _ = draw(valid_requests())
    head_fuzz = draw(st.lists(st.tuples(
        st.sampled_from(["Content-Length", "Transfer-Encoding", "Expect", "Connection", "Host",
                         "content-length", "X", " Bad", "Bad ", "", "A\x00"]),
        HEADER_VALUE), max_size=3))
    extra = "".join(f"{k}: {v}\r\n" for k, v in head_fuzz).encode("latin-1")
    first = raw.find(b"\r\n") + 2
    return draw(mutated(raw[:first] + extra + raw[first:]))


def check_malformed_answer(out: bytes, transport: FakeTransport, logged: list[str], raw: bytes) -> None:
    assert not logged, logged
    # the generated pipelines use no HEAD: only a first request can be one
    methods = ["HEAD"] if raw.lstrip(b"\r\n").startswith(b"HEAD ") else None
    try:
        answers = parse_answers(out, methods)
    except Incomplete:
        # A response cut short is only acceptable where the connection was aborted on purpose
        # (the client's body ended inside a chunk, after the answer had started).
        assert transport.aborted, out[-300:]
        answers = []
    for a in answers:
        assert a.status < 500 or (a.status == 501 and b"transfer-encoding" in a.body), \
            (a.status, a.body[:200])
        if a.status >= 400 and (a.body or not methods):  # an answer to HEAD has no body
            error = json.loads(a.body)
            assert error["code"] == a.status and isinstance(error["message"], str)


@pytest.mark.parametrize("profile", PROFILES)
def test_http_malformed_requests(profile: str, loop: asyncio.AbstractEventLoop,
                                 logged: list[str]) -> None:
    def check(case: tuple[bytes, list[int]]) -> None:
        raw, cuts = case
        out, _, transport = serve_bytes(loop, chunked_split(raw, cuts))
        check_malformed_answer(out, transport, logged, raw)

    run_fuzz("http malformed", profile, budget(profile, 1500),
             st.tuples(malformed_requests() | st.binary(max_size=200), CUTS), check)


def test_http_head_limit_and_leading_crlf(loop: asyncio.AbstractEventLoop, logged: list[str]) -> None:
    """Positive controls for the parser's edges: a head past MAX_HEAD is 431, leading empty
    line before a request is skipped (RFC 9112 2.2)."""
    out, _, _ = serve_bytes(loop, [b"GET / HTTP/1.1\r\nX: " + b"a" * (http.MAX_HEAD + 10)])
    assert [a.status for a in parse_answers(out)] == [431]
    out, seen, _ = serve_bytes(loop, [b"\r\nGET /x HTTP/1.1\r\n\r\n"])
    assert [s.path for s in seen] == ["/x"]
    assert not logged


# ----------------------------------------------------------------------------- query, headers


@pytest.mark.parametrize("profile", PROFILES)
def test_query_decoding(profile: str) -> None:
    def check(case: tuple[dict[str, str], str]) -> None:
        values, junk = case
        assert http.parse_query(urlencode(values)) == values
        http.parse_query(junk)
        decoded = http.unquote_plus(junk)
        decoded.encode("utf-8", "surrogateescape")  # always reaches the filesystem layer intact

    text = st.text(st.characters(codec="utf-8"), max_size=12)
    run_fuzz("query decoding", profile, budget(profile, 500),
             st.tuples(st.dictionaries(text, text, max_size=4), st.text(LATIN1, max_size=40)), check)


TOKEN = st.text(string.ascii_letters + string.digits + "-_.", min_size=1, max_size=10)


@pytest.mark.parametrize("profile", PROFILES)
def test_header_parameters(profile: str) -> None:
    def check(case: tuple[str, str, dict[str, str], int, str]) -> None:
        junk, media, params, size, name = case
        # any value: a pair, no exception
        main, parsed = files.parse_params(junk)
        assert isinstance(main, str) and all(isinstance(v, str) for v in parsed.values())
        assert files.accepts_gzip(junk) in (True, False, None)
        window = files.parse_range(junk, size)
        if isinstance(window, tuple):
            assert 0 <= window[0] < window[1] <= size
        # valid values round-trip
        header = media + "".join(f'; {k}="{v.replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
                                 for k, v in params.items())
        assert files.parse_params(header) == (media.lower(), {k.lower(): v for k, v in params.items()})
        disposition = files.content_disposition(name)
        disposition.encode("latin-1")
        assert "\r" not in disposition and "\n" not in disposition
        _, back = files.parse_params(disposition)
        assert back.get("filename") == name

    value = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=12)
    params = st.dictionaries(TOKEN.map(str.lower), value, max_size=3)
    run_fuzz("header parameters", profile, budget(profile, 600),
             st.tuples(HEADER_VALUE, TOKEN, params, st.integers(0, 1 << 40),
                       st.text(st.characters(codec="utf-8"), max_size=20)), check)


# ----------------------------------------------------------------------------- multipart, gzip


class ListSource:
    """Stands in for `files.Source`: the chunks, then b""."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = [c for c in chunks if c]

    async def read(self) -> bytes:
        return self.chunks.pop(0) if self.chunks else b""


BOUNDARY = st.text(string.ascii_letters + string.digits + "'()+_,-./:=?", min_size=1, max_size=70)


def multipart_body(boundary: str, parts: list[tuple[dict[str, str], bytes]], preamble: bytes = b"",
                   epilogue: bytes = b"") -> bytes:
    out = bytearray(preamble)
    for headers, data in parts:
        out += b"\r\n--" + boundary.encode() + b"\r\n" if out else b"--" + boundary.encode() + b"\r\n"
        for k, v in headers.items():
            out += f"{k}: {v}\r\n".encode("latin-1")
        out += b"\r\n" + data
    out += b"\r\n--" + boundary.encode() + b"--\r\n" + epilogue
    return bytes(out)


async def read_form(form: files.Multipart, max_parts: int = 64) -> list[tuple[dict[str, str], bytes]]:
    parts = []
    while (headers := await form.next_part()) is not None:
        data = bytearray()
        for _ in range(1 << 16):
            piece = await form.read()
            if not piece:
                break
            data += piece
        parts.append((headers, bytes(data)))
        assert len(parts) <= max_parts, "more parts than the body can hold"
    return parts


@pytest.mark.parametrize("profile", PROFILES)
def test_multipart_round_trip(profile: str, loop: asyncio.AbstractEventLoop) -> None:
    def check(case: tuple[str, list[tuple[str, bytes]], list[int]]) -> None:
        boundary, items, cuts = case
        delimiter = b"\r\n--" + boundary.encode()
        assume(all(delimiter not in b"\r\n" + data for _, data in items))
        parts = [({"content-disposition": f'form-data; name="file"; filename="{name}"'}, data)
                 for name, data in items]
        body = multipart_body(boundary, parts)
        form = files.Multipart(ListSource(chunked_split(body, cuts)), boundary)  # type: ignore[arg-type]
        got = loop.run_until_complete(read_form(form))
        assert got == parts

    names = st.text(string.ascii_letters + string.digits + "/._-", min_size=1, max_size=20)
    data = st.binary(max_size=200) | st.sampled_from([b"--", b"\r\n--", b"\r\n-", b"\r\n\r\n"])
    run_fuzz("multipart round trip", profile, budget(profile, 400),
             st.tuples(BOUNDARY, st.lists(st.tuples(names, data), max_size=4), CUTS), check)


@pytest.mark.parametrize("profile", PROFILES)
def test_multipart_malformed(profile: str, loop: asyncio.AbstractEventLoop) -> None:
    def check(case: tuple[str, bytes, list[int]]) -> None:
        boundary, body, cuts = case
        form = files.Multipart(ListSource(chunked_split(body, cuts)), boundary)  # type: ignore[arg-type]
        try:
            loop.run_until_complete(asyncio.wait_for(read_form(form), 5))
        except files.FileError as e:
            assert 400 <= e.status < 500, e

    @st.composite
    def bodies(draw: st.DrawFn) -> tuple[str, bytes, list[int]]:
        boundary = draw(BOUNDARY)
        parts = [({"Content-Disposition": 'form-data; name="file"; filename="f"'}, draw(st.binary(max_size=50)))
                 for _ in range(draw(st.integers(0, 3)))]
        body = draw(mutated(multipart_body(boundary, parts)) | st.binary(max_size=100))
        return boundary, body, draw(CUTS)

    run_fuzz("multipart malformed", profile, budget(profile, 800), bodies(), check)


class ListBody:
    """Stands in for `http.Body` under `files.Source`."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = [c for c in chunks if c]

    async def read(self, limit: int = 65536) -> bytes:
        return self.chunks.pop(0) if self.chunks else b""

    async def discard(self, limit: int = 1 << 20) -> bool:
        self.chunks.clear()
        return True


@pytest.mark.parametrize("profile", PROFILES)
def test_gzip_source(profile: str, loop: asyncio.AbstractEventLoop) -> None:
    async def drain(source: files.Source) -> bytes:
        out = bytearray()
        for _ in range(1 << 16):
            piece = await source.read()
            if not piece:
                return bytes(out)
            out += piece
        raise AssertionError("the source never ended")

    def check(case: tuple[bytes, bool, int, list[int]]) -> None:
        data, corrupt, where, cuts = case
        packed = bytearray(gzip.compress(data))
        if corrupt:
            packed[where % len(packed)] ^= 0xFF
        source = files.Source(ListBody(chunked_split(bytes(packed), cuts)), True)  # type: ignore[arg-type]
        try:
            out = loop.run_until_complete(drain(source))
        except files.FileError as e:
            assert corrupt and e.status == 400
            return
        if not corrupt:
            assert out == data

    run_fuzz("gzip source", profile, budget(profile, 200),
             st.tuples(st.binary(max_size=2000), st.booleans(), st.integers(0, 1 << 16), CUTS), check)


# ----------------------------------------------------------------------------- Connect

RPC_ERROR_4XX = {"invalid_argument", "not_found", "already_exists", "permission_denied",
                 "resource_exhausted", "failed_precondition", "aborted", "out_of_range",
                 "unauthenticated", "canceled"}


def connection_over(loop: asyncio.AbstractEventLoop, chunks: list[bytes]) -> http.Connection:
    async def make() -> http.Connection:
        async def never(request: http.Request, response: http.Response) -> None:
            raise AssertionError("not used")

        conn = http.Connection(never)
        conn.transport = FakeTransport(conn)
        for chunk in chunks:
            conn.data_received(chunk)
        conn.eof_received()
        return conn

    return loop.run_until_complete(make())


async def read_all_envelopes(body: http.Body) -> list[proto.Msg]:
    out = []
    async for message in connect.read_envelopes(body):
        out.append(message)
        assert len(out) < 1000
    return out


@pytest.mark.parametrize("profile", PROFILES)
def test_connect_envelopes_round_trip(profile: str, loop: asyncio.AbstractEventLoop) -> None:
    def check(case: tuple[list[dict[str, Any]], bool, list[int]]) -> None:
        messages, end, cuts = case
        data = b"".join(connect.envelope(0, m) for m in messages)
        if end:
            data += connect.envelope(2, {})
        conn = connection_over(loop, chunked_split(data, cuts))
        body = http.Body(conn, len(data), False, False)
        assert loop.run_until_complete(read_all_envelopes(body)) == messages
        # the host side (aenv.connect_frames) splits the same stream the same way
        frames = connect_frames.Frames()
        got = [m for chunk in chunked_split(data, cuts) for m in frames.feed(chunk)]
        assert got == [(False, m) for m in messages] + ([(True, {})] if end else [])
        assert frames.buf == b""
        assert json.loads(connect_frames.envelope(messages[0] if messages else {})[5:]) == \
               (messages[0] if messages else {})

    objects = st.dictionaries(CLEAN_TEXT, CLEAN_JSON, max_size=4)
    run_fuzz("connect round trip", profile, budget(profile, 400),
             st.tuples(st.lists(objects, max_size=4), st.booleans(), CUTS), check)


@st.composite
def envelope_streams(draw: st.DrawFn) -> bytes:
    out = bytearray()
    for _ in range(draw(st.integers(0, 3))):
        payload = draw(RAW_JSON)
        flags = draw(st.sampled_from([0, 0, 0, 1, 2, 3, 0x80, 0xFF]))
        length = draw(st.sampled_from([len(payload)] * 4 + [0, len(payload) + 1, max(0, len(payload) - 1),
                                       connect.MAX_MESSAGE + 1, 0xFFFFFFFF]))
        out += bytes([flags]) + length.to_bytes(4, "big") + payload
    return draw(mutated(bytes(out))) if draw(st.booleans()) else bytes(out)


@pytest.mark.parametrize("profile", PROFILES)
def test_connect_envelopes_malformed(profile: str, loop: asyncio.AbstractEventLoop) -> None:
    def check(case: tuple[bytes, list[int]]) -> None:
        data, cuts = case
        conn = connection_over(loop, chunked_split(data, cuts))
        body = http.Body(conn, len(data), False, False)
        try:
            messages = loop.run_until_complete(read_all_envelopes(body))
        except RpcError as e:
            assert e.code in RPC_ERROR_4XX, (e.code, e.message)
        except http.BadRequest as e:
            assert 400 <= e.status < 500
        else:
            assert all(isinstance(m, dict) for m in messages)
        frames = connect_frames.Frames()  # the host side: its own errors only
        try:
            for chunk in chunked_split(data, cuts):
                for _ in frames.feed(chunk):
                    pass
        except (ValueError, RecursionError):  # RecursionError: see the xfail regression below
            pass

    run_fuzz("connect malformed", profile, budget(profile, 800), st.tuples(envelope_streams(), CUTS), check)


@pytest.mark.parametrize("profile", PROFILES)
def test_connect_headers_and_messages(profile: str) -> None:
    def check(case: tuple[str, bytes]) -> None:
        value, payload = case
        for parse in (connect._parse_timeout, connect.basic_auth_username):
            try:
                parse(value)
            except RpcError as e:
                assert e.code in RPC_ERROR_4XX
        timeout = None
        try:
            timeout = connect._parse_timeout(value)
        except RpcError:
            pass
        assert timeout is None or 0 <= timeout < 1e8
        keepalive = connect._parse_keepalive(value)
        assert 0 < keepalive <= 24 * 3600
        try:
            message = connect.decode_message(payload)
        except RpcError as e:
            assert e.code == "invalid_argument"
        else:
            assert isinstance(message, dict)

    basic = st.text(max_size=20).map(
        lambda t: "Basic " + base64.b64encode(t.encode("utf-8", "surrogatepass")).decode())
    run_fuzz("connect headers, messages", profile, budget(profile, 600),
             st.tuples(HEADER_VALUE | basic, RAW_JSON), check)


# ----------------------------------------------------------------------------- paths, fields

USER = User("fuzz", 1000, 1000, "/home/fuzz", "/bin/sh", (1000,))


@pytest.mark.parametrize("profile", PROFILES)
def test_paths_and_fields(profile: str) -> None:
    def check(case: tuple[str, str | None, dict[str, str], Any]) -> None:
        raw, workdir, metadata, message = case
        try:
            path = entries.resolve_path(raw, USER, workdir)
        except RpcError as e:
            assert e.code == "invalid_argument"
        else:
            # absolute, clean, and something the kernel can be asked about
            assert path.startswith("/") and os.path.normpath(path) == path and "//" not in path
            assert ".." not in path.split("/")
            assert "\x00" not in path
            os.fsencode(path)
            base = entries.go_base(path)
            assert base == "/" or "/" not in base
        try:
            entries.validate_metadata(metadata)
        except RpcError as e:
            assert e.code == "invalid_argument"
        if isinstance(message, dict):
            for getter in (proto.get_str, proto.get_int, proto.get_bool, proto.get_bytes,
                           proto.get_msg, proto.get_str_map, proto.get_str_list, proto.get_opt_str):
                try:
                    getter(message, "a", "b")
                except RpcError as e:
                    assert e.code == "invalid_argument"
            try:
                proto.get_enum(message, "a", {"X": 1})
            except RpcError as e:
                assert e.code == "invalid_argument"

    workdirs = st.none() | st.sampled_from(["/work", "/", "/a/../b"])
    run_fuzz("paths and fields", profile, budget(profile, 1000),
             st.tuples(PATH_TEXT, workdirs, st.dictionaries(PATH_TEXT, PATH_TEXT, max_size=3),
                       st.dictionaries(st.sampled_from(["a", "b"]), JSON, max_size=2)), check)


def test_mode_and_timestamp_formats() -> None:
    """Output formatting over the whole input range (exhaustive where it is small)."""
    for mode in range(0, 0o200000, 7):
        text = entries.mode_string(mode)
        assert len(text) >= 10 and all(c in "rwx-" for c in text[-9:]), (mode, text)
    for ns in (0, 1, 999, 10**6, 10**9, 10**18, 2**62):
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{3}|\.\d{6}|\.\d{9})?Z",
                            proto.timestamp(ns))


# ----------------------------------------------------------------------------- a real envd

RPC_SAFE = ["/filesystem.Filesystem/Stat", "/filesystem.Filesystem/ListDir",
            "/filesystem.Filesystem/MakeDir", "/filesystem.Filesystem/GetWatcherEvents",
            "/filesystem.Filesystem/RemoveWatcher", "/process.Process/List",
            "/process.Process/SendInput", "/process.Process/SendSignal", "/process.Process/Update",
            "/process.Process/CloseStdin"]
RPC_FIELDS = ["path", "depth", "watcherId", "watcher_id", "process", "pid", "tag", "input", "stdin",
              "pty", "signal", "size", "cols", "rows", "cmd", "args", "envs", "cwd", "x"]
# Commands the fuzz may start: harmless whatever their arguments.
SAFE_CMDS = ["/bin/true", "true", "/bin/echo", "echo", "", "no-such-command-for-fuzz", "/no/such"]


@dataclass
class Target:
    envd: Envd
    fuzz_dir: str  # relative to the test user's home: where writes go
    counts: dict[str, int] = field(default_factory=dict)


@pytest.fixture(scope="module")
def target(test_user: pwd.struct_passwd, session_tmp: Path) -> Iterator[Target]:
    server = start_envd(session_tmp, extra=["--not-init"])
    rel = f"envd-fuzz-{uuid.uuid4().hex[:8]}"
    home = Path(test_user.pw_dir)
    try:
        yield Target(server, rel)
    finally:
        server.stop()
        shutil.rmtree(home / rel, ignore_errors=True)


def make_fuzz_dir(target: Target, test_user: pwd.struct_passwd) -> None:
    path = Path(test_user.pw_dir) / target.fuzz_dir
    path.mkdir(exist_ok=True)
    os.chown(path, test_user.pw_uid, test_user.pw_gid)


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def confined(text: str) -> str:
    """A fuzzed name that cannot climb out of the fuzz directory."""
    return text.replace("/", "_").replace("..", "_").lstrip("~") or "f"


@dataclass
class Case:
    raw: bytes
    complete: bool  # framed exactly: the connection must then serve the next request too
    method: str
    stream: bool = False
    timeout_sent: bool = False


def http_request(method: str, target: str, headers: list[tuple[str, str]], body: bytes,
                 framing: str = "length", cuts: list[int] | None = None) -> tuple[bytes, bool]:
    lines = [f"{method} {target} HTTP/1.1", "Host: 127.0.0.1"]
    lines += [f"{k}: {v}" for k, v in headers]
    complete = True
    if framing == "length":
        lines.append(f"Content-Length: {len(body)}")
        encoded = body
    elif framing == "chunked":
        lines.append("Transfer-Encoding: chunked")
        encoded = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in chunked_split(body, cuts or []) if p)
        encoded += b"0\r\n\r\n"
    elif framing == "short":  # declares more than it sends
        lines.append(f"Content-Length: {len(body) + 10}")
        encoded, complete = body, False
    else:  # a chunk cut short
        lines.append("Transfer-Encoding: chunked")
        encoded, complete = b"%x\r\n%s" % (len(body) + 5, body), False
    head = "\r\n".join(lines) + "\r\n\r\n"
    return head.encode("latin-1", "replace") + encoded, complete


FRAMING = st.sampled_from(["length", "length", "chunked", "chunked", "short", "cut"])


def fuzz_headers(token: str) -> st.SearchStrategy[list[tuple[str, str]]]:
    names = ["Connect-Timeout-Ms", "Keepalive-Ping-Interval", "Authorization", "Content-Encoding",
             "Connect-Content-Encoding", "Expect", "Connection", "Range", "Accept-Encoding",
             "X-Metadata-k", "X-Metadata-", "X-Access-Token", "Content-Type"]
    value = HEADER_VALUE.map(lambda v: v.replace("\r", "").replace("\n", ""))
    auth = st.sampled_from([("X-Access-Token", token)] * 6 + [("X-Access-Token", "wrong")])
    pair = st.tuples(st.sampled_from(names), value) | st.sampled_from(KNOWN_PAIRS)
    return st.tuples(st.lists(pair, max_size=3), auth).map(lambda t: [t[1], *t[0]])


# Header values with a meaning, which random text rarely hits.
KNOWN_PAIRS = [("Expect", "100-continue"), ("Connection", "close"), ("Connection", "keep-alive"),
               ("Content-Encoding", "gzip"), ("Content-Encoding", "br"),
               ("Connect-Content-Encoding", "gzip"), ("Accept-Encoding", "gzip"),
               ("Accept-Encoding", "identity;q=0"), ("Range", "bytes=0-0"), ("Range", "bytes=-1"),
               ("Connect-Timeout-Ms", "\xb2"), ("Connect-Timeout-Ms", "0"),
               ("Keepalive-Ping-Interval", "1" + "0" * 400), ("Authorization", "Basic \xe9"),
               ("Authorization", "Basic " + base64.b64encode(b"ghost").decode()),
               ("X-Metadata-k", "\x7f"), ("X-Metadata-" + "k" * 300, "v")]


def basic(user: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:".encode("utf-8", "surrogatepass")).decode()


USERS = st.sampled_from([TEST_USER, TEST_USER, "ghost", "", "a\x00b", "\ud800"]) | st.text(max_size=8).filter(
    lambda u: u != "root")


@st.composite
def connect_cases(draw: st.DrawFn, token: str, fuzz_dir: str) -> Case:
    headers = draw(fuzz_headers(token))
    if draw(st.booleans()):
        headers.append(("Authorization", basic(draw(USERS))))
    if draw(st.booleans()):
        path = draw(st.sampled_from(RPC_SAFE))
        fields = draw(st.dictionaries(st.sampled_from(RPC_FIELDS), JSON, max_size=4))
        if "path" in fields and path.endswith(("MakeDir", "ListDir")):
            fields["path"] = f"{fuzz_dir}/{confined(str(fields['path']))}"
        body = draw(st.sampled_from([json.dumps(fields).encode("utf-8", "surrogatepass")] * 3)
                    | RAW_JSON)
        ctype = draw(st.sampled_from(["application/json"] * 4 + ["application/connect+json", "text/plain",
                                                                  "application/json; charset=utf-8"]))
        headers.append(("Content-Type", ctype))
        raw, complete = http_request("POST", path, headers, body, draw(FRAMING), draw(CUTS))
        return Case(raw, complete, "POST")
    # the one streaming RPC that starts something: a harmless command
    process: dict[str, Any] = {"cmd": draw(st.sampled_from(SAFE_CMDS))}
    extra = draw(st.dictionaries(st.sampled_from(["args", "envs", "cwd"]), JSON, max_size=3))
    process.update(extra)
    # well-typed fields with hostile text (NUL, lone surrogates, '=' in names, ...)
    if draw(st.booleans()):
        process["args"] = draw(st.lists(PATH_TEXT, max_size=3))
    if draw(st.booleans()):
        process["envs"] = draw(st.dictionaries(PATH_TEXT, PATH_TEXT, max_size=2))
    if draw(st.integers(0, 4)) == 0:
        process["cmd"] = draw(st.sampled_from(SAFE_CMDS)) + draw(st.sampled_from(["\ud800", "\x00", "é"]))
    message: dict[str, Any] = {"process": process}
    message.update(draw(st.dictionaries(st.sampled_from(["tag", "stdin", "pty"]), JSON, max_size=2)))
    payload = json.dumps(message).encode("utf-8", "surrogatepass")
    flags = draw(st.sampled_from([0, 0, 0, 1, 2, 0x80]))
    length = draw(st.sampled_from([len(payload)] * 4 + [len(payload) + 3, 0]))
    env = bytes([flags]) + length.to_bytes(4, "big") + payload
    if draw(st.booleans()):
        env = draw(mutated(env))
    headers += [("Content-Type", draw(st.sampled_from(["application/connect+json"] * 5 + ["application/json"]))),
                ("Connect-Timeout-Ms", draw(st.sampled_from(["3000", "0", "1", "5000"])))]
    raw, complete = http_request("POST", "/process.Process/Start", headers, env, draw(FRAMING), draw(CUTS))
    return Case(raw, complete, "POST", stream=True, timeout_sent=True)


@st.composite
def files_cases(draw: st.DrawFn, token: str, fuzz_dir: str) -> Case:
    headers = draw(fuzz_headers(token))
    query: dict[str, str] = {}
    name = confined(draw(PATH_TEXT.map(lambda t: t.encode("utf-8", "surrogatepass").decode("utf-8", "replace"))))
    if draw(st.booleans()):
        query["path"] = f"{fuzz_dir}/{name}"
    if draw(st.booleans()):
        query["username"] = draw(USERS).encode("utf-8", "surrogatepass").decode("utf-8", "replace")
    for key in draw(st.lists(st.sampled_from(["signature", "signature_expiration"]), max_size=2)):
        query[key] = draw(st.sampled_from(["v1_x", "9" * 30, "-1", "x", "\u0663"]))
    target = "/files" + ("?" + urlencode(query) if query else "")
    if draw(st.booleans()):
        target += draw(st.sampled_from(["&path=%00", "&path=%ff", "&username=%00", "%", "&&=&"]))
    method = draw(st.sampled_from(["GET", "POST", "POST", "POST", "HEAD", "PUT"]))
    body = b""
    if method == "POST":
        kind = draw(st.sampled_from(["multipart", "multipart", "raw", "gzip", "other"]))
        if kind == "multipart":
            boundary = draw(BOUNDARY)
            parts = []
            for _ in range(draw(st.integers(0, 3))):
                fname = f"{fuzz_dir}/{confined(draw(PATH_TEXT))}"
                disposition = draw(st.sampled_from([
                    f'form-data; name="file"; filename="{fname}"',
                    f"form-data; name=file; filename*=utf-8''{quote(fname.encode('utf-8', 'surrogatepass'))}",
                    'form-data; name="file"', 'form-data; name="other"; filename="x"', ""]))
                parts.append(({"Content-Disposition": disposition.encode("utf-8", "surrogatepass")
                               .decode("latin-1")}, draw(st.binary(max_size=300))))
            body = multipart_body(boundary, parts)
            if draw(st.booleans()):
                body = draw(mutated(body))
            ctype = draw(st.sampled_from([f"multipart/form-data; boundary={boundary}",
                                          f'multipart/form-data; boundary="{boundary}"',
                                          "multipart/form-data", "multipart/form-data; boundary=",
                                          "multipart/form-data; boundary*=utf-8''%E2%82%AC",
                                          f"multipart/mixed; boundary={boundary}x"]))
        elif kind in ("raw", "gzip"):
            body = draw(st.binary(max_size=500))
            if kind == "gzip":
                body = gzip.compress(body)
                if draw(st.booleans()):
                    body = draw(mutated(body))
                headers.append(("Content-Encoding", "gzip"))
            ctype = "application/octet-stream"
        else:
            ctype = draw(HEADER_VALUE.map(lambda v: v.replace("\r", "").replace("\n", "")))
            body = draw(st.binary(max_size=100))
        headers.append(("Content-Type", ctype))
    raw, complete = http_request(method, target, headers, body,
                                 draw(FRAMING) if method == "POST" else "length", draw(CUTS))
    return Case(raw, complete, method)


@st.composite
def http_cases(draw: st.DrawFn, token: str) -> Case:
    method = draw(st.sampled_from(["GET", "HEAD", "POST", "PUT", "DELETE", "BREW", ""]))
    target = draw(st.sampled_from(["/health", "/envs", "/metrics", "/init", "/nope", "*",
                                   "http://x/health", "/process.Process/Nope", "/health?x=%"]))
    headers = draw(fuzz_headers(token))
    if target == "/init":  # never with the token: the fuzz must not change envd's settings
        headers = [(k, v) for k, v in headers if k != "X-Access-Token"]
    body = draw(RAW_JSON)
    raw, complete = http_request(method, target, headers, body, draw(FRAMING), draw(CUTS))
    if draw(st.integers(0, 3)) == 0:
        raw, complete = draw(mutated(raw)), False
    return Case(raw, complete, method)


def exchange(port: int, case: Case, timeout: float = 15.0) -> tuple[list[Answer], bool]:
    """Send one request; the answers, and whether the connection then served `/health`."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        try:
            sock.sendall(case.raw)
            if not case.complete:
                sock.shutdown(socket.SHUT_WR)
        except OSError:  # envd answered and closed before all of it was sent
            pass
        data = b""
        answers: list[Answer] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                answers = parse_answers(data, [case.method], limit=1)
                if answers:
                    break
            except Incomplete:
                pass
            try:
                chunk = sock.recv(1 << 16)
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                break
            data += chunk
            assert len(data) < 16 << 20, "an answer without end"
        else:
            raise AssertionError(f"no answer within {timeout} s: {case.raw[:300]!r}")
        if not answers and data:
            try:
                answers = parse_answers(data, [case.method], limit=1)
            except Incomplete:
                # an answer cut short: only where envd aborted a request cut short
                assert not case.complete, f"garbled answer {data[:300]!r} to {case.raw[:300]!r}"
        reused = False
        if case.complete and answers and "close" not in answers[0].headers.get("connection", ""):
            follow = b""
            try:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                while b"\r\n\r\n" not in follow:
                    chunk = sock.recv(4096)
                    if not chunk:
                        break
                    follow += chunk
            except OSError:
                pass
            assert follow, f"kept-alive connection dropped after {answers[0].status}: {case.raw[:300]!r}"
            assert follow.startswith(b"HTTP/1.1 204 "), follow[:100]
            reused = True
        return answers, reused


def check_envd_answers(target: Target, case: Case) -> None:
    answers, _ = exchange(target.envd.port, case)
    if case.complete:
        assert answers, f"a well-framed request got no answer: {case.raw[:300]!r}"
    for a in answers:
        target.counts[str(a.status)] = target.counts.get(str(a.status), 0) + 1
        said_why = b"unimplemented" in a.body or b"transfer-encoding" in a.body
        assert a.status < 500 or (a.status == 501 and (said_why or case.method == "HEAD")), \
            (a.status, a.body[:300], case.raw[:300])
        if case.stream and a.status == 200 and a.headers.get("content-type") == connect.STREAM_CONTENT_TYPE:
            end = connect_frames.Frames()
            frames = list(end.feed(a.body))
            assert frames and frames[-1][0], "a stream without its end message"
            error = frames[-1][1].get("error")
            if error:
                code = error["code"]
                allowed = RPC_ERROR_4XX | {"unimplemented"} | ({"deadline_exceeded"} if case.timeout_sent else set())
                assert code in allowed, (error, case.raw[:300])
        elif a.status >= 400 and a.body:
            error = json.loads(a.body)
            assert isinstance(error.get("message"), str), a.body[:200]
    health, _ = exchange(target.envd.port, Case(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", True, "GET"))
    assert health and health[0].status == 204


def assert_envd_healthy(target: Target, fds_before: int) -> None:
    envd = target.envd
    assert envd.process.poll() is None, "envd died"
    log = envd.log_path.read_text(errors="replace")
    assert "Traceback" not in log, log[-3000:]
    # Streams cancelled by the fuzz close their fds as they unwind: allow them a moment.
    deadline = time.monotonic() + 10
    while fd_count(envd.process.pid) > fds_before + 4 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert fd_count(envd.process.pid) <= fds_before + 4, f"{fd_count(envd.process.pid)} fds, {fds_before} before"


@pytest.mark.parametrize("kind", ["http", "connect", "files"])
@pytest.mark.parametrize("profile", PROFILES)
def test_envd_over_a_socket(profile: str, kind: str, target: Target, test_user: pwd.struct_passwd) -> None:
    token = target.envd.token or ""
    make_fuzz_dir(target, test_user)
    strategies = {"http": (http_cases(token), 2000), "connect": (connect_cases(token, target.fuzz_dir), 1500),
                  "files": (files_cases(token, target.fuzz_dir), 2000)}
    strategy, ci = strategies[kind]
    fds_before = fd_count(target.envd.process.pid)
    target.counts.clear()
    run_fuzz(f"envd socket: {kind}", profile, budget(profile, ci), strategy,
             lambda case: check_envd_answers(target, case))
    print(f"envd socket fuzz ({kind}) statuses: {sorted(target.counts.items())}")
    assert_envd_healthy(target, fds_before)


# ----------------------------------------------------------------------------- regressions
# One test per bug the fuzz found, with its failing input (docs/reliability.md lists them).


def ask(target: Target, raw: bytes, complete: bool = True, method: str = "POST") -> Answer | None:
    answers, _ = exchange(target.envd.port, Case(raw, complete, method))
    return answers[0] if answers else None


def rpc(target: Target, path: str, body: bytes, *headers: str) -> bytes:
    extra = "".join(h + "\r\n" for h in headers)
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nX-Access-Token: {target.envd.token}\r\n"
            f"Content-Type: application/json\r\n{extra}Content-Length: {len(body)}\r\n\r\n"
            ).encode("latin-1") + body


def assert_error(answer: Answer | None, status: int, code: str | int | None = None) -> None:
    assert answer is not None and answer.status == status, answer
    if code is not None:
        assert json.loads(answer.body)["code"] == code, answer.body


def test_regression_compressed_flag_is_invalid_argument(loop: asyncio.AbstractEventLoop) -> None:
    conn = connection_over(loop, [b"\x01\x00\x00\x00\x00"])
    with pytest.raises(RpcError) as raised:
        loop.run_until_complete(read_all_envelopes(http.Body(conn, 5, False, False)))
    assert raised.value.code == "invalid_argument"


def test_regression_deep_json_is_400(target: Target) -> None:
    deep = deep_json(1989).encode()
    with pytest.raises(RpcError) as raised:
        connect.decode_message(deep_json(200_000).encode())
    assert raised.value.code == "invalid_argument"
    assert_error(ask(target, rpc(target, "/filesystem.Filesystem/Stat", deep)), 400, "invalid_argument")
    init = b"POST /init HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(deep), deep)
    assert_error(ask(target, init), 400, 400)


def test_regression_unrepresentable_paths_are_400(target: Target) -> None:
    for raw in ("\x00", "a\x00b", "\ud800"):
        with pytest.raises(RpcError):
            entries.resolve_path(raw, USER, None)
    stat = rpc(target, "/filesystem.Filesystem/Stat", b'{"path": "\\u0000"}')
    assert_error(ask(target, stat), 400, "invalid_argument")
    stat = rpc(target, "/filesystem.Filesystem/Stat", b'{"path": "\\ud800"}')
    assert_error(ask(target, stat), 400, "invalid_argument")
    get = f"GET /files?path=%00 HTTP/1.1\r\nHost: x\r\nX-Access-Token: {target.envd.token}\r\n\r\n"
    assert_error(ask(target, get.encode(), method="GET"), 400, 400)


def test_regression_non_ascii_base64_is_invalid_argument() -> None:
    with pytest.raises(RpcError) as raised:
        proto.get_bytes({"a": "\x80"}, "a")
    assert raised.value.code == "invalid_argument"


def test_regression_connect_headers(target: Target) -> None:
    assert connect._parse_keepalive("1" + "0" * 400) == connect.MAX_KEEPALIVE
    listing = rpc(target, "/process.Process/List", b"{}", "Keepalive-Ping-Interval: 1" + "0" * 400)
    assert ask(target, listing) == Answer(200, {"content-type": "application/json",
                                                "content-length": "2"}, b"{}")
    timeout = rpc(target, "/process.Process/List", b"{}", "Connect-Timeout-Ms: \xb2")
    assert_error(ask(target, timeout), 400, "invalid_argument")
    auth = rpc(target, "/process.Process/List", b"{}", "Authorization: Basic \xe9")
    assert_error(ask(target, auth), 401, "unauthenticated")


def upload(target: Target, content_type: str, body: bytes, path: str = "") -> bytes:
    query = f"?path={quote(path)}" if path else ""
    return (f"POST /files{query} HTTP/1.1\r\nHost: x\r\nX-Access-Token: {target.envd.token}\r\n"
            f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


def test_regression_multipart_boundaries_are_400(target: Target) -> None:
    assert_error(ask(target, upload(target, "multipart/form-data", b"\r\n--0--\r\n")), 400, 400)
    euro = "multipart/form-data; boundary*=utf-8''%E2%82%AC"
    assert_error(ask(target, upload(target, euro, b"--x--\r\n")), 400, 400)


def test_regression_an_error_answer_that_closes_says_so(loop: asyncio.AbstractEventLoop) -> None:
    async def small(request: http.Request, response: http.Response) -> None:
        await request.body.read_all(5)
        await response.send(200)

    pipelined = b"POST / HTTP/1.1\r\nContent-Length: 10\r\n\r\n0123456789GET / HTTP/1.1\r\n\r\n"
    out, _, _ = serve_bytes(loop, [pipelined], small)
    [answer] = parse_answers(out)
    assert answer.status == 413 and answer.headers["connection"] == "close"


def test_regression_early_answer_to_expect_continue_says_close(target: Target) -> None:
    raw = (f"POST /files HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Access-Token: {target.envd.token}\r\n"
           "Expect: 100-continue\r\nContent-Type: multipart/form-data\r\nContent-Length: 9\r\n\r\n"
           ).encode()
    answer = ask(target, raw)
    assert answer is not None and answer.status == 400
    assert answer.headers.get("connection") == "close"
    # an early answer to a body over the 1 MiB envd skips: the same
    big = deep_json(200_000, "{").encode()
    raw = rpc(target, "/filesystem.Filesystem/Stat", big).replace(
        b"application/json", b"application/connect+json")
    answer = ask(target, raw)
    assert answer is not None and answer.status == 415
    assert answer.headers.get("connection") == "close"
    # ... and a small unread body is skipped: the connection goes on (ask() checks it)
    small = rpc(target, "/filesystem.Filesystem/Stat", b"{}").replace(
        b"application/json", b"application/connect+json")
    answer = ask(target, small)
    assert answer is not None and answer.status == 415 and "connection" not in answer.headers


def test_regression_long_names_are_400(target: Target, test_user: pwd.struct_passwd) -> None:
    make_fuzz_dir(target, test_user)  # ENAMETOOLONG, not ENOENT
    name = f"{target.fuzz_dir}/{'a' * 300}"
    get = f"GET /files?path={name} HTTP/1.1\r\nHost: x\r\nX-Access-Token: {target.envd.token}\r\n\r\n"
    assert_error(ask(target, get.encode(), method="GET"), 400, 400)
    stat = rpc(target, "/filesystem.Filesystem/Stat", json.dumps({"path": name}).encode())
    assert_error(ask(target, stat), 400, "invalid_argument")
    assert_error(ask(target, upload(target, "application/octet-stream", b"x", name)), 400, 400)


def test_regression_truncated_upload_is_no_500(target: Target, test_user: pwd.struct_passwd) -> None:
    make_fuzz_dir(target, test_user)
    raw = upload(target, "application/octet-stream", b"", f"{target.fuzz_dir}/f").replace(
        b"Content-Length: 0", b"Content-Length: 10")
    answer = ask(target, raw, complete=False)
    assert answer is None or answer.status < 500, answer
    assert_envd_healthy(target, fd_count(target.envd.process.pid))


def test_regression_bare_lf_in_a_header_is_400(target: Target, loop: asyncio.AbstractEventLoop) -> None:
    raw = (b"HEAD /init HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding:\nTransfer-Encoding: chunked\r\n"
           b"\r\n4\r\nnull\r\n0\r\n\r\n")
    answer = ask(target, raw, complete=False, method="HEAD")
    assert answer is not None and answer.status == 400 and answer.body == b""  # HEAD: no body
    for smuggled in (b"GET / HTTP/1.1\r\nX: a\rContent-Length: 5\r\n\r\n",
                     b"GET / HTTP/1.1\r\nX: a\x00b\r\n\r\n"):
        out, seen, _ = serve_bytes(loop, [smuggled])
        assert not seen and [a.status for a in parse_answers(out)] == [400]


def test_regression_unencodable_command_is_invalid_argument(target: Target) -> None:
    for process in ({"cmd": "/bin/true\ud800"}, {"cmd": "/bin/echo", "args": ["\ud800"]},
                    {"cmd": "/bin/echo", "envs": {"A": "\ud800"}}):
        payload = json.dumps({"process": process}).encode()
        body = b"\x00" + len(payload).to_bytes(4, "big") + payload
        raw = rpc(target, "/process.Process/Start", body, "Connect-Timeout-Ms: 3000").replace(
            b"application/json", b"application/connect+json")
        answer = ask(target, raw)
        assert answer is not None and answer.status == 200
        frames = list(connect_frames.Frames().feed(answer.body))
        assert frames[-1] == (True, {"error": {"code": "invalid_argument", "message": frames[-1][1]["error"]["message"]}})


@pytest.mark.xfail(strict=True, reason="aenv/connect_frames.py (host side, outside envd/): a "
                   "payload nested deeper than the stack raises RecursionError, not ValueError")
def test_known_host_frames_deep_json() -> None:
    payload = deep_json(100_000).encode()
    with pytest.raises(ValueError):
        list(connect_frames.Frames().feed(b"\x00" + len(payload).to_bytes(4, "big") + payload))
