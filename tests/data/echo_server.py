"""A minimal RFC 6455 WebSocket echo server and a few plain-HTTP answers, standard library
only: it runs inside a sandbox (the base template's python3 has no `websockets`). Used by
tests/e2e/test_websocket.py and tests/e2e/test_proxy_wire.py.

Every data frame is sent back as it came (opcode, FIN bit, payload; unmasked, as a server
must), so fragmented messages echo as fragmented messages; a ping gets its pong; a close is
answered with the same close code and reason, and then the connection ends. `GET /stats` (plain HTTP)
answers the number of WebSocket connections open right now, so a test can see a client's
disconnect reach the sandbox. `Upgrade: x-raw-echo`: any other protocol, a 101 and then
every byte echoed until the client's FIN (then a last line, then our FIN). `/stream`: server-sent events, one every 50 ms, to test that
the proxy does not buffer. A few plain-HTTP answers that proxies get wrong, for
tests/e2e/test_proxy_wire.py: `/304-with-length` (a 304 that states the representation's
length), `/http10` (an HTTP/1.0 answer without keep-alive: the connection is over after it,
though we hold it open a moment), `/sized` (200 with a Content-Length; HEAD answers the
length without a body).

usage: python3 echo_server.py PORT
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import struct
import sys

GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
OPEN: set[asyncio.StreamWriter] = set()


async def read_frame(reader: asyncio.StreamReader) -> tuple[int, int, bytes]:
    b0, b1 = await reader.readexactly(2)
    length = b1 & 0x7F
    if length == 126:
        (length,) = struct.unpack("!H", await reader.readexactly(2))
    elif length == 127:
        (length,) = struct.unpack("!Q", await reader.readexactly(8))
    mask = await reader.readexactly(4) if b1 & 0x80 else b""
    payload = await reader.readexactly(length)
    if mask:
        # XOR with the 4-byte mask, done on whole integers (fast enough for 10 MiB).
        full = (mask * (length // 4 + 1))[:length]
        payload = (int.from_bytes(payload, "big") ^ int.from_bytes(full, "big")).to_bytes(length, "big")
    return b0 & 0x80, b0 & 0x0F, payload


def frame(fin: int, opcode: int, payload: bytes) -> bytes:
    n = len(payload)
    if n < 126:
        head = struct.pack("!BB", fin | opcode, n)
    elif n < 1 << 16:
        head = struct.pack("!BBH", fin | opcode, 126, n)
    else:
        head = struct.pack("!BBQ", fin | opcode, 127, n)
    return head + payload


async def websocket(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, key: bytes) -> None:
    accept = base64.b64encode(hashlib.sha1(key + GUID).digest())
    writer.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                 b"Connection: Upgrade\r\nSec-WebSocket-Accept: " + accept + b"\r\n\r\n")
    OPEN.add(writer)
    try:
        while True:
            fin, opcode, payload = await read_frame(reader)
            if opcode == 0x8:  # close: answer with the same code and reason, then hang up
                writer.write(frame(0x80, 0x8, payload))
                await writer.drain()
                return
            if opcode == 0x9:  # ping
                writer.write(frame(0x80, 0xA, payload))
            elif opcode in (0x0, 0x1, 0x2):
                writer.write(frame(fin, opcode, payload))
            await writer.drain()  # backpressure: read no more while the echo cannot be sent
    except (asyncio.IncompleteReadError, ConnectionError):
        return
    finally:
        OPEN.discard(writer)
        writer.close()


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
        writer.close()
        return
    lines = head.decode("latin-1").split("\r\n")
    path = lines[0].split(" ")[1]
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
    if headers.get("upgrade", "").lower() == "websocket":
        await websocket(reader, writer, headers["sec-websocket-key"].encode())
        return
    if headers.get("upgrade", "").lower() == "x-raw-echo":
        writer.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x-raw-echo\r\n"
                     b"Connection: Upgrade\r\n\r\n")
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.write(b"bye after your FIN\n")  # the client's half-close left our side open
        await writer.drain()
        writer.close()
        return
    if path == "/stream":
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Cache-Control: no-cache\r\nConnection: close\r\n\r\n")
        for i in range(20):
            writer.write(b"data: event %d\n\n" % i)
            await writer.drain()
            await asyncio.sleep(0.05)
        writer.close()
        return
    method = lines[0].split(" ")[0]
    if path == "/304-with-length":
        writer.write(b'HTTP/1.1 304 Not Modified\r\nETag: "v1"\r\nContent-Length: 1234\r\n'
                     b"Connection: close\r\n\r\n")
        await writer.drain()
        writer.close()
        return
    if path == "/http10":
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Length: 6\r\n\r\nhttp10")
        await writer.drain()
        await asyncio.sleep(1)  # over, but not closed yet: a proxy must not reuse it
        writer.close()
        return
    if path == "/sized":
        body = b"x" * 100
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\nConnection: close\r\n\r\n"
                     + (b"" if method == "HEAD" else body))
        await writer.drain()
        writer.close()
        return
    body = str(len(OPEN)).encode() if path == "/stats" else b"not a websocket\n"
    status = b"200 OK" if path == "/stats" else b"400 Bad Request"
    writer.write(b"HTTP/1.1 " + status + b"\r\nConnection: close\r\nContent-Length: %d\r\n\r\n"
                 % len(body) + body)
    await writer.drain()
    writer.close()


async def main(port: int) -> None:
    server = await asyncio.start_server(handle, "0.0.0.0", port, limit=1 << 16)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1])))
