"""envd's `POST /init`, as every runtime driver sends it to a sandbox it made under another
identity (a pool sandbox, a restored copy, a fork child): new access token, env vars, default
user and workdir.

Owns: the request on a socket the caller connected. Must not touch: how the caller reaches
the sandbox (netns, tap, vsock).
"""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

from aenv.errors import AenvError, ErrorCode
from aenv.runtime.base import SandboxSpec


def init_body(spec: SandboxSpec) -> dict[str, Any]:
    """The /init body that gives a sandbox `spec`'s identity."""
    body: dict[str, Any] = {"accessToken": spec.envd_access_token,
                            "envVars": dict(spec.env_vars),
                            "defaultUser": spec.default_user}
    if spec.default_workdir:
        body["defaultWorkdir"] = spec.default_workdir
    return body


async def post_init(sock: socket.socket, token: str, body: dict[str, Any],
                    timeout: float = 10.0) -> None:
    """Send `body` to envd's /init on the connected non-blocking `sock`, authenticated with
    envd's current `token`; raise AenvError unless envd answers 204. Closes `sock`."""
    raw = json.dumps(body).encode()
    loop = asyncio.get_running_loop()
    try:
        await loop.sock_sendall(sock, (
            f"POST /init HTTP/1.1\r\nHost: envd\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nX-Access-Token: {token}\r\n"
            f"Content-Length: {len(raw)}\r\n\r\n").encode() + raw)
        reply = b""
        async with asyncio.timeout(timeout):
            while b"\r\n" not in reply:
                chunk = await loop.sock_recv(sock, 4096)
                if not chunk:
                    break
                reply += chunk
    except TimeoutError:
        raise AenvError(ErrorCode.TIMEOUT, "envd /init timed out") from None
    finally:
        sock.close()
    parts = reply.split(b"\r\n", 1)[0].split()
    if len(parts) < 2 or parts[1] != b"204":
        raise AenvError(ErrorCode.INTERNAL, f"envd /init answered {reply[:100]!r}")
