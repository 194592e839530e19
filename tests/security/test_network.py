"""Network attacks of a hostile sandbox on its neighbours and on the host (issue 11, findings
3 and 4), against the session's real server.

Sandbox A attacks sandbox B, both with internet access (network slots on bridge `aenv0`).
Raw sockets are refused inside a sandbox (no CAP_NET_RAW): the first test shows that. The
others are layered: as if A had regained CAP_NET_RAW, the test (host root) opens a packet
socket on A's eth0 inside A's network namespace and sends what A's root would forge. Every
other host in play is on this machine: the host itself and an "outside" host in a network
namespace the test makes (tests/net_helpers.py), reached through the host's masquerade.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from e2b import CommandExitException, Sandbox
from e2e_helpers import container_only, wait_until
from net_helpers import (
    SUBNET,
    OutsideHost,
    arp_frame,
    frames_seen,
    in_netns,
    mac_of,
    outside_host,
    packet_socket,
    slot_path,
    tcp_listener,
    tcp_service,
    udp_frame,
)

pytestmark = container_only
BRIDGE = "aenv0"
HOST = str(ipaddress.IPv4Network(SUBNET).network_address + 1)  # the gateway, 10.88.0.1
BROADCAST = "ff:ff:ff:ff:ff:ff"
UDP_PORT = 47000

UDP_LISTENER = """
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("0.0.0.0", int(sys.argv[1])))
s.settimeout(0.5)
end = time.time() + 300
with open(sys.argv[2], "a", buffering=1) as log:
    log.write("ready\\n")
    while time.time() < end:
        try:
            data, peer = s.recvfrom(2048)
        except TimeoutError:
            continue
        log.write(f"{peer[0]} {data.decode(errors='replace')}\\n")
"""


@dataclass(frozen=True)
class Peer:
    sbx: Sandbox
    address: str
    netns: Path  # its network slot: what `nsenter --net=` would enter
    mac: str
    port: str  # the host end of its veth, a port of the bridge
    log: str  # its UDP listener's log


def run_rc(sbx: Sandbox, cmd: str, user: str = "root") -> tuple[int, str, str]:
    try:
        r = sbx.commands.run(cmd, user=user, timeout=60)
        return r.exit_code, r.stdout, r.stderr
    except CommandExitException as exc:
        return exc.exit_code, exc.stdout, exc.stderr


def _peer(sbx: Sandbox) -> Peer:
    address = sbx.commands.run("hostname -I").stdout.split()[0]
    netns = slot_path(address)
    mac = mac_of(netns)
    # Control: the namespace found is this sandbox's (it sees the same MAC on its eth0).
    assert sbx.commands.run("cat /sys/class/net/eth0/address").stdout.strip() == mac
    log = f"/tmp/udp-{uuid.uuid4().hex[:8]}.log"
    sbx.files.write("/tmp/udp_listener.py", UDP_LISTENER)
    sbx.commands.run(f"python3 /tmp/udp_listener.py {UDP_PORT} {log}", background=True,
                     user="root")
    wait_until(lambda: "ready" in _read(sbx, log), 20, what="the UDP listener")
    return Peer(sbx, address, netns, mac, f"aenvh{netns.name.split('.')[0][1:]}", log)


def _read(sbx: Sandbox, path: str) -> str:
    code, out, _ = run_rc(sbx, f"cat {path} 2>/dev/null")
    return out if code == 0 else ""


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Peer, Peer]]:
    tag = {"suite": "security-network", "owner": uuid.uuid4().hex[:10]}
    sandboxes: list[Sandbox] = []
    try:
        for name in ("a", "b"):
            sandboxes.append(Sandbox.create(metadata={**tag, "name": name}, timeout=600,
                                            allow_internet_access=True))
        yield _peer(sandboxes[0]), _peer(sandboxes[1])
    finally:
        for sbx in sandboxes:
            sbx.kill()


@pytest.fixture(scope="module")
def outside() -> Iterator[OutsideHost]:
    with outside_host() as host:
        yield host


@pytest.fixture(scope="module")
def bridge_mac() -> str:
    return Path(f"/sys/class/net/{BRIDGE}/address").read_text().strip()


def _send_from_host(peer: Peer, text: str, count: int = 3) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _ in range(count):
            s.sendto(text.encode(), (peer.address, UDP_PORT))
            time.sleep(0.05)


def _received(peer: Peer, marker: str, timeout: float = 10) -> None:
    wait_until(lambda: marker in _read(peer.sbx, peer.log), timeout,
               what=f"{marker!r} in {peer.address}'s listener")


def _host_neighbour(address: str) -> str | None:
    out = subprocess.run(["ip", "-j", "neigh", "show", "to", address, "dev", BRIDGE],
                         capture_output=True, text=True, check=True).stdout
    entries = [e for e in json.loads(out or "[]") if "lladdr" in e]
    return str(entries[0]["lladdr"]) if entries else None


def _fdb_ports(mac: str) -> list[str]:
    """Bridge ports the bridge has learnt `mac` on (its forwarding table)."""
    out = subprocess.run(["bridge", "-j", "fdb", "show", "br", BRIDGE], capture_output=True,
                         text=True, check=True).stdout
    return sorted({e["ifname"] for e in json.loads(out or "[]")
                   if e.get("mac") == mac and "permanent" not in e.get("state", "")})


# ------------------------------------------------------------------ capabilities

RAW_AND_PING = """
import errno, socket, struct
def attempt(family, kind, proto):
    try:
        socket.socket(family, kind, proto).close()
        return "opened"
    except OSError as exc:
        return errno.errorcode[exc.errno]
def ping(address):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP)
    s.settimeout(3)
    s.sendto(struct.pack("!BBHHH", 8, 0, 0, 0, 1) + b"aenv", (address, 0))
    return "reply" if s.recvfrom(1024)[0][0] == 0 else "other"
print("packet", attempt(socket.AF_PACKET, socket.SOCK_RAW, 0x0300))
print("raw", attempt(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_UDP))
for target in ("127.0.0.1", "%s"):
    try:
        print("ping", target, ping(target))
    except OSError as exc:
        print("ping", target, "failed", exc)
try:
    socket.socket().bind(("0.0.0.0", 80))
    print("bind 80 ok")
except OSError as exc:
    print("bind 80", errno.errorcode[exc.errno])
"""


def test_raw_sockets_are_refused_and_ping_still_works(pair: tuple[Peer, Peer],
                                                      outside: OutsideHost) -> None:
    a, _ = pair
    a.sbx.files.write("/tmp/raw.py", RAW_AND_PING % outside.address)
    for user in ("root", "user"):
        code, out, err = run_rc(a.sbx, "python3 /tmp/raw.py", user=user)
        assert code == 0, err
        lines = out.splitlines()
        assert "packet EPERM" in lines and "raw EPERM" in lines, (user, out)
        # Control: ping (ICMP datagram sockets) still works, on loopback and outside.
        assert "ping 127.0.0.1 reply" in lines, (user, out)
        assert f"ping {outside.address} reply" in lines, (user, out)
        # Low ports need no capability either (ip_unprivileged_port_start, as in Docker).
        assert "bind 80 ok" in lines, (user, out)


# ------------------------------------------------------------------ forged packets


def test_forged_packets_do_not_reach_a_neighbour(pair: tuple[Peer, Peer],
                                                 bridge_mac: str) -> None:
    a, b = pair
    token = uuid.uuid4().hex[:8]
    _send_from_host(b, f"control-{token}")
    _received(b, f"control-{token}")  # control: B's listener hears the host
    other = str(ipaddress.IPv4Network(SUBNET).broadcast_address - 1)  # some other sandbox's
    forged = {
        # routed by the host: dst MAC the gateway's, dst IP B's
        "routed-spoofed": udp_frame(a.mac, bridge_mac, other, b.address, UDP_PORT,
                                    f"routed-spoofed-{token}".encode()),
        "routed-own": udp_frame(a.mac, bridge_mac, a.address, b.address, UDP_PORT,
                                f"routed-own-{token}".encode()),
        # switched by the bridge: dst MAC B's, pretending to be the host
        "switched-as-host": udp_frame(a.mac, b.mac, HOST, b.address, UDP_PORT,
                                      f"switched-as-host-{token}".encode()),
        "flooded-as-host": udp_frame(a.mac, BROADCAST, HOST, b.address, UDP_PORT,
                                     f"flooded-as-host-{token}".encode()),
    }
    with packet_socket(a.netns) as raw:
        for _ in range(3):
            for frame in forged.values():
                raw.send(frame)
            time.sleep(0.05)
    _send_from_host(b, f"after-{token}")
    _received(b, f"after-{token}")  # B's listener is alive and has read everything before
    time.sleep(0.5)
    heard = _read(b.sbx, b.log)
    assert not [label for label in forged if f"{label}-{token}" in heard], heard


def test_spoofed_sources_do_not_leave_the_host(pair: tuple[Peer, Peer], outside: OutsideHost,
                                               bridge_mac: str) -> None:
    """Forged sources towards the internet (reflection attacks, or posing as a neighbour to
    a server) are dropped at the sandbox's port; its honest traffic goes out masqueraded."""
    a, b = pair
    listener = in_netns(outside.netns, lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
    with listener:
        listener.bind((outside.address, 0))
        port = listener.getsockname()[1]
        sources = {"honest": a.address, "neighbour": b.address, "internet": "203.0.113.9"}
        with packet_socket(a.netns) as raw:
            for _ in range(3):
                for label, source in sources.items():
                    raw.send(udp_frame(a.mac, bridge_mac, source, outside.address, port,
                                       label.encode()))
        heard: list[tuple[str, bytes]] = []
        listener.settimeout(1.0)
        with contextlib.suppress(TimeoutError):
            while True:
                data, peer = listener.recvfrom(2048)
                heard.append((peer[0], data))
    assert (outside.host_address, b"honest") in heard, heard  # control
    assert {data for _, data in heard} == {b"honest"}, heard


def test_forged_arp_does_not_divert_a_neighbours_traffic(pair: tuple[Peer, Peer],
                                                         bridge_mac: str) -> None:
    a, b = pair
    token = uuid.uuid4().hex[:8]
    _send_from_host(b, f"control-{token}")
    _received(b, f"control-{token}")
    assert _host_neighbour(b.address) == b.mac  # control: the host resolved B's address
    time.sleep(1.2)  # the neighbour table's locktime: an entry changes at most once a second
    claims = [
        # gratuitous ARP: "B's address is at A's MAC", to everyone
        arp_frame(a.mac, BROADCAST, 1, a.mac, b.address, "00:00:00:00:00:00", b.address),
        # unsolicited reply to the host
        arp_frame(a.mac, bridge_mac, 2, a.mac, b.address, bridge_mac, HOST),
        # the same with a made-up ARP sender MAC and A's frame source
        arp_frame(a.mac, bridge_mac, 2, "02:00:00:00:00:99", b.address, bridge_mac, HOST),
    ]
    with packet_socket(a.netns) as raw:
        for _ in range(5):
            for frame in claims:
                raw.send(frame)
            time.sleep(0.2)
        assert _host_neighbour(b.address) == b.mac
        _send_from_host(b, f"after-arp-{token}", count=5)
        seen = frames_seen(raw, 1.0)
    assert not [f for f in seen if f"after-arp-{token}".encode() in f]  # nothing went to A
    _received(b, f"after-arp-{token}")


def test_unicast_to_an_unlearnt_address_is_not_flooded_to_a_sandbox(
        pair: tuple[Peer, Peer]) -> None:
    """The host's frame to an address whose MAC the bridge has not learnt (a slot whose
    index, hence IP and MAC, was used before, while the host's neighbour entry is still
    valid) used to be flooded to every port: A read traffic meant for another sandbox. Now
    ports get no unknown-unicast floods, and each slot's MAC has a static entry."""
    a, _ = pair
    token = uuid.uuid4().hex[:8]
    # An address of the subnet no slot has, with a neighbour entry to a MAC nobody has.
    ghost = str(ipaddress.IPv4Network(SUBNET).broadcast_address - 7)
    subprocess.run(["ip", "neigh", "replace", ghost, "lladdr", "02:ae:00:00:fe:fe", "dev",
                    BRIDGE, "nud", "reachable"], check=True)
    try:
        with packet_socket(a.netns) as raw:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                for _ in range(5):
                    s.sendto(f"ghost-{token}".encode(), (ghost, UDP_PORT))
                    time.sleep(0.05)
            seen = frames_seen(raw, 1.0)
    finally:
        subprocess.run(["ip", "neigh", "del", ghost, "dev", BRIDGE], check=False)
    assert not [f for f in seen if f"ghost-{token}".encode() in f]


def test_spoofed_mac_does_not_capture_a_neighbours_traffic(pair: tuple[Peer, Peer],
                                                           bridge_mac: str) -> None:
    a, b = pair
    token = uuid.uuid4().hex[:8]
    _send_from_host(b, f"control-{token}")
    _received(b, f"control-{token}")
    assert _fdb_ports(b.mac) == [b.port]  # control: the bridge knows B's MAC on B's port
    with packet_socket(a.netns) as raw:
        for _ in range(5):  # frames "from B" out of A's port: the bridge would learn them
            raw.send(udp_frame(b.mac, BROADCAST, b.address, HOST, 9, b"x"))
            raw.send(udp_frame(b.mac, bridge_mac, b.address, HOST, 9, b"x"))
            time.sleep(0.1)
        assert _fdb_ports(b.mac) == [b.port]
        _send_from_host(b, f"after-mac-{token}", count=5)
        seen = frames_seen(raw, 1.0)
    assert not [f for f in seen if f"after-mac-{token}".encode() in f]
    _received(b, f"after-mac-{token}")


# ------------------------------------------------------------------ the host and neighbours

CONNECT = """
import socket, sys, time
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    t0 = time.monotonic()
    try:
        socket.create_connection((host, int(port)), 3).close()
        print(target, "connected")
    except OSError as exc:
        print(target, type(exc).__name__, round(time.monotonic() - t0, 2))
"""


def _connect_from(peer: Peer, *targets: str) -> dict[str, list[str]]:
    peer.sbx.files.write("/tmp/connect.py", CONNECT)
    code, out, err = run_rc(peer.sbx, "python3 /tmp/connect.py " + " ".join(targets),
                            user="user")
    assert code == 0, err
    return {line.split()[0]: line.split()[1:] for line in out.splitlines()}


def test_host_services_are_unreachable_from_a_sandbox(pair: tuple[Peer, Peer],
                                                      outside: OutsideHost) -> None:
    a, _ = pair
    with tcp_service() as on_host, \
            tcp_service(lambda: in_netns(outside.netns, tcp_listener)) as on_outside:
        # Control: the service answers on the host itself at the gateway address.
        socket.create_connection((HOST, on_host.port), 2).close()
        gateway, other = f"{HOST}:{on_host.port}", f"{outside.host_address}:{on_host.port}"
        internet = f"{outside.address}:{on_outside.port}"
        result = _connect_from(a, gateway, other, internet)
        # Control: A reaches the outside host, masqueraded behind the host's address there.
        assert result[internet] == ["connected"], result
        assert on_outside.peers == [outside.host_address]
        for target in (gateway, other):
            assert result[target][0] == "ConnectionRefusedError", result  # fast, not a hang
            assert float(result[target][1]) < 1.0, result
        # The control's connection only (other processes on this host may probe the port).
        assert HOST in on_host.peers and a.address not in on_host.peers, on_host.peers


def test_neighbours_cannot_reach_each_other(pair: tuple[Peer, Peer]) -> None:
    a, b = pair
    with tcp_service(lambda: in_netns(b.netns, tcp_listener)) as on_b:
        socket.create_connection((b.address, on_b.port), 2).close()  # control: from the host
        result = _connect_from(a, f"{b.address}:{on_b.port}")
        assert result[f"{b.address}:{on_b.port}"][0] != "connected", result
        assert HOST in on_b.peers and a.address not in on_b.peers, on_b.peers
