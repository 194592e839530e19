"""Networking of microVMs: every microVM runs in a network namespace of its own, holding a
TAP device `fc0` (host side 172.16.0.1/30) and the guest at 172.16.0.2. Every microVM sees
the same addresses, so a snapshot restores anywhere without network overrides (the layout
Firecracker's snapshot documentation recommends for clones).

With internet access the namespace is a slot of the container runtime's `NetworkPool` (veth
`eth0` on the host bridge, masqueraded by the host), and the namespace itself forwards and
masquerades the guest's traffic out of `eth0`. Without, it is a namespace made here
(`ip netns add aenvfc-<sandbox id>`) with no way out.

Owns: the namespaces `/run/netns/aenvfc-*`, the TAP devices and nftables table `ip aenvfc`
inside microVM namespaces, the pool slots it took.
Must not touch: the host's own interfaces, routes and tables (the pool owns the bridge).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from aenv.errors import AenvError, ErrorCode
from aenv.runtime.container import linux
from aenv.runtime.container.network import NetworkPool

TAP = "fc0"
HOST_ADDRESS = "172.16.0.1"
GUEST_ADDRESS = "172.16.0.2"
GUEST_MAC = "06:00:ac:10:00:02"
PRIVATE_NETNS_DIR = Path("/run/netns")
PRIVATE_PREFIX = "aenvfc-"


@dataclass(frozen=True)
class VmNet:
    netns: str | None  # nsfs path the microVM's process runs in (None: the caller's own)
    slot: str | None = None  # NetworkPool slot name, when the namespace is a pool slot

    def to_data(self) -> dict[str, str | None]:
        return {"netns": self.netns, "slot": self.slot}


# The guest's default route, as the VM initramfs reads it from the kernel command line.
GATEWAY_ARG = f"aenv.gw={HOST_ADDRESS}"


class VmNetworks(Protocol):
    """What the driver needs from networking (a fake stands in for it in unit tests)."""

    async def start(self) -> None: ...
    async def close(self) -> None: ...
    async def acquire(self, sandbox_id: str, internet: bool) -> VmNet: ...
    def claim(self, net: VmNet) -> None: ...
    async def release(self, net: VmNet) -> None: ...
    async def connect(self, net: VmNet, port: int, timeout: float) -> socket.socket: ...


async def _sh(netns: str, script: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        "nsenter", f"--net={netns}", "--", "/bin/sh", "-ec", script,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _, err = await proc.communicate()
    if proc.returncode != 0:
        raise AenvError(ErrorCode.INTERNAL,
                        f"network in {netns}: {err.decode(errors='replace').strip()}")


_TAP_SCRIPT = f"""
ip link set lo up
ip tuntap add dev {TAP} mode tap
ip addr add {HOST_ADDRESS}/30 dev {TAP}
ip link set {TAP} up
"""

_NAT_SCRIPT = f"""
echo 1 > /proc/sys/net/ipv4/ip_forward
nft -f - <<'EOF'
table ip aenvfc {{
    chain postrouting {{
        type nat hook postrouting priority srcnat; policy accept;
        ip saddr {GUEST_ADDRESS} oifname "eth0" masquerade
    }}
}}
EOF
"""


class TapNetworks:
    """The real `VmNetworks`. Holds the host's network namespace fd (for `connect`)."""

    def __init__(self, pool: NetworkPool) -> None:
        self.pool = pool
        self._host_netns = -1

    async def start(self) -> None:
        if self._host_netns < 0:
            self._host_netns = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)

    async def close(self) -> None:
        await self.pool.close()
        if self._host_netns >= 0:
            os.close(self._host_netns)
            self._host_netns = -1

    async def acquire(self, sandbox_id: str, internet: bool) -> VmNet:
        if internet:
            await self.pool.start()
            slot = await self.pool.acquire()
            net = VmNet(str(slot.path), slot.name)
            script = _TAP_SCRIPT + _NAT_SCRIPT
        else:
            name = PRIVATE_PREFIX + sandbox_id
            proc = await asyncio.create_subprocess_exec(
                "ip", "netns", "add", name, stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE)
            _, err = await proc.communicate()
            if proc.returncode != 0:
                raise AenvError(ErrorCode.INTERNAL,
                                f"ip netns add {name}: {err.decode(errors='replace').strip()}")
            net = VmNet(str(PRIVATE_NETNS_DIR / name))
            script = _TAP_SCRIPT
        try:
            assert net.netns is not None
            await _sh(net.netns, script)
        except BaseException:
            await self.release(net)
            raise
        return net

    def claim(self, net: VmNet) -> None:
        if net.slot:
            self.pool.claim(net.slot)

    async def release(self, net: VmNet) -> None:
        """After the microVM's process is gone: the namespace (and its TAP) goes away."""
        if net.slot:
            await self.pool.release(net.slot)
        elif net.netns and Path(net.netns).parent == PRIVATE_NETNS_DIR:
            proc = await asyncio.create_subprocess_exec(
                "ip", "netns", "delete", Path(net.netns).name,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
            await proc.wait()

    async def connect(self, net: VmNet, port: int, timeout: float) -> socket.socket:
        """A connected non-blocking socket to the guest's `port`, made in the microVM's
        namespace (setns for this thread, create, back: no await in between)."""
        if net.netns is None:
            raise AenvError(ErrorCode.UNAVAILABLE, "microVM has no network namespace")
        fd = os.open(net.netns, os.O_RDONLY | os.O_CLOEXEC)
        try:
            linux.setns(fd, linux.CLONE_NEWNET)
            try:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            finally:
                linux.setns(self._host_netns, linux.CLONE_NEWNET)
        finally:
            os.close(fd)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            await asyncio.wait_for(asyncio.get_running_loop().sock_connect(
                sock, (GUEST_ADDRESS, port)), timeout)
        except BaseException:
            with contextlib.suppress(OSError):
                sock.close()
            raise
        return sock
