"""Networks of qemu sandboxes: one network namespace per VM, with a tap device in it.

Every VM runs (its QEMU process is started) inside a network namespace of its own, where a tap
device `aenvtap` (192.0.2.1/30) faces the guest's eth0 (always 192.0.2.2/30). Because the
guest's address never changes, a VM restored from a snapshot or resumed needs no network
reconfiguration: it gets a *new namespace* with the same inside addresses.
- internet access: the namespace is a slot of the container runtime's `NetworkPool` (veth
  into the host bridge `aenv0`, its own 10.88.x.y); nftables in the namespace masquerades the
  guest behind that address, and the host's rules (NAT out, no slot-to-slot traffic, no host
  address, frames bound to the slot's own MAC and address) apply: the guest's root has raw
  sockets in its own kernel, but whatever it forges leaves through the slot's bridge port.
- no internet access: a bare namespace (/run/aenv/vmnet/<id>) with only the tap: the guest
  reaches nothing but its own side of it.
The host reaches the guest (`connect`) by creating a socket inside that namespace.
192.0.2.0/24 is TEST-NET-1 (RFC 5737): never a real destination the guest might want.

Owns: the tap devices and nftables table `ip aenvvm` inside VM namespaces, the namespace
files under /run/aenv/vmnet/.
Must not touch: the host's own interfaces and tables (the shared `NetworkPool` does those).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from aenv.errors import AenvError, ErrorCode
from aenv.runtime.container import linux
from aenv.runtime.container.network import NetworkPool
from aenv.runtime.qemu.images import run

VMNET_DIR = Path("/run/aenv/vmnet")
TAP = "aenvtap"
HOST_SIDE = "192.0.2.1"
GUEST_ADDRESS = "192.0.2.2"
PREFIX = 30
GUEST_MAC = "52:54:00:00:02:02"
# Fixed, so that a resumed or restored guest's ARP entry for its gateway stays right in the
# new namespace's new tap.
TAP_MAC = "52:54:00:00:02:01"

_TAP_SETUP = (f"ip tuntap add dev {TAP} mode tap vnet_hdr && "
              f"ip link set {TAP} address {TAP_MAC} && "
              f"ip addr add {HOST_SIDE}/{PREFIX} dev {TAP} && ip link set {TAP} up && "
              "ip link set lo up")
_NAT = f"""
table ip aenvvm {{
    chain postrouting {{
        type nat hook postrouting priority srcnat; policy accept;
        ip saddr {GUEST_ADDRESS} oifname "eth0" masquerade
    }}
}}
"""


@dataclass(frozen=True)
class VmNet:
    """Where a VM's QEMU runs and how to reach the guest."""

    netns: Path  # nsfs bind mount: nsenter --net=<it>, or open + setns
    slot: str | None  # the NetworkPool slot name (internet access), else None

    def to_data(self) -> dict[str, str | None]:
        return {"netns": str(self.netns), "slot": self.slot}


class VmNetworks:
    """Makes and removes VM namespaces. One per driver; the pool is shared with nothing."""

    def __init__(self, pool: NetworkPool, vmnet_dir: Path = VMNET_DIR) -> None:
        self.pool = pool
        self.vmnet_dir = vmnet_dir
        self._pool_started = False
        self._lock = asyncio.Lock()

    async def _ensure_pool(self) -> None:
        async with self._lock:
            if not self._pool_started:
                await self.pool.start()
                self._pool_started = True

    async def close(self) -> None:
        if self._pool_started:
            await self.pool.close()
            self._pool_started = False

    async def acquire(self, sandbox_id: str, internet: bool) -> VmNet:
        if internet:
            await self._ensure_pool()
            slot = await self.pool.acquire()
            try:
                await run("nsenter", f"--net={slot.path}", "sh", "-c",
                          f"{_TAP_SETUP} && echo 1 > /proc/sys/net/ipv4/ip_forward && "
                          "nft -f - <<'EOF'\n" + _NAT + "EOF\n")
            except BaseException:
                await self.pool.release(slot.name)
                raise
            return VmNet(slot.path, slot.name)
        self.vmnet_dir.mkdir(parents=True, exist_ok=True)
        path = self.vmnet_dir / sandbox_id
        with contextlib.suppress(FileNotFoundError):
            await asyncio.to_thread(_unpin, path)
        path.touch()
        try:
            await run("unshare", f"--net={path}", "sh", "-c", _TAP_SETUP)
        except BaseException:
            await asyncio.to_thread(_unpin, path)
            raise
        return VmNet(path, None)

    async def claim(self, data: dict[str, object]) -> None:
        """A re-attached VM keeps its slot (after a server restart)."""
        slot = data.get("slot")
        if isinstance(slot, str) and slot:
            await self._ensure_pool()
            self.pool.claim(slot)

    async def release(self, data: dict[str, object]) -> None:
        """Delete a VM's namespace (its QEMU must be gone). Idempotent."""
        slot = data.get("slot")
        if isinstance(slot, str) and slot:
            await self._ensure_pool()
            with contextlib.suppress(AenvError):
                await self.pool.release(slot)
            return
        netns = data.get("netns")
        if isinstance(netns, str) and netns.startswith(str(self.vmnet_dir)):
            await asyncio.to_thread(_unpin, Path(netns))


def _unpin(path: Path) -> None:
    with contextlib.suppress(OSError):
        linux.umount2(str(path), linux.MNT_DETACH)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def open_netns(path: str) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise AenvError(ErrorCode.UNAVAILABLE, f"network namespace {path} is gone") from None
