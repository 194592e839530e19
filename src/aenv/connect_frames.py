"""Client side of Connect's streaming framing (JSON codec), for the host's clients of envd (the
CLI, template builds).

Owns: a request message as a 5-byte envelope, and a response byte stream split back into
messages (flag 0x02 marks the end-of-stream message, `{}` or `{"error": {...}}`). The server
side is `aenv.envd.connect`, which runs inside sandboxes.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from typing import Any

END_STREAM = 0x02


def envelope(message: dict[str, Any]) -> bytes:
    payload = json.dumps(message).encode()
    return struct.pack(">BI", 0, len(payload)) + payload


class Frames:
    """Feed it the chunks of a streamed response as they come; it yields (end, message) for
    each whole envelope, keeping a partial one for the next chunk."""

    def __init__(self) -> None:
        self.buf = b""

    def feed(self, chunk: bytes) -> Iterator[tuple[bool, dict[str, Any]]]:
        self.buf += chunk
        while len(self.buf) >= 5:
            flags, size = struct.unpack(">BI", self.buf[:5])
            if len(self.buf) < 5 + size:
                break
            payload, self.buf = self.buf[5:5 + size], self.buf[5 + size:]
            yield bool(flags & END_STREAM), json.loads(payload) if payload else {}
