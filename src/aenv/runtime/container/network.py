"""Outside network for container sandboxes: a pool of pre-made network namespaces ("slots").

A slot is a named network namespace (a bind-mounted nsfs file `/run/aenv/netns/s<N>.<pid>`)
holding `eth0` with 10.88.x.y/16 and a default route via the host bridge `aenv0` (10.88.0.1),
joined through a veth pair whose host end `aenvh<N>` is a bridge port. nftables masquerades
the subnet towards the host's other interfaces. Slots are made ahead of time, off the create
path (with netlink, a few ms each; with no warm slot left, a create makes its own); a sandbox
with internet access setns()es into a slot instead of keeping a fresh loopback-only
namespace. Slots are never reused: a released slot is deleted and the pool refilled.

Sandbox code is hostile, so a slot is a port that can only speak for itself:
- `eth0` gets a MAC derived from the slot's index, and the set `bridge aenv ports` holds one
  element (host port `aenvh<N>` . that MAC . the slot's address) per slot, added when the slot
  is made and removed when it goes: frames entering the bridge from a port must be IPv4 or ARP
  with exactly that source MAC and IP (no spoofed source, no forged ARP, no other ethertype,
  so nothing poisons the host's neighbour table or the bridge's forwarding table). The rule
  count is fixed; a change is one set update, atomic.
- ports are bridge-isolated and the bridge table drops port-to-port frames; `ip aenv` drops
  packets the host would route from the bridge back into it: no path between two sandboxes.
- `ip aenv` input: a sandbox reaches no host address (the bridge's or any other: the input
  hook sees exactly the packets addressed to the host), except replies on connections the
  host opened and DNS to a resolver the host serves itself; the host sends no ICMP redirects.
- per slot, `net.ipv4.ping_group_range` lets every group open ICMP datagram sockets, so ping
  works without CAP_NET_RAW (which sandboxes do not get), and `ip_unprivileged_port_start` is
  0, as in Docker: binding port 80 needs no capability (none is held over a host-made netns
  from inside a user namespace).

Egress policies (E2B's allowOut/denyOut) hang off this table: the maps `egress`/`egress_nat`,
the set `egress_proxy_ports` and the base chains `egress_*` are declared here; the per-slot
sets and chains they lead to are `egress.py`'s, removed here with their slot.

Owns: the bridge `aenv0` (and its fixed MAC), the nftables tables `ip aenv` and `bridge aenv`,
veths `aenvh*`, the files under /run/aenv/netns/, the ip_forward sysctl (turned on).
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
import socket
import struct
import subprocess
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from aenv.errors import AenvError, ErrorCode
from aenv.runtime import etc_files
from aenv.runtime.container import egress, linux
from aenv.runtime.container.netlink import Netlink, ifindex
from aenv.runtime.container.nft import Nft

NETNS_DIR = Path("/run/aenv/netns")
VETH_PREFIX = "aenvh"
# Every group may open ICMP datagram sockets (ping without CAP_NET_RAW), as Docker sets it.
PING_GROUP_RANGE = "0 2147483647"
# The bridge's own MAC, set once: left unset, a bridge takes the lowest MAC of its ports and
# changes it whenever that port goes, leaving every sandbox's neighbour entry for the gateway
# pointing at an address nobody answers to until it is resolved again (tens of seconds).
# Outside the slots' range (02:ae + a 32-bit index below 2^16).
BRIDGE_MAC = "02:ae:ff:00:00:01"
_SIOCGIFHWADDR = 0x8927


def slot_mac(index: int) -> str:
    """The MAC of slot `index`'s eth0: locally administered unicast (02:...), unique on the
    host as the index is. Derived, not random, so a set element for an index is always right
    whoever made it (several servers share a host)."""
    return "02:ae:" + ":".join(f"{byte:02x}" for byte in index.to_bytes(4, "big"))


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

    @property
    def veth(self) -> str:
        """The host end of its veth pair, a port of the bridge."""
        return f"{VETH_PREFIX}{self.index}"

    @property
    def mac(self) -> str:
        return slot_mac(self.index)


def _port_element(veth: str, mac: str, address: str) -> str:
    return f'{{ "{veth}" . {mac} . {address} }}'


def _read_eth0_mac(path: Path) -> str | None:
    """The MAC of eth0 inside the slot namespace at `path` (a slot made by an older server may
    not have the derived one), or None if it is not (or no longer) a slot."""
    host_ns = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        ns_fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        os.close(host_ns)
        return None
    try:
        try:
            linux.setns(ns_fd, linux.CLONE_NEWNET)  # EINVAL: a file not yet bind-mounted
        except OSError:
            return None
        try:
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # ioctls act in its netns
        finally:
            linux.setns(host_ns, linux.CLONE_NEWNET)
        with sock:
            req = struct.pack("16s16x", b"eth0")
            try:
                raw = fcntl.ioctl(sock.fileno(), _SIOCGIFHWADDR, req)
            except OSError:
                return None
        return ":".join(f"{byte:02x}" for byte in raw[18:24])
    finally:
        os.close(ns_fd)
        os.close(host_ns)


def _run(*argv: str, stdin: str | None = None) -> None:
    proc = subprocess.run(argv, input=stdin, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise AenvError(ErrorCode.INTERNAL,
                        f"network: `{' '.join(argv)}` failed: {proc.stderr.strip()}")


def _is_ipv4(text: str) -> bool:
    try:
        ipaddress.IPv4Address(text)
    except ValueError:
        return False
    return True


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
        self._nft = Nft()  # used from host-namespace threads only
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
        if Path(f"/sys/class/net/{self.bridge}/address").read_text().strip() != BRIDGE_MAC:
            # Announced (gratuitous ARP) to sandboxes already up, e.g. after an upgrade.
            Path(f"/proc/sys/net/ipv4/conf/{self.bridge}/arp_notify").write_text("1")
            with Netlink() as host:
                host.set_link(ifindex(self.bridge), mac=BRIDGE_MAC)
        prefix = f"{self.host_address}/{self.subnet.prefixlen}"
        out = subprocess.run(["ip", "-4", "-o", "addr", "show", "dev", self.bridge],
                             capture_output=True, text=True, check=False).stdout
        if prefix not in out:
            _run("ip", "addr", "add", prefix, "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        Path("/proc/sys/net/ipv4/ip_forward").write_text("1")
        self._nft.run(self._ruleset())
        self._bind_existing_slots()

    def _ruleset(self) -> str:
        """Our two tables, (re)loaded as one transaction. Chains are flushed and refilled;
        the `ports` set keeps its elements: slots of live sandboxes, also of another server
        on this host, stay bound while a server (re)starts. Only sandboxes' traffic is
        masqueraded: the host's own from the bridge address (to itself over lo) keeps it."""
        br, ports = self.bridge, f'"{VETH_PREFIX}*"'
        dns = self.host_dns()
        dns_elements = f"add element ip aenv host_dns {{ {', '.join(dns)} }}\n" if dns else ""
        arp_is_ipv4_over_ethernet = "arp htype 1 arp ptype ip arp hlen 6 arp plen 4"
        return f"""
add table bridge aenv
add set bridge aenv ports {{ type ifname . ether_addr . ipv4_addr; }}
add chain bridge aenv prerouting {{ type filter hook prerouting priority filter; policy accept; }}
add chain bridge aenv forward {{ type filter hook forward priority filter; policy accept; }}
flush chain bridge aenv prerouting
flush chain bridge aenv forward
add rule bridge aenv prerouting iifname != {ports} accept
add rule bridge aenv prerouting ether type ip iifname . ether saddr . ip saddr @ports accept
add rule bridge aenv prerouting ether type arp {arp_is_ipv4_over_ethernet} \
    iifname . ether saddr . arp saddr ip @ports iifname . arp saddr ether . arp saddr ip @ports \
    accept
add rule bridge aenv prerouting drop
add rule bridge aenv forward iifname {ports} oifname {ports} drop

add table ip aenv
add set ip aenv host_dns {{ type ipv4_addr; }}
add map ip aenv {egress.FORWARD_MAP} {{ type ipv4_addr : verdict; }}
add map ip aenv {egress.NAT_MAP} {{ type ipv4_addr : verdict; }}
add set ip aenv {egress.PROXY_PORTS_SET} {{ type inet_service; }}
add chain ip aenv egress_prerouting {{ type nat hook prerouting priority dstnat; \
    policy accept; }}
add chain ip aenv egress_forward {{ type filter hook forward priority filter + 1; \
    policy accept; }}
add chain ip aenv egress_input {{ type filter hook input priority filter + 1; \
    policy accept; }}
add chain ip aenv postrouting {{ type nat hook postrouting priority srcnat; policy accept; }}
add chain ip aenv forward {{ type filter hook forward priority filter; policy accept; }}
add chain ip aenv input {{ type filter hook input priority filter; policy accept; }}
add chain ip aenv output {{ type filter hook output priority filter; policy accept; }}
flush chain ip aenv egress_prerouting
flush chain ip aenv egress_forward
flush chain ip aenv egress_input
flush chain ip aenv postrouting
flush chain ip aenv forward
flush chain ip aenv input
flush chain ip aenv output
flush set ip aenv host_dns
{dns_elements}
add rule ip aenv postrouting ip saddr {self.subnet} ip saddr != {self.host_address} \
    oifname != "{br}" masquerade
add rule ip aenv forward iifname "{br}" oifname "{br}" drop
add rule ip aenv forward iifname "{br}" ip daddr 169.254.0.0/16 drop
add rule ip aenv egress_forward iifname "{br}" ip saddr vmap @{egress.FORWARD_MAP}
add rule ip aenv egress_prerouting iifname "{br}" ip saddr vmap @{egress.NAT_MAP}
add rule ip aenv egress_input iifname "{br}" ip daddr @host_dns ct state new \
    ip saddr vmap @{egress.FORWARD_MAP}
add rule ip aenv input iifname "{br}" ct state established,related accept
add rule ip aenv input iifname "{br}" ct status dnat ip daddr {self.host_address} \
    tcp dport @{egress.PROXY_PORTS_SET} accept
add rule ip aenv input iifname "{br}" ip daddr @host_dns meta l4proto {{ tcp, udp }} \
    th dport 53 accept
add rule ip aenv input iifname "{br}" meta l4proto tcp reject with tcp reset
add rule ip aenv input iifname "{br}" drop
add rule ip aenv output oifname "{br}" icmp type redirect drop
"""

    def host_dns(self) -> list[str]:
        """The host's resolvers that sandboxes use (its resolv.conf's IPv4 nameservers)."""
        return sorted({word for line in (etc_files.host_resolv_conf() or "").splitlines()
                       if line.startswith("nameserver")
                       for word in line.split()[1:2] if _is_ipv4(word)})

    def run_nft(self, commands: str) -> None:
        """Run an nft transaction on our tables (blocking: from a host-namespace thread)."""
        self._nft.run(commands)

    def _bind_existing_slots(self) -> None:
        """Elements and port isolation for slots already on the host (made by a previous
        server, or by an older version with random MACs: the MAC is read back)."""
        if not self.netns_dir.is_dir():
            return
        elements: list[str] = []
        with Netlink() as host:
            for entry in self.netns_dir.iterdir():
                try:
                    slot = self.slot_by_name(entry.name)
                except AenvError:
                    continue
                port = ifindex(slot.veth)
                mac = _read_eth0_mac(entry) if port else None
                if mac is None:
                    continue  # not made yet: its maker binds it
                with contextlib.suppress(OSError):
                    host.isolate_bridge_port(port)
                    host.guard_bridge_port(port, mac)
                elements.append(_port_element(slot.veth, mac, slot.address))
        if elements:
            self._nft.run("".join(f"add element bridge aenv ports {e}\n" for e in elements))

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
                Path("/proc/sys/net/ipv4/ping_group_range").write_text(PING_GROUP_RANGE)
                Path("/proc/sys/net/ipv4/ip_unprivileged_port_start").write_text("0")
                inner = Netlink()  # bound to the slot's namespace for good
            finally:
                linux.setns(host_ns, linux.CLONE_NEWNET)
            ns_fd = os.open(slot.path, os.O_RDONLY | os.O_CLOEXEC)
            bridge = ifindex(self.bridge)
            with Netlink() as host:
                host.add_veth(veth, "eth0", ns_fd, peer_index=2, peer_mac=slot.mac)  # lo is 1
                _disable_ipv6(veth)
                port = ifindex(veth)
                host.set_link(port, master=bridge)
                host.isolate_bridge_port(port)
                host.guard_bridge_port(port, slot.mac)
                # Bound before the port goes up: the bridge drops every frame of an unbound port.
                self._bind(slot)
                host.set_link(port, up=True)
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

    def _bind(self, slot: Slot) -> None:
        element = f"add element bridge aenv ports {_port_element(slot.veth, slot.mac, slot.address)}"
        try:
            self._nft.run(element)
        except AenvError:
            # Our tables are gone (`nft flush ruleset` by someone else): put them back rather
            # than fail every create; without them no slot would be isolated at all.
            self._nft.run(self._ruleset())
            self._bind_existing_slots()
            self._nft.run(element)

    def _delete_slot(self, slot: Slot) -> None:
        """Unpin the namespace. The kernel destroys it once no process is inside, and its
        veth pair with it, batched with other dying namespaces: far cheaper than deleting
        each veth, which holds the rtnl lock (blocking every create) for an RCU period."""
        with contextlib.suppress(OSError):
            linux.umount2(str(slot.path), linux.MNT_DETACH)
        # Before the file goes (then the index may be taken again). An element left behind
        # (a crash) is harmless: it names what the next slot of that index gets anyway.
        with contextlib.suppress(AenvError):
            self._nft.run(f"delete element bridge aenv ports "
                          f"{_port_element(slot.veth, slot.mac, slot.address)}")
        with contextlib.suppress(AenvError):  # its egress policy, if it had one
            self._nft.run(egress.clear_commands(slot.index, slot.address))
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
        # Slots in use belong to sandboxes that outlived a server: attach() claims them and
        # destroy() releases them.
        await self.collect_abandoned(foreign_only=False)
        self._started = True
        self._kick()

    async def collect_abandoned(self, foreign_only: bool = True) -> int:
        """Delete slots that no process uses and no pool holds: those of sandboxes a crashed
        server left behind, once their processes are gone. `foreign_only`: only slots made
        by another (dead) server process; ours may be being made right now. Returns how
        many were deleted."""
        _, abandoned = await asyncio.to_thread(self._scan_existing)
        if foreign_only:
            abandoned = [slot for slot in abandoned if slot.owner != os.getpid()]
        for slot in abandoned:
            await asyncio.to_thread(self._delete_slot, slot)
        return len(abandoned)

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
            self._nft.close()
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
        slot = self._used.pop(name, None)
        if slot is None:
            slot = self.slot_by_name(name)
            if slot.owner == os.getpid():
                # Released before (a second destroy of the same handle): its index may be a
                # newer slot's now, under the very same name. Only a slot a previous server
                # made (another owner pid, never reissued by us) is deleted by name.
                return
        await asyncio.to_thread(self._delete_slot, slot)
        self._kick()
