"""Egress policies of network slots: nftables objects per slot, and the transparent proxy that
decides domain rules (`runtime/egress.py` says what a policy means).

Per slot index N, in our table `ip aenv` (made on the first policy, removed with the slot):
- interval sets `eg_allow_N` and `eg_deny_N` (ipv4_addr; overlapping entries merged first);
- chain `eg_N`: allowed -> return (on to the table's other rules), denied -> TCP reset, or
  ICMP admin-prohibited for anything else, so a refused connection fails at once;
- chain `egn_N` (nat prerouting, first packet of a connection only), when domain rules exist:
  a TCP connection to port 80 or 443 that `eg_N` would refuse is DNATed to this server's
  proxy on the bridge address instead (never one to the bridge subnet, link-local, loopback
  or any host address: those keep their usual refusal);
- elements `<slot address> : jump eg_N` in the verdict maps `egress` (forward hook; the input
  hook asks it for DNS to the host's resolver) and `egress_nat` (prerouting), which the
  table's base chains look up by source address: one hash lookup per packet for every
  sandbox, two interval lookups more for a policed one. The bridge only lets a slot send
  from its own address (network.py), so the source address is the sandbox.
A change is one nft transaction (sets flushed and refilled, maps updated), hence atomic, and
checked on every packet: a connection the new rules refuse is reset on its next packet.

The proxy (`EgressProxy`) listens on the bridge address, port chosen by the kernel; the set
`egress_proxy_ports` lets DNATed connections (conntrack status dnat) to it through the input
hook that refuses everything else from the bridge. It reads the connection's original
destination (SO_ORIGINAL_DST), then the HTTP request head (port 80: Host) or the TLS
ClientHello (443: SNI), and either connects to that destination and splices the two
connections, or resets the sandbox's connection. The sandbox may resolve names however it
likes: the name checked is the one it sends. Only the first request of a keep-alive
connection is looked at; a policy change does not cut connections the proxy already joined.

Owns: the per-slot objects above, the proxy's listening socket and the connections it joins.
Must not touch: the table's other objects (network.py owns them).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

from aenv.runtime.egress import DOMAIN_PORTS, EgressPolicy

log = logging.getLogger(__name__)

PROXY_PORTS_SET = "egress_proxy_ports"
FORWARD_MAP = "egress"
NAT_MAP = "egress_nat"
_SO_ORIGINAL_DST = 80
FIRST_BYTES_TIMEOUT_S = 10.0  # for the sandbox to send its request head / ClientHello
CONNECT_TIMEOUT_S = 10.0
MAX_HEAD = 16 * 1024
_NEVER_PROXIED = ("169.254.0.0/16", "127.0.0.0/8", "224.0.0.0/4", "0.0.0.0/8",
                  "255.255.255.255/32")


def _elements(networks: tuple[str, ...]) -> str:
    return ", ".join(networks)


def apply_commands(index: int, address: str, policy: EgressPolicy, *, subnet: str,
                   host_dns: list[str], proxy: tuple[str, int] | None) -> str:
    """One transaction installing `policy` for slot `index` (at `address`)."""
    t = "ip aenv"
    allow_set, deny_set, chain, nat = (f"eg_allow_{index}", f"eg_deny_{index}",
                                       f"eg_{index}", f"egn_{index}")
    allowed = policy.allowed_networks
    if policy.domains and host_dns:
        # The sandbox's own resolver (the host's) counts as a DNS server here.
        allowed = EgressPolicy(allow=(*allowed, *(f"{a}/32" for a in host_dns)),
                               dns_servers=()).allowed_networks
    lines = [
        f"add set {t} {allow_set} {{ type ipv4_addr; flags interval; auto-merge; }}",
        f"add set {t} {deny_set} {{ type ipv4_addr; flags interval; auto-merge; }}",
        f"add chain {t} {chain}", f"add chain {t} {nat}",
        f"flush set {t} {allow_set}", f"flush set {t} {deny_set}",
        f"flush chain {t} {chain}", f"flush chain {t} {nat}",
    ]
    if allowed:
        lines.append(f"add element {t} {allow_set} {{ {_elements(allowed)} }}")
    if policy.deny:
        lines.append(f"add element {t} {deny_set} {{ {_elements(policy.deny)} }}")
    lines += [
        f"add rule {t} {chain} ip daddr @{allow_set} return",
        f"add rule {t} {chain} ip daddr @{deny_set} meta l4proto tcp reject with tcp reset",
        f"add rule {t} {chain} ip daddr @{deny_set} reject with icmp type admin-prohibited",
    ]
    if policy.domains and proxy is not None:
        never = ", ".join((subnet, *_NEVER_PROXIED))
        ports = ", ".join(str(p) for p in DOMAIN_PORTS)
        lines += [
            f"add rule {t} {nat} ip daddr @{allow_set} return",
            f"add rule {t} {nat} ip daddr {{ {never} }} return",
            f"add rule {t} {nat} fib daddr type local return",
            (f"add rule {t} {nat} ip daddr @{deny_set} tcp dport {{ {ports} }} "
             f"dnat to {proxy[0]}:{proxy[1]}"),
        ]
    lines += [f"add element {t} {FORWARD_MAP} {{ {address} : jump {chain} }}",
              f"add element {t} {NAT_MAP} {{ {address} : jump {nat} }}"]
    return "\n".join(lines) + "\n"


def clear_commands(index: int, address: str) -> str:
    """One transaction removing slot `index`'s objects; idempotent (each is added first)."""
    t = "ip aenv"
    allow_set, deny_set, chain, nat = (f"eg_allow_{index}", f"eg_deny_{index}",
                                       f"eg_{index}", f"egn_{index}")
    return "\n".join([
        f"add set {t} {allow_set} {{ type ipv4_addr; flags interval; auto-merge; }}",
        f"add set {t} {deny_set} {{ type ipv4_addr; flags interval; auto-merge; }}",
        f"add chain {t} {chain}", f"add chain {t} {nat}",
        f"add element {t} {FORWARD_MAP} {{ {address} : jump {chain} }}",
        f"add element {t} {NAT_MAP} {{ {address} : jump {nat} }}",
        f"delete element {t} {FORWARD_MAP} {{ {address} }}",
        f"delete element {t} {NAT_MAP} {{ {address} }}",
        f"flush chain {t} {chain}", f"flush chain {t} {nat}",
        f"delete chain {t} {chain}", f"delete chain {t} {nat}",
        f"delete set {t} {allow_set}", f"delete set {t} {deny_set}",
    ]) + "\n"


# ------------------------------------------------------------------ what the sandbox sends


def http_host(head: bytes) -> str | None:
    """The Host of an HTTP/1.x request head (without its port), or None."""
    lines = head.split(b"\r\n")
    if len(lines) < 2 or b" HTTP/1." not in lines[0]:
        return None
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if sep and name.strip().lower() == b"host":
            host = value.strip().decode("latin-1")
            if host.startswith("["):
                return None  # IPv6 literal: never a domain
            return host.rsplit(":", 1)[0] if ":" in host else host
    return None


def tls_sni(data: bytes) -> str | None | bool:
    """The SNI host name of a TLS ClientHello at the start of `data`; None if it has none
    (or is not a ClientHello); False if more bytes are needed."""
    if len(data) < 5:
        return False
    if data[0] != 22:  # handshake
        return None
    record_len = int.from_bytes(data[3:5], "big")
    if len(data) < 5 + record_len:
        return False  # the caller stops at MAX_HEAD
    body = data[5:5 + record_len]
    if not body or body[0] != 1:  # client_hello
        return None
    pos = 4 + 2 + 32  # version, random
    try:
        pos += 1 + body[pos]  # session id
        pos += 2 + int.from_bytes(body[pos:pos + 2], "big")  # cipher suites
        pos += 1 + body[pos]  # compression methods
        end = pos + 2 + int.from_bytes(body[pos:pos + 2], "big")
        pos += 2
        while pos + 4 <= end:
            ext_type = int.from_bytes(body[pos:pos + 2], "big")
            ext_len = int.from_bytes(body[pos + 2:pos + 4], "big")
            ext = body[pos + 4:pos + 4 + ext_len]
            pos += 4 + ext_len
            if ext_type != 0:
                continue
            i = 2  # server_name_list length
            while i + 3 <= len(ext):
                kind, name_len = ext[i], int.from_bytes(ext[i + 1:i + 3], "big")
                name = ext[i + 3:i + 3 + name_len]
                i += 3 + name_len
                if kind == 0:
                    return name.decode("ascii", errors="replace")
    except IndexError:
        return None
    return None


# ------------------------------------------------------------------ the proxy


def _original_destination(sock: socket.socket) -> tuple[str, int]:
    raw = sock.getsockopt(socket.SOL_IP, _SO_ORIGINAL_DST, 16)
    port = struct.unpack("!H", raw[2:4])[0]
    return socket.inet_ntoa(raw[4:8]), port


def _is_local(address: str) -> bool:
    """Whether `address` is one of this host's (binding to it succeeds)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((address, 0))
        except OSError:
            return False
    return True


def _reset(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.transport.abort()


@dataclass
class ProxyStats:
    joined: int = 0
    refused: int = 0


@dataclass
class EgressProxy:
    """The transparent proxy for domain rules. `policy_of(source address)` is the current
    policy of the sandbox at that address (None: not ours)."""

    address: str
    subnet: str
    policy_of: Callable[[str], EgressPolicy | None]
    stats: ProxyStats = field(default_factory=ProxyStats)
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> int:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.address, 0))
        sock.listen(512)
        sock.setblocking(False)
        self._server = await asyncio.start_server(self._accept, sock=sock, limit=MAX_HEAD)
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self._serve(reader, writer)
        except asyncio.CancelledError:
            writer.transport.abort()
            raise
        except Exception:  # one connection must never take the proxy down
            log.exception("egress proxy: connection failed")
            writer.transport.abort()
        finally:
            self._tasks.discard(task)

    def _refusable(self, dst: str) -> bool:
        ip = ipaddress.IPv4Address(dst)
        if ip in ipaddress.IPv4Network(self.subnet) or any(
                ip in ipaddress.IPv4Network(n) for n in _NEVER_PROXIED):
            return True
        return _is_local(dst)

    async def _first_name(self, reader: asyncio.StreamReader, port: int
                          ) -> tuple[str | None, bytes]:
        """The name the sandbox asks for (Host or SNI) and the bytes read to find it."""
        data = b""
        async with asyncio.timeout(FIRST_BYTES_TIMEOUT_S):
            while len(data) < MAX_HEAD:
                chunk = await reader.read(MAX_HEAD - len(data))
                if not chunk:
                    return None, data
                data += chunk
                if port == 443:
                    sni = tls_sni(data)
                    if sni is not False:
                        return (sni if isinstance(sni, str) else None), data
                elif b"\r\n\r\n" in data:
                    return http_host(data.split(b"\r\n\r\n", 1)[0]), data
        return None, data

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        sock = writer.get_extra_info("socket")
        policy = self.policy_of(peer[0]) if peer else None
        try:
            dst, port = _original_destination(sock)
        except OSError:
            dst, port = "", 0
        if policy is None or port not in DOMAIN_PORTS or not dst or self._refusable(dst):
            self.stats.refused += 1
            _reset(writer)
            return
        try:
            name, head = await self._first_name(reader, port)
        except (TimeoutError, ConnectionError, OSError):
            name, head = None, b""
        if name is None or not policy.host_allowed(name):
            log.info("egress: %s -> %s:%d (%s) refused by the domain rules", peer[0], dst, port,
                     name)
            self.stats.refused += 1
            _reset(writer)
            return
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                up_reader, up_writer = await asyncio.open_connection(dst, port)
        except (TimeoutError, OSError):
            self.stats.refused += 1
            _reset(writer)
            return
        self.stats.joined += 1
        up_writer.write(head)
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            up_writer.close()
            writer.close()
