"""A minimal rtnetlink client: the few link, address, route and bridge-port operations network
slots need, without running `ip` (a process per step costs milliseconds; a netlink message,
microseconds).

Owns: nothing; each `Netlink` is a socket bound to the network namespace of the thread that
created it, and every method is one request answered by one acknowledgement.
Must not touch: anything it is not asked to.
"""

from __future__ import annotations

import os
import socket
import struct
from types import TracebackType
from typing import Self

NETLINK_ROUTE = 0
RTM_NEWLINK, RTM_DELLINK, RTM_SETLINK, RTM_NEWADDR, RTM_NEWROUTE = 16, 17, 19, 20, 24
RTM_NEWNEIGH = 28
NDA_LLADDR, NTF_MASTER, NUD_NOARP = 2, 0x04, 0x40  # <linux/neighbour.h>
NLMSG_ERROR = 2
NLM_F_REQUEST, NLM_F_ACK, NLM_F_EXCL, NLM_F_CREATE = 0x1, 0x4, 0x200, 0x400
NLM_F_REPLACE = 0x100
IFLA_ADDRESS, IFLA_IFNAME, IFLA_MASTER, IFLA_PROTINFO, IFLA_LINKINFO = 1, 3, 10, 12, 18
IFLA_NET_NS_FD = 28
IFLA_BRPORT_ISOLATED = 33  # <linux/if_link.h>: the port talks to non-isolated ports only
IFLA_BRPORT_UNICAST_FLOOD = 9  # frames to an unknown MAC are (not) flooded to the port
NLA_F_NESTED = 0x8000
AF_BRIDGE = 7
IFLA_INFO_KIND, IFLA_INFO_DATA, VETH_INFO_PEER = 1, 2, 1
IFA_ADDRESS, IFA_LOCAL = 1, 2
RTA_GATEWAY = 5
RT_TABLE_MAIN, RTPROT_BOOT, RT_SCOPE_UNIVERSE, RTN_UNICAST = 254, 3, 0, 1
IFF_UP = 0x1

_NLMSGHDR = struct.Struct("=IHHII")
_IFINFOMSG = struct.Struct("=BxHiII")
_IFADDRMSG = struct.Struct("=BBBBi")
_RTMSG = struct.Struct("=BBBBBBBBI")
_NDMSG = struct.Struct("=BxxxiHBB")


def _attr(kind: int, data: bytes) -> bytes:
    length = 4 + len(data)
    return struct.pack("=HH", length, kind) + data + b"\0" * ((4 - length % 4) % 4)


def _ifinfo(index: int = 0, flags: int = 0, change: int = 0,
            family: int = socket.AF_UNSPEC) -> bytes:
    return _IFINFOMSG.pack(family, 0, index, flags, change)


def mac_bytes(mac: str) -> bytes:
    return bytes(int(part, 16) for part in mac.split(":"))


class Netlink:
    """rtnetlink requests in the network namespace current when the object was made."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC,
                                  NETLINK_ROUTE)
        self.sock.bind((0, 0))
        self.seq = 0

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def request(self, msg_type: int, payload: bytes, flags: int = 0) -> None:
        """Send one request and wait for its acknowledgement; OSError on a kernel error."""
        self.seq += 1
        header = _NLMSGHDR.pack(_NLMSGHDR.size + len(payload), msg_type,
                                NLM_F_REQUEST | NLM_F_ACK | flags, self.seq, 0)
        self.sock.send(header + payload)
        while True:
            data = self.sock.recv(65536)
            offset = 0
            while offset + _NLMSGHDR.size <= len(data):
                length, kind, _, seq, _ = _NLMSGHDR.unpack_from(data, offset)
                if kind == NLMSG_ERROR and seq == self.seq:
                    (code,) = struct.unpack_from("=i", data, offset + _NLMSGHDR.size)
                    if code:
                        raise OSError(-code, f"netlink: {os.strerror(-code)}")
                    return
                offset += max((length + 3) & ~3, _NLMSGHDR.size)

    # -- links ------------------------------------------------------------------------
    def add_veth(self, name: str, peer: str, peer_netns_fd: int, peer_index: int = 0,
                 peer_mac: str | None = None) -> None:
        """A veth pair: `name` here, `peer` (with ifindex `peer_index` if non-zero, MAC
        address `peer_mac` if given) in the namespace of `peer_netns_fd`."""
        peer_msg = (_ifinfo(peer_index) + _attr(IFLA_IFNAME, peer.encode() + b"\0")
                    + _attr(IFLA_NET_NS_FD, struct.pack("=I", peer_netns_fd)))
        if peer_mac is not None:
            peer_msg += _attr(IFLA_ADDRESS, mac_bytes(peer_mac))
        info = _attr(IFLA_INFO_KIND, b"veth\0") + _attr(
            IFLA_INFO_DATA, _attr(VETH_INFO_PEER, peer_msg))
        self.request(RTM_NEWLINK, _ifinfo() + _attr(IFLA_IFNAME, name.encode() + b"\0")
                     + _attr(IFLA_LINKINFO, info), NLM_F_CREATE | NLM_F_EXCL)

    def set_link(self, index: int, up: bool | None = None, master: int | None = None,
                 mac: str | None = None) -> None:
        flags = IFF_UP if up else 0
        change = IFF_UP if up is not None else 0
        attrs = _attr(IFLA_MASTER, struct.pack("=I", master)) if master is not None else b""
        if mac is not None:
            attrs += _attr(IFLA_ADDRESS, mac_bytes(mac))
        self.request(RTM_NEWLINK, _ifinfo(index, flags, change) + attrs)

    def isolate_bridge_port(self, index: int) -> None:
        """Mark bridge port `index` isolated (`bridge link set dev X isolated on`): the bridge
        forwards nothing between two isolated ports, floods included; the bridge device
        itself (the host) still talks to it. The port must already have its master."""
        protinfo = _attr(IFLA_BRPORT_ISOLATED, b"\1")
        self.request(RTM_SETLINK, _ifinfo(index, family=AF_BRIDGE)
                     + _attr(IFLA_PROTINFO | NLA_F_NESTED, protinfo))

    def guard_bridge_port(self, index: int, mac: str) -> None:
        """Bridge port `index` (its master set) gets no unknown-unicast floods, and a static
        forwarding entry for `mac` (the one address it may use), so frames to it are
        delivered before it has sent any: the bridge never has to flood a neighbour's
        unicast (to a MAC it has not learnt yet, e.g. a new slot reusing an index) to it.
        (`bridge link set dev X flood off`; `bridge fdb add MAC dev X master static`.)"""
        protinfo = _attr(IFLA_BRPORT_UNICAST_FLOOD, b"\0")
        self.request(RTM_SETLINK, _ifinfo(index, family=AF_BRIDGE)
                     + _attr(IFLA_PROTINFO | NLA_F_NESTED, protinfo))
        self.request(RTM_NEWNEIGH, _NDMSG.pack(AF_BRIDGE, index, NUD_NOARP, NTF_MASTER, 0)
                     + _attr(NDA_LLADDR, mac_bytes(mac)), NLM_F_CREATE | NLM_F_REPLACE)

    def delete_link(self, index: int) -> None:
        self.request(RTM_DELLINK, _ifinfo(index))

    # -- addresses and routes -----------------------------------------------------------
    def add_address(self, index: int, address: str, prefixlen: int) -> None:
        raw = socket.inet_aton(address)
        self.request(RTM_NEWADDR, _IFADDRMSG.pack(socket.AF_INET, prefixlen, 0,
                                                  RT_SCOPE_UNIVERSE, index)
                     + _attr(IFA_LOCAL, raw) + _attr(IFA_ADDRESS, raw),
                     NLM_F_CREATE | NLM_F_EXCL)

    def add_default_route(self, gateway: str) -> None:
        self.request(RTM_NEWROUTE, _RTMSG.pack(socket.AF_INET, 0, 0, 0, RT_TABLE_MAIN,
                                               RTPROT_BOOT, RT_SCOPE_UNIVERSE, RTN_UNICAST, 0)
                     + _attr(RTA_GATEWAY, socket.inet_aton(gateway)),
                     NLM_F_CREATE | NLM_F_EXCL)


def ifindex(name: str) -> int:
    """Index of an interface in the calling thread's network namespace, or 0."""
    try:
        return socket.if_nametoindex(name)
    except OSError:
        return 0
