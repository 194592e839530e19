"""Network test hosts and raw packets for the sandbox network tests (tests/security,
tests/runtime, tests/vm).

Every host a test talks to is a network namespace made here, on this machine: an "outside"
host behind a veth on a private benchmark subnet (198.18.0.0/15, RFC 2544), reached by
sandboxes through the host's masquerade exactly as the internet would be. No packet is ever
addressed to anything off this machine.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import random
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from aenv.runtime.container import linux

T = TypeVar("T")
NETNS_DIR = Path("/run/aenv/netns")
SUBNET = "10.88.0.0/16"  # the default network.subnet (config.py)
ETH_P_ALL, ETH_P_IP, ETH_P_ARP = 0x0003, 0x0800, 0x0806


def in_netns(path: str | Path, make: Callable[[], T]) -> T:
    """Call `make` (e.g. create a socket) inside the network namespace at `path`, on a
    thread of its own so that no other thread changes namespace; a socket keeps the
    namespace it was created in."""
    result: list[T] = []
    errors: list[BaseException] = []

    def work() -> None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                linux.setns(fd, linux.CLONE_NEWNET)
            finally:
                os.close(fd)
            result.append(make())
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            errors.append(exc)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result[0]


@dataclass
class TcpService:
    """A TCP listener answering `hello` to whoever connects, recording each peer."""

    sock: socket.socket
    peers: list[str] = field(default_factory=list)

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    def serve(self) -> None:
        self.sock.settimeout(0.2)
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        while True:
            try:
                conn, peer = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            self.peers.append(peer[0])
            with conn, contextlib.suppress(OSError):
                conn.sendall(b"hello\n")

    def close(self) -> None:
        self.sock.close()


def tcp_listener(address: str = "0.0.0.0") -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((address, 0))
    sock.listen(16)
    return sock


@contextlib.contextmanager
def tcp_service(make: Callable[[], socket.socket] = tcp_listener) -> Iterator[TcpService]:
    service = TcpService(make())
    service.serve()
    try:
        yield service
    finally:
        service.close()


@dataclass(frozen=True)
class OutsideHost:
    """A host "on the internet" for sandboxes: a namespace behind veth `name` on the host."""

    netns: Path  # ip netns file
    name: str  # host end of the veth
    host_address: str  # this machine's address on the link (a local address of the host)
    address: str  # the outside host's


@contextlib.contextmanager
def outside_host() -> Iterator[OutsideHost]:
    """Make an outside host on a free /30 of 198.18.0.0/15; removed on exit."""
    for _ in range(20):
        third = random.randrange(1, 255)
        name = f"aenvt{third}"
        if not Path(f"/sys/class/net/{name}").exists():
            break
    else:
        raise AssertionError("no free test link name")
    ns = f"{name}-ns"
    host, outside = f"198.18.{third}.1", f"198.18.{third}.2"

    def sh(*argv: str) -> None:
        subprocess.run(argv, check=True, capture_output=True)

    sh("ip", "netns", "add", ns)
    try:
        sh("ip", "link", "add", name, "type", "veth", "peer", "name", "eth0", "netns", ns)
        sh("ip", "addr", "add", f"{host}/30", "dev", name)
        sh("ip", "link", "set", name, "up")
        sh("ip", "-n", ns, "addr", "add", f"{outside}/30", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield OutsideHost(Path("/run/netns") / ns, name, host, outside)
    finally:
        subprocess.run(["ip", "link", "del", name], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


# ---------------------------------------------------------------- slots and raw frames


def slot_path(address: str, subnet: str = SUBNET) -> Path:
    """The network slot file of the sandbox at `address` (slot N has network + N + 2)."""
    index = int(ipaddress.IPv4Address(address)) - int(ipaddress.IPv4Network(subnet)
                                                       .network_address) - 2
    found = sorted(NETNS_DIR.glob(f"s{index}.*"))
    assert len(found) == 1, (address, found)
    return found[0]


def mac_of(netns: Path, ifname: str = "eth0") -> str:
    def read() -> str:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            raw = fcntl.ioctl(s.fileno(), 0x8927, struct.pack("16s16x", ifname.encode()))
        return ":".join(f"{b:02x}" for b in raw[18:24])
    return in_netns(netns, read)


def mac(text: str) -> bytes:
    return bytes(int(part, 16) for part in text.split(":"))


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return int(~total & 0xFFFF)


def udp_frame(src_mac: str, dst_mac: str, src_ip: str, dst_ip: str, dport: int,
              payload: bytes, sport: int = 40000) -> bytes:
    udp = struct.pack("!HHHH", sport, dport, 8 + len(payload), 0) + payload  # no checksum
    header = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0x1234, 0, 64, 17, 0,
                         socket.inet_aton(src_ip), socket.inet_aton(dst_ip))
    header = header[:10] + struct.pack("!H", _checksum(header)) + header[12:]
    return mac(dst_mac) + mac(src_mac) + struct.pack("!H", ETH_P_IP) + header + udp


def arp_frame(src_mac: str, dst_mac: str, op: int, sender_mac: str, sender_ip: str,
              target_mac: str, target_ip: str) -> bytes:
    arp = struct.pack("!HHBBH6s4s6s4s", 1, ETH_P_IP, 6, 4, op, mac(sender_mac),
                      socket.inet_aton(sender_ip), mac(target_mac), socket.inet_aton(target_ip))
    return mac(dst_mac) + mac(src_mac) + struct.pack("!H", ETH_P_ARP) + arp


def packet_socket(netns: Path, ifname: str = "eth0") -> socket.socket:
    """A raw packet socket on `ifname` inside `netns` (what a sandbox's root would open with
    CAP_NET_RAW): sends frames as given, receives every frame of the interface."""
    def make() -> socket.socket:
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        s.bind((ifname, 0))
        return s
    return in_netns(netns, make)


def frames_seen(sock: socket.socket, seconds: float) -> list[bytes]:
    """Every frame `sock` receives for `seconds`."""
    out: list[bytes] = []
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            out.append(sock.recv(65535))
        except TimeoutError:
            break
    return out
