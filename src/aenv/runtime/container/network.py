"""Outside network for container sandboxes: a pool of pre-made network namespaces ("slots").

A slot is a named network namespace (a bind-mounted nsfs file `/run/aenv/netns/s<N>`) holding
`eth0` with 10.88.x.y/16 and a default route via the host bridge `aenv0` (10.88.0.1), joined
through a veth pair whose host end `aenvh<N>` is a bridge port. nftables masquerades the subnet
towards the host's other interfaces. Making a slot takes a few `ip` runs (tens of ms), so slots
are made ahead of time, off the create path; a sandbox with internet access setns()es into a
slot instead of unsharing a fresh (loopback-only) namespace. Slots are never reused: a released
slot is deleted and the pool refilled.

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
from dataclasses import dataclass
from pathlib import Path

from aenv.errors import AenvError, ErrorCode
from aenv.runtime.container import linux

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


class NetworkPool:
    """Pre-made network slots. One instance per driver; all state lives here."""

    def __init__(self, bridge: str = "aenv0", subnet: str = "10.88.0.0/16", warm: int = 4,
                 netns_dir: Path = NETNS_DIR) -> None:
        self.bridge = bridge
        self.subnet = ipaddress.IPv4Network(subnet)
        self.host_address = str(self.subnet.network_address + 1)
        self.warm = warm
        self.netns_dir = netns_dir
        self._free: list[Slot] = []
        self._used: dict[str, Slot] = {}
        self._making = 0
        self._refill: asyncio.Task[None] | None = None
        self._started = False

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
            while f"s{index}" in taken:
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
        slot = self._reserve()
        veth = f"{VETH_PREFIX}{slot.index}"
        path = str(slot.path)
        try:
            _run("unshare", f"--net={path}", "true")
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0",
                 "netns", path)
            _disable_ipv6(veth)
            _run("ip", "link", "set", veth, "master", self.bridge, "up")
            inner = (
                "for f in /proc/sys/net/ipv6/conf/*/disable_ipv6; do echo 1 > $f; done 2>/dev/null;"
                " exec ip -b -"
            )
            batch = (f"link set lo up\n"
                     f"addr add {slot.address}/{self.subnet.prefixlen} dev eth0\n"
                     f"link set eth0 up\n"
                     f"route add default via {self.host_address}\n")
            _run("nsenter", f"--net={path}", "sh", "-c", inner, stdin=batch)
        except BaseException:
            self._delete_slot(slot)
            raise
        return slot

    def _delete_slot(self, slot: Slot) -> None:
        veth = f"{VETH_PREFIX}{slot.index}"
        if Path(f"/sys/class/net/{veth}").exists():
            subprocess.run(["ip", "link", "del", veth], capture_output=True, check=False)
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
        used = [slot for ino, slot in inodes.items() if ino in live]
        abandoned = [slot for ino, slot in inodes.items() if ino not in live
                     and (slot.owner == os.getpid() or not Path(f"/proc/{slot.owner}").exists())]
        return used, abandoned

    # -- async API ------------------------------------------------------------------------
    async def start(self) -> None:
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
