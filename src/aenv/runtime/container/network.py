"""Outside network for container sandboxes: a pool of pre-made network namespaces ("slots").

A slot is a named network namespace (a bind-mounted nsfs file `/run/aenv/netns/s<N>.<pid>`)
holding `eth0` with 10.88.x.y/16 and a default route via the host bridge `aenv0` (10.88.0.1),
joined through a veth pair whose host end `aenvh<N>` is a bridge port. nftables masquerades
the subnet towards the host's other interfaces. Slots are made ahead of time, off the create
path (with netlink, a few ms each; with no warm slot left, a create makes its own); a sandbox
with internet access setns()es into a slot instead of keeping a fresh loopback-only
namespace. Slots are never reused: a released slot is deleted and the pool refilled.

Owns: the bridge `aenv0`, the nftables tables `ip aenv` and `bridge aenv`, veths `aenvh*`,
the files under /run/aenv/netns/, the ip_forward sysctl (turned on).
Must not touch: other interfaces, routes or firewall tables of the host.
Never sends traffic itself; IPv6 is disabled on every interface it makes (no router
solicitations or DAD probes leave a slot).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import ipaddress
import os
import subprocess
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from aenv.errors import AenvError, ErrorCode
from aenv.runtime.container import linux
from aenv.runtime.container.netlink import Netlink, ifindex

NETNS_DIR = Path("/run/aenv/netns")
VETH_PREFIX = "aenvh"


@dataclass(frozen=True)
class Slot:
    index: int  # unique on the host: the address and the veth name derive from it
    path: Path  # the nsfs bind mount `s<index>.<owner pid>`: open it and setns(CLONE_NEWNET)
    address: str  # the sandbox's IPv4 address on the bridge subnet

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def owner(self) -> int:
        return int(self.path.name.split(".")[1])


def _run(*argv: str, stdin: str | None = None) -> None:
    proc = subprocess.run(argv, input=stdin, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise AenvError(ErrorCode.INTERNAL,
                        f"network: `{' '.join(argv)}` failed: {proc.stderr.strip()}")


def _disable_ipv6(ifname: str) -> None:
    path = Path(f"/proc/sys/net/ipv6/conf/{ifname}/disable_ipv6")
    if path.exists():
        path.write_text("1")


# Every pool of this process (tests run several drivers in one): a slot named after our pid
# that one of them holds is not abandoned, even while no process is inside it yet.
_POOLS: weakref.WeakSet[NetworkPool] = weakref.WeakSet()


class NetworkPool:
    """Pre-made network slots. One instance per driver; all state lives here."""

    def __init__(self, bridge: str = "aenv0", subnet: str = "10.88.0.0/16", warm: int = 4,
                 netns_dir: Path = NETNS_DIR, idle: Callable[[], bool] = lambda: True) -> None:
        self.bridge = bridge
        self.subnet = ipaddress.IPv4Network(subnet)
        self.host_address = str(self.subnet.network_address + 1)
        self.warm = warm
        self.netns_dir = netns_dir
        # Refills wait while this says creates are in flight: making a slot takes the kernel's
        # rtnl lock and CPU that a burst of creates needs more.
        self.idle = idle
        self._free: list[Slot] = []
        self._used: dict[str, Slot] = {}
        self._making = 0
        self._refill: asyncio.Task[None] | None = None
        self._started = False
        _POOLS.add(self)

    # -- addressing ---------------------------------------------------------------------
    def _slot(self, index: int, owner: int) -> Slot:
        # .0 is the network, .1 the host: slot N gets network + N + 2.
        address = self.subnet.network_address + index + 2
        if address >= self.subnet.broadcast_address:
            raise AenvError(ErrorCode.RESOURCE_EXHAUSTED, "network: no free addresses")
        return Slot(index, self.netns_dir / f"s{index}.{owner}", str(address))

    def slot_by_name(self, name: str) -> Slot:
        index, _, owner = name.partition(".")
        if not index.startswith("s") or not index[1:].isdigit() or not owner.isdigit():
            raise AenvError(ErrorCode.INVALID_ARGUMENT, f"network: bad slot name {name!r}")
        return self._slot(int(index[1:]), int(owner))

    def _reserve(self) -> Slot:
        """Pick the lowest index no slot file on the host uses and create its file. Several
        servers (tests) may share the host, so the choice is made under a file lock."""
        self.netns_dir.mkdir(parents=True, exist_ok=True)
        with open(self.netns_dir / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            taken = {entry.name.partition(".")[0] for entry in self.netns_dir.iterdir()}
            index = 0
            # A deleted slot's veth lingers until the kernel has torn its namespace down.
            while f"s{index}" in taken or ifindex(f"{VETH_PREFIX}{index}"):
                index += 1
            slot = self._slot(index, os.getpid())
            slot.path.touch()
        return slot

    # -- host setup (blocking; run in a thread) ------------------------------------------
    def _setup_host(self) -> None:
        self.netns_dir.mkdir(parents=True, exist_ok=True)
        if not Path(f"/sys/class/net/{self.bridge}").exists():
            _run("ip", "link", "add", self.bridge, "type", "bridge")
        _disable_ipv6(self.bridge)
        prefix = f"{self.host_address}/{self.subnet.prefixlen}"
        out = subprocess.run(["ip", "-4", "-o", "addr", "show", "dev", self.bridge],
                             capture_output=True, text=True, check=False).stdout
        if prefix not in out:
            _run("ip", "addr", "add", prefix, "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        Path("/proc/sys/net/ipv4/ip_forward").write_text("1")
        # Replace our tables atomically (add+delete makes the script idempotent).
        ruleset = f"""
add table ip aenv
delete table ip aenv
table ip aenv {{
    chain postrouting {{
        type nat hook postrouting priority srcnat; policy accept;
        ip saddr {self.subnet} oifname != "{self.bridge}" masquerade
    }}
    chain forward {{
        type filter hook forward priority filter; policy accept;
        iifname "{self.bridge}" ip daddr 169.254.0.0/16 drop
    }}
}}
add table bridge aenv
delete table bridge aenv
table bridge aenv {{
    chain forward {{
        type filter hook forward priority filter; policy accept;
        iifname "{VETH_PREFIX}*" oifname "{VETH_PREFIX}*" drop
    }}
}}
"""
        # The bridge table keeps sandboxes from reaching each other: only the host (and,
        # through it, NAT) is reachable from a slot.
        _run("nft", "-f", "-", stdin=ruleset)

    def _make_slot(self) -> Slot:
        """Blocking (a worker thread): ~2 ms of netlink, no subprocess."""
        slot = self._reserve()
        veth = f"{VETH_PREFIX}{slot.index}"
        host_ns = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        inner: Netlink | None = None
        ns_fd = -1
        try:
            # A new namespace for this thread only, pinned by a bind mount of its nsfs file;
            # the thread returns to the host's namespace right after.
            linux.unshare(linux.CLONE_NEWNET)
            try:
                linux.mount("/proc/thread-self/ns/net", str(slot.path), None, linux.MS_BIND)
                for conf in ("all", "default"):  # per-namespace sysctls: no IPv6 at all
                    _disable_ipv6(conf)
                inner = Netlink()  # bound to the slot's namespace for good
            finally:
                linux.setns(host_ns, linux.CLONE_NEWNET)
            ns_fd = os.open(slot.path, os.O_RDONLY | os.O_CLOEXEC)
            bridge = ifindex(self.bridge)
            with Netlink() as host:
                host.add_veth(veth, "eth0", ns_fd, peer_index=2)  # lo is 1
                _disable_ipv6(veth)
                host.set_link(ifindex(veth), up=True, master=bridge)
            inner.set_link(1, up=True)
            inner.add_address(2, slot.address, self.subnet.prefixlen)
            inner.set_link(2, up=True)
            inner.add_default_route(self.host_address)
        except BaseException as exc:
            self._delete_slot(slot)
            if isinstance(exc, OSError):
                raise AenvError(ErrorCode.INTERNAL, f"network: slot {slot.name}: {exc}") from exc
            raise
        finally:
            os.close(host_ns)
            if ns_fd >= 0:
                os.close(ns_fd)
            if inner is not None:
                inner.close()
        return slot

    def _delete_slot(self, slot: Slot) -> None:
        """Unpin the namespace. The kernel destroys it once no process is inside, and its
        veth pair with it, batched with other dying namespaces: far cheaper than deleting
        each veth, which holds the rtnl lock (blocking every create) for an RCU period."""
        with contextlib.suppress(OSError):
            linux.umount2(str(slot.path), linux.MNT_DETACH)
        with contextlib.suppress(FileNotFoundError):
            slot.path.unlink()

    def _scan_existing(self) -> tuple[list[Slot], list[Slot]]:
        """Slots on the host: (in use by live processes, abandoned). Unused slots of another
        live server are neither."""
        if not self.netns_dir.is_dir():
            return [], []
        inodes: dict[int, Slot] = {}
        for entry in self.netns_dir.iterdir():
            try:
                slot = self.slot_by_name(entry.name)
                inodes[entry.stat().st_ino] = slot
            except (AenvError, OSError):
                continue
        live: set[int] = set()
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                with contextlib.suppress(OSError):
                    live.add(os.stat(f"/proc/{pid}/ns/net").st_ino)
        held = {name for pool in list(_POOLS)
                for name in (*pool._used, *(s.name for s in pool._free))}
        used = [slot for ino, slot in inodes.items() if ino in live]
        abandoned = [slot for ino, slot in inodes.items() if ino not in live
                     and slot.name not in held
                     and (slot.owner == os.getpid() or not Path(f"/proc/{slot.owner}").exists())]
        return used, abandoned

    # -- async API ------------------------------------------------------------------------
    async def start(self) -> None:
        if self._started:
            return
        await asyncio.to_thread(self._setup_host)
        _, abandoned = await asyncio.to_thread(self._scan_existing)
        # Slots in use belong to sandboxes that outlived a server: attach() claims them and
        # destroy() releases them.
        for slot in abandoned:
            await asyncio.to_thread(self._delete_slot, slot)
        self._started = True
        self._kick()

    async def close(self) -> None:
        """Delete the warm (unassigned) slots; slots of live sandboxes stay."""
        self._started = False
        if self._refill is not None:
            self._refill.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refill
        free, self._free = self._free, []
        for slot in free:
            await asyncio.to_thread(self._delete_slot, slot)

    async def teardown(self) -> None:
        """Remove the bridge and nftables tables, if no slot is in use (tests, uninstall)."""
        await self.close()
        if self._used or any(p.name.startswith("s") for p in self.netns_dir.glob("s*")):
            return

        def _down() -> None:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, check=False)
            subprocess.run(["nft", "delete", "table", "ip", "aenv"], capture_output=True,
                           check=False)
            subprocess.run(["nft", "delete", "table", "bridge", "aenv"], capture_output=True,
                           check=False)

        await asyncio.to_thread(_down)

    def _kick(self) -> None:
        if self._started and (self._refill is None or self._refill.done()):
            self._refill = asyncio.get_running_loop().create_task(self._fill())

    async def _fill(self) -> None:
        while self._started and len(self._free) + self._making < self.warm:
            if not self.idle():
                await asyncio.sleep(0.02)
                continue
            self._making += 1
            try:
                slot = await asyncio.to_thread(self._make_slot)
            except AenvError:
                return  # retried on the next acquire
            finally:
                self._making -= 1
            self._free.append(slot)

    async def acquire(self) -> Slot:
        """A ready slot; made on the spot when the pool is empty (tens of ms)."""
        slot = self._free.pop(0) if self._free else await asyncio.to_thread(self._make_slot)
        self._used[slot.name] = slot
        self._kick()
        return slot

    def claim(self, name: str) -> None:
        """Mark a slot as used by a re-attached sandbox."""
        self._used[name] = self.slot_by_name(name)

    async def release(self, name: str) -> None:
        """Delete the slot of a destroyed sandbox (its processes must be gone). Slots are
        never reused: a fresh namespace carries no state of a previous sandbox."""
        slot = self._used.pop(name, None) or self.slot_by_name(name)
        await asyncio.to_thread(self._delete_slot, slot)
        self._kick()
