"""A sandbox's egress policy (E2B's `network.allowOut` / `denyOut` / `dnsServers`), as data.

Parsed and validated once from the API's fields (`parse_policy`), kept in the sandbox record
and in the runtime handle as JSON, and enforced by the runtime (the container runtime: per-slot
nftables sets and a transparent proxy for domain rules, `runtime/container/egress.py`).

E2B's semantics, which this module is the one statement of:
- a destination in `allowOut` is allowed, whatever `denyOut` says (allow wins);
- otherwise a destination in `denyOut` is refused; anything else is allowed (no rules: all);
- `allowOut` may name domains (`example.com`, `*.example.com`: subdomains at any depth, not
  the apex): a TCP connection to port 80 or 443 whose address would be refused goes through
  only if its HTTP Host header (80) or TLS SNI (443) matches one; other ports and UDP are
  decided by address alone;
- when `allowOut` names a domain, the `dnsServers` (8.8.8.8 unless given) are allowed;
- `allow_internet_access: false` is `denyOut: ["0.0.0.0/0"]`.
Owns nothing on the host.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aenv.errors import invalid

ALL_TRAFFIC = "0.0.0.0/0"
DEFAULT_DNS_SERVERS = ("8.8.8.8",)
MAX_RULES = 256  # per list: each is a set element, and the proxy walks the domain list
MAX_DNS_SERVERS = 10
_LABEL = r"(?!-)[a-z0-9-]{1,63}(?<!-)"
_DOMAIN_RE = re.compile(rf"^(\*\.)?{_LABEL}(\.{_LABEL})*$")
# E2B's ports for domain rules: HTTP (Host header) and TLS (SNI).
DOMAIN_PORTS = (80, 443)


def _network(text: str) -> ipaddress.IPv4Network | None:
    """`text` as an IPv4 network (a bare address is a /32), or None if it is not one."""
    try:
        return ipaddress.IPv4Network(text, strict=False)
    except ValueError:
        return None


@dataclass(frozen=True)
class EgressPolicy:
    """Normalised rules: networks as `a.b.c.d/n` strings (sorted, merged), domains lowercase."""

    allow: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()
    domains: tuple[str, ...] = ()
    dns_servers: tuple[str, ...] = DEFAULT_DNS_SERVERS

    @property
    def active(self) -> bool:
        """Whether anything can be refused: with no deny rule, every destination is allowed."""
        return bool(self.deny)

    @property
    def allowed_networks(self) -> tuple[str, ...]:
        """What is allowed by address: `allow`, plus the DNS servers when domains are named."""
        extra = self.dns_servers if self.domains else ()
        return _collapse([*self.allow, *extra])

    def host_allowed(self, host: str) -> bool:
        """Whether a name (a Host header without its port, or an SNI) matches a domain rule."""
        name = host.strip().rstrip(".").lower()
        if not name:
            return False
        for rule in self.domains:
            if rule.startswith("*."):
                if name.endswith(rule[1:]) and len(name) > len(rule) - 1:
                    return True
            elif name == rule:
                return True
        return False

    def to_json(self) -> dict[str, Any]:
        return {"allow": list(self.allow), "deny": list(self.deny),
                "domains": list(self.domains), "dns_servers": list(self.dns_servers)}

    @classmethod
    def from_json(cls, raw: dict[str, Any] | None) -> EgressPolicy:
        raw = raw or {}
        return cls(allow=tuple(raw.get("allow", ())), deny=tuple(raw.get("deny", ())),
                   domains=tuple(raw.get("domains", ())),
                   dns_servers=tuple(raw.get("dns_servers", DEFAULT_DNS_SERVERS)))


def _collapse(networks: Sequence[str]) -> tuple[str, ...]:
    nets = [ipaddress.IPv4Network(n) for n in networks]
    return tuple(str(n) for n in ipaddress.collapse_addresses(nets))


def parse_policy(allow_out: Sequence[str] | None, deny_out: Sequence[str] | None,
                 dns_servers: Sequence[str] | None = None,
                 allow_internet_access: bool | None = None) -> EgressPolicy:
    """The policy of E2B's fields; AenvError(INVALID_ARGUMENT) naming the first bad entry."""
    allow: list[str] = []
    domains: list[str] = []
    for name, values in (("allowOut", allow_out), ("denyOut", deny_out)):
        if values is not None and len(values) > MAX_RULES:
            raise invalid(f"network.{name}: at most {MAX_RULES} entries")
    for entry in allow_out or ():
        net = _network(entry.strip())
        if net is not None:
            allow.append(str(net))
            continue
        domain = entry.strip().rstrip(".").lower()
        if domain == "*" or not _DOMAIN_RE.match(domain) or len(domain) > 253:
            raise invalid(f"network.allowOut: {entry!r} is neither an IPv4 address, a CIDR "
                          "block nor a domain name (example.com, *.example.com)")
        domains.append(domain)
    deny: list[str] = []
    for entry in deny_out or ():
        net = _network(entry.strip())
        if net is None:
            raise invalid(f"network.denyOut: {entry!r} is not an IPv4 address or CIDR block "
                          "(domain names are not supported in deny rules)")
        deny.append(str(net))
    if allow_internet_access is False:
        deny.append(ALL_TRAFFIC)
    servers: tuple[str, ...]
    if dns_servers is None:
        servers = DEFAULT_DNS_SERVERS
    else:
        if len(dns_servers) > MAX_DNS_SERVERS:
            raise invalid(f"network.dnsServers: at most {MAX_DNS_SERVERS} entries")
        for entry in dns_servers:
            try:
                ipaddress.IPv4Address(entry)
            except ValueError:
                raise invalid(f"network.dnsServers: {entry!r} is not an IPv4 address") from None
        servers = tuple(dict.fromkeys(dns_servers))
    return EgressPolicy(allow=_collapse(allow), deny=_collapse(deny),
                        domains=tuple(dict.fromkeys(domains)), dns_servers=servers)
