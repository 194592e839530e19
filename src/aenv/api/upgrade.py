"""HTTP/1.1 upgrades (WebSocket and any other `Upgrade:` protocol) to a port in a sandbox.

Owns: taking an upgrade request away from uvicorn before it becomes an ASGI request, routing
it like any other sandbox traffic (`E2b-Sandbox-Id`/`-Port` headers or a
`<port>-<id>.<domain>` host), sending it to the sandbox port, and, once the upstream answers
`101 Switching Protocols`, splicing the two TCP connections byte for byte.
Must not touch: ordinary requests (the ASGI proxy in `proxy.py` serves them) or frames.

Why a byte tunnel and not an ASGI `websocket` relay: ASGI terminates the WebSocket at the
edge, so the proxy would have to re-frame every message (a 10 MiB message held in memory,
ping timeouts and size limits of its own, extensions negotiated twice) and could carry no
other upgrade protocol. Spliced bytes keep close frames, half-closes (a FIN is passed on as
a FIN) and backpressure (each side stops reading while the other cannot write) end to end,
with no idle timeout: a tunnel lives until a side closes or its sandbox stops serving.

The hook is uvicorn's own upgrade path: `TunnelingHttpToolsProtocol` is uvicorn's httptools
protocol (passed as `http=`) that treats every upgrade request as one it handles, and hands
the connection's transport to a `Tunnel` instead of a WebSocket protocol. uvicorn is pinned
in pyproject.toml because this subclass depends on its upgrade method names.
h11 (a maintained HTTP/1.1 state machine, already installed with uvicorn and httpx) reads the
upstream's answer: whether it is a 101, or where a refusal (e.g. a 400) ends.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, cast

import h11
import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from aenv.api.proxy import (
    TRAFFIC_TOKEN_HEADER,
    Target,
    route_by_headers,
    traffic_refusal,
    upstream_host,
)
from aenv.errors import AenvError, ErrorCode
from aenv.orchestrator.manager import SandboxManager

log = logging.getLogger("aenv.proxy")

# How long a closing tunnel may take to flush what it holds before it is reset.
CLOSE_GRACE_S = 30.0
# Request headers the tunnel sets itself (the rest pass through unchanged).
_REWRITTEN = frozenset({b"host", b"connection", b"upgrade", b"keep-alive", b"proxy-authorization",
                        b"proxy-connection", b"te", b"trailer", b"transfer-encoding",
                        TRAFFIC_TOKEN_HEADER})


def _error_bytes(status: int, reason: str, body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(data)}\r\nconnection: close\r\n\r\n").encode() + data


class _End(asyncio.Protocol):
    """One end of a tunnel: what it receives goes to the other end's transport."""

    def __init__(self, tunnel: Tunnel, name: str) -> None:
        self.tunnel = tunnel
        self.name = name
        self.transport: asyncio.Transport | None = None
        self.eof = False
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.tunnel.received(self, data)

    def eof_received(self) -> bool:
        self.eof = True
        self.tunnel.half_closed(self)
        return True  # keep the transport: the other direction may still be sending

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.tunnel.lost(self, exc)

    # Backpressure: while this end's socket cannot take more, stop reading the other end.
    def pause_writing(self) -> None:
        self.tunnel.other(self).pause_reading()

    def resume_writing(self) -> None:
        self.tunnel.other(self).resume_reading()

    def pause_reading(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def write_eof(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            if self.transport.can_write_eof():
                self.transport.write_eof()
            else:
                self.transport.close()

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()  # flushes what is buffered, then closes

    def abort(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.abort()


class Tunnel:
    """One upgraded connection: the client's transport, the sandbox port's, and the state of
    the exchange (waiting for the upstream's answer, then spliced)."""

    def __init__(self, tunnels: TunnelRegistry, target: Target, request: bytes,
                 h11_request: h11.Request, early: bytes) -> None:
        self.registry = tunnels
        self.target = target
        self.client = _End(self, "client")
        self.upstream = _End(self, "upstream")
        self._request = request
        self._pending = bytearray(early)  # client bytes sent before the upstream answered
        # h11 only watches the upstream's answer: 101, or where a refusal ends.
        self._answer: h11.Connection | None = h11.Connection(h11.CLIENT)
        self._answer.send(h11_request)
        self._answer.send(h11.EndOfMessage())
        self._spliced = False
        self._task: asyncio.Task[None] | None = None

    def other(self, end: _End) -> _End:
        return self.upstream if end is self.client else self.client

    def start(self, transport: asyncio.Transport) -> None:
        transport.set_protocol(self.client)
        self.client.connection_made(transport)
        self.client.pause_reading()  # nothing more from the client until the upstream answers
        self.registry.add(self)
        self._task = asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        manager = self.registry.manager
        try:
            sock = await manager.open_port(self.target.sandbox_id, self.target.port)
            try:
                await asyncio.get_running_loop().create_connection(lambda: self.upstream,
                                                                   sock=sock)
            except BaseException:  # cancelled by a close meanwhile, or refused: no stray fd
                if self.upstream.transport is None:
                    sock.close()
                raise
        except AenvError as exc:
            message = (f"The sandbox is running but port is not open: {exc.message}"
                       if exc.code is ErrorCode.PORT_CLOSED else "The sandbox was not found")
            self._refuse(502, "Bad Gateway", {"sandboxId": self.target.sandbox_id,
                                              "message": message, "code": 502})
            return
        except OSError as exc:
            self._refuse(502, "Bad Gateway", {"sandboxId": self.target.sandbox_id,
                                              "message": f"The sandbox was not found ({exc})",
                                              "code": 502})
            return
        if self.client.closed:
            self.upstream.close()
            return
        self.upstream.write(self._request)
        if self._pending:
            self.upstream.write(bytes(self._pending))
            self._pending.clear()

    def _refuse(self, status: int, reason: str, body: dict[str, Any]) -> None:
        self.client.write(_error_bytes(status, reason, body))
        self.client.close()

    def received(self, end: _End, data: bytes) -> None:
        if end is self.client:
            if self._spliced:
                self.upstream.write(data)
            else:
                self._pending += data
            return
        self.client.write(data)
        if self._answer is not None:
            self._watch_answer(data)

    def _watch_answer(self, data: bytes) -> None:
        assert self._answer is not None
        self._answer.receive_data(data)
        try:
            while True:
                event = self._answer.next_event()
                if event is h11.NEED_DATA:
                    return
                if isinstance(event, h11.InformationalResponse) and event.status_code == 101:
                    self._answer = None
                    self._spliced = True
                    self.client.resume_reading()
                    return
                if isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                    # The upgrade was refused and that answer is complete: the connection
                    # is not reused, since its next request might be for another sandbox.
                    self.close()
                    return
        except h11.RemoteProtocolError as exc:
            log.info("upgrade to %s:%d: bad answer: %s", self.target.sandbox_id,
                     self.target.port, exc)
            self.close()

    def half_closed(self, end: _End) -> None:
        if end is self.upstream and self._answer is not None:
            # A refusal without a length ends at the close; a half-answered head is cut short.
            self.close()
            return
        if end is self.client and not self._spliced:
            self.close()
            return
        self.other(end).write_eof()
        if self.client.eof and self.upstream.eof:
            self.close()

    def lost(self, end: _End, exc: Exception | None) -> None:
        if exc is not None:
            # A reset (a crashed client, a killed sandbox process): what is still buffered
            # for the other side is moot, and that side may not read it.
            self.other(end).abort()
        self.close()

    def close(self) -> None:
        self.client.close()
        self.upstream.close()
        if self.upstream.transport is None and self._task is not None:
            self._task.cancel()
        if self.registry.discard(self):
            # A graceful close flushes first; a peer that never reads must not hold it open.
            asyncio.get_running_loop().call_later(CLOSE_GRACE_S, self.abort)

    def abort(self) -> None:
        self.client.abort()
        self.upstream.abort()
        if self.upstream.transport is None and self._task is not None:
            self._task.cancel()
        self.registry.discard(self)

    # uvicorn's graceful shutdown asks each of its connections to shut down.
    def shutdown(self) -> None:
        self.close()


class TunnelRegistry:
    """The open tunnels, per sandbox: a sandbox that stops serving (paused, killed, expired)
    closes its tunnels, as it drops the proxy's pooled connections."""

    def __init__(self, manager: SandboxManager) -> None:
        self.manager = manager
        self._by_sandbox: dict[str, set[Tunnel]] = {}
        self.server_connections: set[Any] | None = None  # uvicorn's, for graceful shutdown
        manager.on_stop_serving(self.close_sandbox)

    def add(self, tunnel: Tunnel) -> None:
        self._by_sandbox.setdefault(tunnel.target.sandbox_id, set()).add(tunnel)
        if self.server_connections is not None:
            self.server_connections.add(tunnel)

    def discard(self, tunnel: Tunnel) -> bool:
        """Forget `tunnel`; False if it was already forgotten."""
        if self.server_connections is not None:
            self.server_connections.discard(tunnel)
        tunnels = self._by_sandbox.get(tunnel.target.sandbox_id)
        if tunnels is None or tunnel not in tunnels:
            return False
        tunnels.discard(tunnel)
        if not tunnels:
            del self._by_sandbox[tunnel.target.sandbox_id]
        return True

    def count(self, sandbox_id: str | None = None) -> int:
        if sandbox_id is not None:
            return len(self._by_sandbox.get(sandbox_id, ()))
        return sum(len(t) for t in self._by_sandbox.values())

    def close_sandbox(self, sandbox_id: str) -> None:
        # Reset, not a graceful close: the sandbox's side is about to be checkpointed or
        # killed, and nothing buffered for it will be read.
        for tunnel in list(self._by_sandbox.get(sandbox_id, ())):
            tunnel.abort()


class TunnelingHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, with every `Connection: upgrade` request routed to a
    sandbox handed to a `Tunnel` (the application is an `EdgeRouter`, which knows the
    proxy's tunnels and the sandbox domain)."""

    def _should_upgrade(self) -> bool:
        # Only upgrades routed to a sandbox: any other (an `h2c` offer to the control plane)
        # is served as the plain HTTP request it also is, as uvicorn does.
        return self._get_upgrade() is not None and self._tunnel_target() is not None

    def _registry(self) -> TunnelRegistry | None:
        registry = getattr(self.config.app, "tunnels", None)
        return registry if isinstance(registry, TunnelRegistry) else None

    def _tunnel_target(self) -> Target | None:
        if self._registry() is None:
            return None
        return route_by_headers({"headers": self.headers}, getattr(self.config.app, "domain", None))

    def data_received(self, data: bytes) -> None:
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            msg = "Invalid HTTP request received."
            self.logger.warning(msg)
            self.send_400_response(msg)
        except httptools.HttpParserUpgrade as upgrade:
            # Bytes after the request head in the same read belong to the new protocol.
            if self._should_upgrade():
                offset = upgrade.args[0] if upgrade.args and isinstance(upgrade.args[0], int) else len(data)
                self._upgrade(data[offset:])
            else:
                self._unsupported_upgrade_warning()

    def _upgrade(self, early: bytes) -> None:
        self.connections.discard(self)
        registry = self._registry()
        headers: list[tuple[bytes, bytes]] = list(self.headers)
        target = self._tunnel_target()
        assert registry is not None and target is not None  # _should_upgrade() said so
        registry.server_connections = self.server_state.connections
        refusal = traffic_refusal(registry.manager, target, headers)
        if refusal is not None:
            self.transport.write(_error_bytes(403, "Forbidden", {
                "sandboxId": target.sandbox_id, "message": refusal, "code": 403}))
            self.transport.close()
            return
        method = self.scope["method"].encode()
        upgrade = next(v for k, v in headers if k == b"upgrade")
        forwarded = [(b"host", upstream_host(registry.manager, target)),
                     (b"connection", b"Upgrade"), (b"upgrade", upgrade)]
        forwarded += [(k, v) for k, v in headers if k not in _REWRITTEN]
        head = b"".join([method, b" ", self.url, b" HTTP/1.1\r\n",
                         *(k + b": " + v + b"\r\n" for k, v in forwarded), b"\r\n"])
        try:
            # h11 also checks the request (e.g. a body the tunnel would not frame): a 400.
            tunnel = Tunnel(registry, target, head,
                            h11.Request(method=method, target=self.url, headers=forwarded), early)
        except h11.LocalProtocolError as exc:
            self.transport.write(_error_bytes(400, "Bad Request",
                                              {"code": 400, "message": f"bad upgrade request: {exc}"}))
            self.transport.close()
            return
        tunnel.start(self.transport)
